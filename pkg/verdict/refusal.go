package verdict

import (
	"errors"
	"strconv"
	"time"
)

// ErrRateLimited is matched by every *RateLimitedError. A callback may also
// return it bare (or wrapped) for a refusal without a hint.
var ErrRateLimited = errors.New("rate limited")

// RateLimitedError is a refusal by something in this process - a limiter, a
// concurrency bound, a lock, a load shedder - before the call left it: the
// error form of [Refused]. It lives here, beside the verdict it stands for,
// so that limiters can return it without importing the SDK; package sdk
// re-exports it, and its executor turns it into Refused ahead of every
// classifier rule.
type RateLimitedError struct {
	// Limiter names what refused, e.g. a limiter or kernel rule name.
	Limiter string
	// RetryAfter is the limiter's hint, honoured verbatim (capped by the
	// policy's MaxDelay and deadline). Zero or negative means no hint: the
	// retry takes the throttled backoff curve.
	RetryAfter time.Duration
	// Err is the underlying cause, if any (e.g. the EPERM a kernel refusal
	// surfaced as).
	Err error
}

func (e *RateLimitedError) Error() string {
	s := "rate limited"
	if e.Limiter != "" {
		s += " by " + strconv.Quote(e.Limiter)
	}
	if e.RetryAfter > 0 {
		s += " (retry after " + e.RetryAfter.String() + ")"
	}
	if e.Err != nil {
		s += ": " + e.Err.Error()
	}
	return s
}

// Is matches ErrRateLimited.
func (e *RateLimitedError) Is(target error) bool { return target == ErrRateLimited }

// Unwrap returns the cause.
func (e *RateLimitedError) Unwrap() error { return e.Err }

// Verdict returns the refusal's verdict: Throttled, SelfImposed, with the
// hint when one was given.
func (e *RateLimitedError) Verdict() Verdict {
	if e.RetryAfter > 0 {
		return Refused(e.RetryAfter)
	}
	return Refused(NoRetryAfter)
}

// IsRateLimited reports whether err is, or wraps, a refusal by this process.
func IsRateLimited(err error) bool { return errors.Is(err, ErrRateLimited) }

// AsRateLimited returns the *RateLimitedError in err's chain, if any.
func AsRateLimited(err error) (*RateLimitedError, bool) {
	return errors.AsType[*RateLimitedError](err)
}
