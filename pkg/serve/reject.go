package serve

import (
	"context"
	"errors"
	"net/http"
	"strconv"
	"time"

	"github.com/egressd/egressd/pkg/verdict"
)

// Rejection is a request a policy did not admit.
type Rejection struct {
	// Policy is the policy's name.
	Policy string
	// Partition is the request's partition key.
	Partition string
	// Outcome is Refused, Cancelled or Failed.
	Outcome Outcome
	// RetryAfter is the refusal's hint: how long until the limiter expects
	// a permit to be free (the next token, the oldest counted segment
	// leaving the window). Zero when it gave none: a concurrency limiter's
	// refusal, and every outcome but Refused.
	RetryAfter time.Duration
	// Err is what the limiter returned: a *verdict.RateLimitedError for a
	// refusal, the context's error, or the error that left it without a
	// decision.
	Err error
}

// rejection describes err, what a policy's Acquire returned for r.
func rejection(policy, key string, r *http.Request, err error) *Rejection {
	rej := &Rejection{Policy: policy, Partition: key, Err: err}
	if rl, ok := verdict.AsRateLimited(err); ok {
		rej.Outcome, rej.RetryAfter = Refused, max(rl.RetryAfter, 0)
		return rej
	}
	if r.Context().Err() != nil || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		rej.Outcome = Cancelled
		return rej
	}
	rej.Outcome = Failed
	return rej
}

// DefaultReject answers a request that was not admitted:
//
//   - Refused and Cancelled: 429 Too Many Requests, with Retry-After when
//     the refusal gave a hint (see [FormatRetryAfter]). A caller whose wait
//     in the queue outlasted its deadline was turned away by the limit,
//     not by a fault.
//   - Failed: 503 Service Unavailable, without Retry-After: nothing says
//     when the limiter will have an answer again.
//
// The body is the status text. A client behind package sdkhttp reads the
// 429 as Throttled, honouring Retry-After, with no evidence against its
// breaker.
func DefaultReject(w http.ResponseWriter, r *http.Request, rej *Rejection) {
	code := http.StatusTooManyRequests
	if rej.Outcome == Failed {
		code = http.StatusServiceUnavailable
	} else if v, ok := FormatRetryAfter(rej.RetryAfter); ok {
		w.Header().Set("Retry-After", v)
	}
	http.Error(w, http.StatusText(code), code)
}

// FormatRetryAfter formats d as a Retry-After value: delay seconds, whole,
// rounded up, so that a client that waits as long as it is told finds the
// permit it was told of rather than arriving a fraction of a second early
// and being refused again. ok is false for d of zero or less: no hint.
func FormatRetryAfter(d time.Duration) (string, bool) {
	if d <= 0 {
		return "", false
	}
	s := d / time.Second
	if d%time.Second != 0 {
		s++
	}
	return strconv.FormatInt(int64(s), 10), true
}
