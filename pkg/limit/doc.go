// Package limit bounds what leaves this process: the rate of outbound calls,
// or how many run at once. It is the in-process counterpart of the kernel's
// rules, with the same four shapes and the same arithmetic:
//
//   - PerSecond: a token bucket of Permits per second holding Burst (one
//     second's worth unless set), refilled lazily on each acquire.
//   - PerWindow: at most Permits in any sliding Window, tracked in Segments
//     (8 unless set), so a quota cannot be spent twice across a boundary.
//   - Concurrency: at most N leases held at once (a bulkhead).
//   - Adaptive: a concurrency limit that package adaptive moves by watching
//     latency; the time a lease is held is the sample. Its defaults are
//     package adaptive's, drain probes included (ProbeEvery NoProbes is the
//     reference loop); the probes' windows are on the real clock, so hosts
//     whose clocks agree probe in the same windows.
//
// Exactly one shape per [Options]; [Options.Validate] lists every problem at
// once.
//
// A limiter goes inside the callback a retry policy runs, never around it:
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
// Retries re-invoke the callback, so a permit is taken once per attempt; a
// waiting acquire is bounded by the attempt's context; and the refusal is a
// *verdict.RateLimitedError (the SDK's *sdk.RateLimitedError: one type under
// two names), which the executor turns into verdict.Refused
// (Throttled, SelfImposed) ahead of every classifier rule: retried on the
// throttled curve, honouring the limiter's RetryAfter, no evidence against the
// breaker, no charge against the retry budget. RetryAfter is the time to the
// next token (PerSecond) or until the oldest counted segment leaves the window
// (PerWindow); the concurrency shapes give none.
//
// QueueLimit is 0 by default: a caller that cannot have a permit is refused at
// once, because the executor is already good at waiting, and waiting there is
// visible as a retry. With a queue, Acquire waits in order (oldest first by
// default) until a permit is free or its context is done, which returns the
// context's error: cancellation stays cancellation, and time spent queued
// counts against the attempt's timeout.
//
// The arithmetic is pure: the bucket and the window take the instant as an
// argument and never read a clock, so they are table-tested at fixed instants;
// a [Local] reads the real clock, and its tests run on the fake one of a
// testing/synctest bubble. State reaches metrics through an
// [Observer]; package limitmetrics implements it with Prometheus. Besides the
// standard library the package imports only packages adaptive and verdict,
// not the SDK; a test holds it to that.
package limit
