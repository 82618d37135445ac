// Package sdk runs calls to a dependency with retries, a retry budget and a
// circuit breaker, and tells "this process refused me" apart from "the
// dependency failed me".
//
// Run (value and error) and Try (the full Result: value, error, attempt
// log, stop reason) run a callback under a Policy:
//
//	p := sdk.HTTPDefaults() // one per dependency: it owns a budget and a breaker
//	body, err := sdk.Run(ctx, p, func(ctx context.Context) ([]byte, error) {
//		return fetch(ctx) // ctx is min(AttemptTimeout, remaining deadline), linked with the caller's
//	})
//
// Run and Try never hedge, and allocate nothing on the success path;
// RunHedged and TryHedged race copies of a slow attempt (see Hedge).
//
// Each attempt's error is classified into a verdict.Verdict. Transient and
// Throttled are retried on their own backoff curves, a RetryAfter from the
// server or a limiter winning over the curve. A refusal by this process (a
// *RateLimitedError, ErrRateLimited, an Admit hook saying no) is
// verdict.Refused, whatever the classifier's rules: it takes the throttled
// curve, is no evidence against the breaker, and neither spends nor funds
// the retry budget. So put guards that limit outbound work inside the
// callback or in Admit, never around Run: each attempt then takes its own
// permit, bounded by its context, and a refusal is classified.
//
// docs/sdk.md is the guide.
package sdk
