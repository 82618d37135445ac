// Package sdk runs calls to a dependency with retries, a retry budget and a
// circuit breaker, and tells "this process refused me" apart from "the
// dependency failed me".
//
// The core is Run (value and error) and Try (the full Result: value, error,
// attempt log, stop reason), both driven by a Policy:
//
//	p := sdk.HTTPDefaults() // one per dependency: it owns a budget and a breaker
//	body, err := sdk.Run(ctx, p, func(ctx context.Context) ([]byte, error) {
//		return fetch(ctx) // ctx is min(AttemptTimeout, remaining deadline), linked with the caller's
//	})
//
// Run and Try never hedge, and allocate nothing on the success path, even
// for a closure that captures the caller's variables. RunHedged and
// TryHedged are the same calls with the policy's Hedge: copies of a slow
// attempt raced beside it (see Hedge).
//
// Each attempt's error is classified into a verdict.Verdict. Transient and
// Throttled are retried on their own backoff curves; a RetryAfter from the
// server or a limiter wins over the curve. A refusal by something in this
// process - a *RateLimitedError, ErrRateLimited, or an Admit hook saying no -
// becomes verdict.Refused (Throttled, SelfImposed): it takes the throttled
// curve, records no evidence against the breaker (but returns its half-open
// probe slot), and neither spends nor funds the retry budget. The classifier
// recognises it before any user rule, so no rule can downgrade it.
//
// Guards that limit outbound work belong inside the callback (or in the Admit
// hook), never around Run: retries re-invoke the callback, so a permit taken
// there is taken once per attempt, bounded by the attempt's context, and its
// refusal is classified.
//
// The executor reads the real clock; the decisions it makes from the time
// (the breaker's, the backoff's, the attributor's) take it as an argument.
// The package's tests run in testing/synctest bubbles, on a fake clock, and
// never sleep.
package sdk
