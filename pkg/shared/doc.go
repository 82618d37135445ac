// Package shared is package limit's limiters with their state in Redis, so
// that every process using the same key spends one budget: a quota that is
// per account, not per host. Set [Options.Key] and one shape: FixedWindow,
// SlidingWindow, TokenBucket, or Concurrency (leases that their holder
// renews, and that expire once a holder that died stops renewing them).
//
//	l, err := shared.New(rdb, shared.Options{Key: "partner-api",
//		TokenBucket: &shared.TokenBucketOptions{TokenLimit: 20, TokensPerPeriod: 5, ReplenishmentPeriod: 10 * time.Second}})
//	lease, err := l.Acquire(ctx) // inside the retry callback, as with package limit
//
// Each admission is one atomic script on the Redis server's clock. A refusal
// is an *sdk.RateLimitedError, self-imposed as package limit's; its
// RetryAfter is a computed wait, not a reservation. Every process sharing a
// key must use the same shape and settings; [KeyFor] builds per-tenant keys.
// Queues and [Limiter.Statistics] are this process's alone.
//
// When Redis gives no decision, FailureMode says what Acquire does: Throw
// returns a [*StoreError] (the default), Allow admits without counting, Deny
// refuses; a context that ends is returned as itself. A lost reply is not a
// refusal: a permit may have been spent all the same.
//
// [Slots] and [Grants] hold one holder's share of a budget, for a daemon
// that enforces it in the kernel. docs/sdk.md ("Shared limiters: shared")
// has the shapes' arithmetic, the retries and the failure modes;
// docs/design.md ("Shared budgets") how the daemon holds its share.
package shared
