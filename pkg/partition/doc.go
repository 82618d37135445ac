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
// Options.Local makes each partition a limit.Local, Options.Shared a
// shared.Limiter on the key shared.KeyFor(Shared.Key, partition), and
// Options.New anything else that [Adapt] fits to [Limiter].
//
// A partition unused for IdleTimeout is evicted, lazily, by a later Acquire
// or by [Partitioned.Sweep], but never while a lease holds one of its
// permits nor before forgetting it changes what the limit allows; an
// adaptive partition forgets the limit it learned. Beyond MaxPartitions a
// new key is refused ([ErrTooManyPartitions]). Keys are kept, and written
// to Redis, in clear: hash sensitive identifiers first. A key longer than
// [MaxKeyLen] is shortened with its SHA-256. docs/serving.md has the rules
// in full.
package partition
