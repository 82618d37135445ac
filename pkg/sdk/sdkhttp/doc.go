// Package sdkhttp is the SDK's http.RoundTripper stack: retries from an
// sdk.Policy and, inside the retry loop, the guards that run once per
// attempt - in-process limiters and the dependency's published quota.
//
//	rt, err := sdkhttp.NewStack(nil). // nil: http.DefaultTransport
//		Retry(sdkhttp.Defaults()).      // outermost: one sdk.Run per request
//		Quota(sdkhttp.QuotaOptions{}).  // per attempt: the published allowance
//		Limit(limit.PerSecond(100)).    // per attempt: one permit each
//		Build()
//	client := &http.Client{Transport: rt}
//
// Steps run outermost first, in the order added: Retry first, or a guard
// would take one permit for a request's several attempts, then Quota, so
// that an attempt it refuses spends no permit, then Limit. Build lists
// every problem of a wrong stack in a *StackError.
//
// RoundTrip returns the last attempt's response with a nil error, whatever
// its status; it returns an error only when the last attempt got no
// response or the caller's context ended. WithResult exposes the attempt
// log. Every method is retried when the policy says so (only idempotent
// ones are hedged): send what must not be repeated through a policy that
// makes one attempt. A body without GetBody is replayed from memory up to
// MaxBufferedBody and refused beyond it (ErrBodyNotReplayable). Close every
// response body: until then it holds its Limit permit and is bounded by
// the attempt's deadline, so a download longer than AttemptTimeout needs a
// policy with a longer one.
//
// docs/sdk.md ("HTTP: sdkhttp") has the status codes, the quota headers,
// hedging and kernel refusals.
package sdkhttp
