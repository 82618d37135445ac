// Package shared is package limit's limiters with their state in Redis, so
// that every process using the same key spends one budget: a quota that is
// per account, not per host. Four shapes, one per [Options]:
//
//   - FixedWindow: at most Permits in each Window, windows aligned to the
//     Redis server's clock. Calls on either side of a boundary can spend two
//     windows' budgets close together.
//   - SlidingWindow: at most Permits in any Window, tracked in Segments
//     (1..1000, each at least a millisecond): a permit counts until its
//     segment leaves the window. A segmented approximation, not a log: a
//     segment's permits may come back up to one segment early, and the
//     segment is Window / Segments rounded down to the microsecond.
//   - TokenBucket: a bucket of TokenLimit, which starts full and gains
//     TokensPerPeriod for each whole ReplenishmentPeriod, refilled lazily on
//     each acquire; no timer runs anywhere.
//   - Concurrency: at most Permits leases held at once, across processes.
//     Each lease is an entry with its own expiry, renewed by its holder every
//     LeaseDuration / 3 and deleted on Release: a holder that dies stops
//     counting once its lease expires. With Holders (egressd daemons share
//     the key), a budget Redis has no record of (its first use, or state
//     Redis lost) admits nothing for a LeaseDuration unless its Durability
//     is Persistent, as the holders' own [Slots] do.
//
// Each admission is one Lua script run atomically by Redis (EVALSHA, falling
// back to EVAL), which reads the server's clock (TIME) and reads and updates
// the state in one step: no client read-check-write, and no dependence on
// the callers' clocks agreeing. Clock steps on the server still move window
// and refill boundaries.
//
// A refusal is an *sdk.RateLimitedError, so an executor treats it as
// self-imposed (verdict.Refused) exactly as it does package limit's:
// RetryAfter is until the oldest counted window or segment expires, or until
// the next token; a concurrency refusal gives none, but during a freeze,
// until it ends. It is a computed wait, not a reservation.
//
// Every process sharing a key must use the same shape and settings: the state
// is read with each caller's configuration, and a key read as another shape
// fails (WRONGTYPE) or counts wrongly. Reserve separate keys for unrelated
// budgets; [KeyFor] builds per-tenant keys.
//
// [Slots] and [Grants] hold one holder's share of such a budget, for a
// daemon that enforces its host's share locally (in the kernel) instead of
// asking Redis per admission. Slots holds a number of a Concurrency budget's
// leases under a stable Holder id, grown, shrunk and renewed together by one
// Resize, and found again after a restart; Grants claims several of a
// TokenBucket's or SlidingWindow's permits at once, as many as are left,
// and returns those not spent. Both keep the Limiter's state layout, so
// Limiters and holders on one key spend one budget. Neither queues, renews
// by itself or has a FailureMode: a *StoreError goes to the caller, who
// decides what its host may do meanwhile.
//
// Queues and statistics are local: QueueLimit permits may wait in this
// process, served in QueueOrder, polling Redis after each refusal's
// RetryAfter (or every QueuePollInterval when there is none; a local Release
// wakes a concurrency queue at once). [Limiter.Statistics] counts this
// process's leases, not the cluster's.
//
// When no decision can be had from Redis, FailureMode says what Acquire does:
// Throw returns a [*StoreError] (the default), Allow grants a lease that
// records nothing (the limit stops being enforced), Deny refuses. Redis's
// own retryable replies (LOADING, BUSY, TRYAGAIN, MASTERDOWN, CLUSTERDOWN)
// are retried MaxRetries times first, with jittered backoff; network errors
// are retried by the client per its own MaxRetries, never here, because a
// lost reply may have been admitted. Grants and Slots send their scripts as
// commands no client sends twice (a ClusterClient would, whatever its
// MaxRetries): a Return applied twice would exceed the budget. A context that ends is returned as
// itself under every mode: cancellation stays cancellation.
//
// A lost reply is not a refusal: a permit may have been spent, or a
// concurrency lease created (it then expires unrenewed). State in Redis is
// as durable as the server makes it; a restart without persistence resets
// every budget.
package shared
