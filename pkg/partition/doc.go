// Package partition gives each partition of the traffic - a tenant, a
// client address, an authenticated identity - a limiter of its own, made on
// first use, so that one noisy partition spends its own budget and nobody
// else's:
//
//	tenants, err := partition.New(partition.Options{
//		Name:  "tenant-api",
//		Local: &limit.Options{PerSecond: &limit.PerSecondOptions{Permits: 100}},
//	})
//	lease, err := tenants.Acquire(ctx, tenant)
//	if err != nil {
//		return err // a refusal: *sdk.RateLimitedError
//	}
//	defer lease.Release()
//
// Every shape of package limit and package shared works, through one small
// interface ([Limiter]) that [Adapt] fits to either: Options.Local makes
// each partition a limit.Local, Options.Shared a shared.Limiter whose key is
// shared.KeyFor(Shared.Key, partition) - one Redis budget per partition,
// shared with every process using the same prefix - and Options.New
// anything else.
//
// # Eviction
//
// A partition nobody has used for IdleTimeout is forgotten, so that a
// stream of distinct keys does not grow the map for ever. Two rules keep
// that from changing what the limits allow:
//
//   - A partition is never evicted while anything is inside it: an Acquire
//     in progress (waiting in a queue, or asking Redis) or a lease that
//     holds a permit, not yet released (a rate permit is spent when taken,
//     and holds nothing). A concurrency partition evicted with leases out
//     would come back empty and admit past its bound.
//   - A local rate partition is kept at least until forgetting it changes
//     nothing: a PerSecond bucket until it would be full again, a PerWindow
//     until its window has passed. A shared partition's state is in Redis,
//     which eviction never touches: a later limiter with the same key
//     carries on where the evicted one left off.
//
// Evicting an adaptive partition forgets the limit it learned.
//
// Eviction is lazy: an Acquire sweeps the map when IdleTimeout/2 has passed
// since the last sweep, so no goroutine runs; [Partitioned.Sweep] sweeps at
// once for a caller that wants a ticker. Eviction reads the real clock; its
// tests run on the fake one of a testing/synctest bubble, without sleeping.
//
// At most MaxPartitions partitions are held. A new key beyond that is
// refused, as a *verdict.RateLimitedError wrapping [ErrTooManyPartitions],
// rather than admitted unlimited or let to push out a partition whose
// budget is not yet spent: a flood of new keys then costs newcomers, not
// the partitions already there, and bounded memory.
//
// Keys become map keys and, for shared partitions, Redis keys in clear:
// hash sensitive identifiers before passing them. A key longer than
// [MaxKeyLen] (256 bytes) is kept as its first bytes and the SHA-256 of
// the whole, 257 bytes in all, so that a caller who chooses its key (a
// header) cannot make each partition hold a megabyte; the shortened key
// is what Redis and errors see. Besides the standard
// library the package imports packages limit, verdict and shared, and with
// shared the Redis client; no Prometheus, no SDK and nothing of the
// kernel's, which a test holds it to.
package partition
