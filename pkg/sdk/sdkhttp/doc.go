// Package sdkhttp is the SDK's http.RoundTripper stack: retries from an
// sdk.Policy, and inside the retry loop the guards that must run once per
// attempt - in-process limiters and the dependency's published quota.
//
//	rt, err := sdkhttp.NewStack(nil). // nil: http.DefaultTransport
//		Retry(sdkhttp.Defaults()).      // outermost: one sdk.Run per request
//		Quota(sdkhttp.QuotaOptions{}).  // per attempt: the published allowance
//		Limit(limit.PerSecond(100)).    // per attempt: one permit each
//		Build()
//	client := &http.Client{Transport: rt}
//
// # Order
//
// Steps run in the order they are added, outermost first, the way
// IHttpClientFactory handlers do. Retry must come first: a Limit or Quota
// added before it would sit outside the retry loop, take one permit for a
// request that goes on to make several attempts, and let every retry bypass
// the bound. Build refuses that order (and every other problem, listed at
// once in a *StackError) rather than build something silently wrong. A
// stack without Retry is allowed: each request is then one attempt, and a
// refusal reaches the caller as a *sdk.RateLimitedError (wrapped by
// http.Client in a *url.Error).
//
// Put Quota before Limit: an attempt the quota refuses then spends no rate
// permit, and one a limiter refuses after the quota let it through is given
// back to the allowance. Several Limit steps may be stacked (a rate and a bulkhead, say);
// each takes its own permit per attempt.
//
// # Retries
//
// The Retry step runs each request through sdk.Run (sdk.RunHedged when it
// is hedged, see below) with a copy of the policy made at Build (its
// Budget, Breaker and Hedge are shared, as they are between copies: give
// each dependency its own policy). An attempt that gets a response of
// status 400 or more hands an *sdk.StatusError, with the response's
// Retry-After, to the policy's classifier, extended by Classifier so that:
//
//   - 429 is Throttled, honouring Retry-After (delay seconds or an
//     HTTP-date); without one it takes the throttled backoff curve;
//   - 503 with a Retry-After is Throttled too, honouring it: the server is
//     defending itself, not failing; without one it is Transient;
//   - 408, 500, 502 and 504 are Transient, with any Retry-After as the hint;
//   - every other status - 4xx, and the 5xx that say the server cannot do
//     this at all (501, 505, 511, ...) - is Permanent, as sdk.DefaultVerdict
//     has it; the classifier's own rules come first and may say otherwise.
//
// Whatever the verdicts, the response of the last attempt is what RoundTrip
// returns, with a nil error, so callers read status codes as they always
// do; an error is returned only when the last attempt got no response (a
// transport error, a refusal) or the caller's context ended the call.
// Responses of earlier attempts are closed. To see the attempt log and the stop reason, pass a
// *Result in the request's context with WithResult.
//
// Every method is retried when the policy says so (but only idempotent
// ones are hedged). A refusal in this process never sent anything, but a
// POST that got a 503 may have done some of its work: send requests that
// must not be repeated through a stack whose policy makes one attempt.
//
// A failed response's body is read into memory (up to 64 KiB) inside the
// attempt, so that its connection and any permit it holds are free during
// the backoff, and handed to the caller if it was the last attempt. A
// longer body is kept open until the next round starts (a retry; a hedge
// started beside an attempt may lose to it, and leaves its response alone)
// or the call ends.
//
// # Hedging
//
// With a policy whose Hedge is set, a request that has run for the hedge's
// delay gets a copy sent beside it (see sdk.Hedge for the delay, the gate
// and the accounting): the first response that answers it - any status
// below 400, or one the classifier calls Permanent - is returned, and the
// other copies are cancelled on the wire. Only idempotent requests are
// hedged (see Idempotent): GET, HEAD and OPTIONS, or any method with an
// Idempotency-Key header. They run through sdk.RunHedged; the others run
// through sdk.Run, under the same policy without its Hedge. Each copy
// sends its own copy of the body, as a retry does. The responses of copies
// that lost - one that answered too late, a failed one - are drained and
// closed, which gives back their connections and the permits Limit steps
// took for them. Each copy is an attempt: the Limit and Quota steps are
// asked for it, and may refuse it.
//
// # Request bodies
//
// A retried request must be sent again, body and all. A request with a
// GetBody (http.NewRequest sets it for *bytes.Buffer, *bytes.Reader and
// *strings.Reader bodies) sends Body on the first attempt and GetBody's
// copy on each later one. A body without GetBody of at most MaxBufferedBody
// bytes is read into memory before the first attempt and replayed from
// there. A longer one is refused with ErrBodyNotReplayable before anything
// is sent: set GetBody (re-open the file, say), or use a policy that makes
// one attempt, which sends the body as it is. Nothing streams an unbounded
// body into memory behind the caller's back.
//
// # Deadlines
//
// Each attempt's request carries the attempt's deadline - min(AttemptTimeout,
// remaining Deadline) - and the caller's context. The deadline keeps
// bounding the response body after RoundTrip returns, as http.Client.Timeout
// does, and is released when the body is read to its end or closed. A
// download longer than the policy's AttemptTimeout needs a policy with a
// longer (or no) AttemptTimeout and Deadline.
//
// # Limits
//
// The Limit step acquires one permit per attempt on the attempt's context
// and releases it when the response body is read to its end, fails or is
// closed, or at once when the attempt fails without a response. Close every
// body, as net/http requires: a body never closed holds its permit. A
// refusal is the limiter's *sdk.RateLimitedError, which the executor turns
// into verdict.Refused: retried on the throttled curve at the limiter's
// hint, no evidence against the breaker, no charge to the retry budget.
//
// # Published quota
//
// The Quota step reads what the dependency publishes on every response, per
// host (host and port, the scheme's default port left out):
//
//   - RateLimit-Remaining and RateLimit-Reset (the IETF draft; Reset is in
//     delay seconds);
//   - X-RateLimit-Remaining and X-RateLimit-Reset (Reset is delay seconds,
//     or a Unix time when it is larger than 1e9 - seconds, or milliseconds
//     above 1e12);
//   - Retry-After on a response of status 400 or more.
//
// Once the remaining allowance is at or below QuotaOptions.Reserve (default
// 0: spend the allowance, never exceed it) the step refuses attempts to that
// host, before they are sent, until the reset time passes, with a
// *sdk.RateLimitedError{Limiter: "quota:" + host, RetryAfter: time to the
// reset} wrapping ErrQuotaExhausted. A Retry-After refuses the host until it
// passes, whatever the allowance. See QuotaOptions for the details.
//
// # Criticality and deadlines across the process edge
//
// Propagate makes every attempt carry the caller's criticality and the
// attempt's remaining time in two headers (sdk.CriticalityHeader,
// sdk.TimeoutHeader), which package serve's middleware reads into the
// context of the handler on the other side: its own calls, their Admit
// hooks and their retry budgets see the level the first caller set, and
// none of them outlives the caller's deadline. It is off by default, since
// only servers that read the headers have a use for them.
//
// # Kernel refusals
//
// A connect() egressd refuses fails with EPERM, which http.Transport returns
// as a *net.OpError from its dial. Defaults puts sdk.DaemonAttributor(nil)
// in the policy's classifier, so that EPERM is attributed by asking the
// local daemon: a refusal of its own becomes a self-imposed refusal naming
// the rule, retried like any limiter's; anything else (a firewall, no daemon)
// stays Permanent. Nothing in this package is needed beyond that.
package sdkhttp
