// Package limit bounds what leaves this process: the rate of outbound calls,
// or how many run at once. It has the kernel rules' four shapes, with the
// same arithmetic: PerSecond (a token bucket), PerWindow (a sliding window
// in segments), Concurrency (a bulkhead), and Adaptive (a concurrency limit
// that package adaptive moves, a lease's holding time being its latency
// sample). Exactly one shape per [Options]; [Options.Validate] lists every
// problem at once.
//
// A limiter goes inside the callback a retry policy runs, never around it,
// so that each attempt takes its own permit, bounded by its own context:
//
//	l := limit.PerSecond(100) // give it the lifetime of what it protects
//	v, err := sdk.Run(ctx, p, func(ctx context.Context) (T, error) {
//		lease, err := l.Acquire(ctx) // ctx is the attempt's
//		if err != nil {
//			return zero, err // a refusal: *sdk.RateLimitedError
//		}
//		defer lease.Release()
//		return call(ctx)
//	})
//
// A refusal is a *verdict.RateLimitedError (sdk.RateLimitedError is the same
// type), which the executor retries as self-imposed, at its RetryAfter when
// the shape gives one. QueueLimit is 0 by default, refusing at once rather
// than waiting; with a queue, Acquire waits in order until a permit is free
// or its context ends. Metrics go through an [Observer] (package
// limitmetrics). docs/sdk.md ("In-process limiters: limit") has the rest.
package limit
