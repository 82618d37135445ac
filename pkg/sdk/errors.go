package sdk

import (
	"context"
	"errors"
	"strconv"
	"time"

	"github.com/egressd/egressd/pkg/verdict"
)

var (
	// ErrRateLimited is matched by every *RateLimitedError. A callback may
	// also return it bare (or wrapped) for a refusal without a hint. It is
	// verdict.ErrRateLimited.
	ErrRateLimited = verdict.ErrRateLimited
	// ErrAttemptsExhausted is matched by a *StopError whose Reason is
	// StopAttemptsExhausted.
	ErrAttemptsExhausted = errors.New("attempts exhausted")
	// ErrBudgetExhausted is matched by a *StopError whose Reason is StopBudget.
	ErrBudgetExhausted = errors.New("retry budget exhausted")
	// ErrBreakerOpen is matched by a *StopError whose Reason is StopBreakerOpen.
	ErrBreakerOpen = errors.New("breaker open")
	// ErrAttemptTimeout is matched by a *AttemptTimeoutError.
	ErrAttemptTimeout = errors.New("attempt timeout")
	// ErrNotAdmitted is matched by a *NotAdmittedError.
	ErrNotAdmitted = errors.New("not admitted")
	// ErrHedgeNeedsRunHedged is what a *StopError with Reason
	// StopInvalidUse wraps: Run or Try was given a policy with a Hedge,
	// which only RunHedged and TryHedged send.
	ErrHedgeNeedsRunHedged = errors.New("policy has a Hedge: call RunHedged or TryHedged")
)

// RateLimitedError is a refusal by something in this process - a limiter, a
// concurrency bound, a lock, a load shedder - before the call left it. The
// executor turns it into verdict.Refused, ahead of every classifier rule.
//
// It is verdict.RateLimitedError, which limiters return without importing
// this package; the alias keeps one type under both names.
type RateLimitedError = verdict.RateLimitedError

// IsRateLimited reports whether err is, or wraps, a refusal by this process.
func IsRateLimited(err error) bool { return verdict.IsRateLimited(err) }

// AsRateLimited returns the *RateLimitedError in err's chain, if any.
func AsRateLimited(err error) (*RateLimitedError, bool) { return verdict.AsRateLimited(err) }

// AttemptTimeoutError is an attempt cut short by the policy's AttemptTimeout.
// It is classified Transient by the executor, before any classifier rule.
type AttemptTimeoutError struct {
	Timeout time.Duration
	Err     error // what the callback returned
}

func (e *AttemptTimeoutError) Error() string {
	s := "attempt timeout (" + e.Timeout.String() + ")"
	if e.Err != nil {
		s += ": " + e.Err.Error()
	}
	return s
}

// Is matches ErrAttemptTimeout.
func (e *AttemptTimeoutError) Is(target error) bool { return target == ErrAttemptTimeout }

// Unwrap returns what the callback returned.
func (e *AttemptTimeoutError) Unwrap() error { return e.Err }

// NotAdmittedError is the error recorded for an attempt the Admit hook
// refused; the callback was not called.
type NotAdmittedError struct {
	Verdict verdict.Verdict
}

func (e *NotAdmittedError) Error() string { return "not admitted: " + e.Verdict.String() }

// Is matches ErrNotAdmitted.
func (e *NotAdmittedError) Is(target error) bool { return target == ErrNotAdmitted }

// StopError is the error Run and Try return when a call does not succeed.
// It says why the executor stopped, after how many attempts, and wraps the
// last attempt's error (or the context's, when no attempt ran).
//
// errors.Is matches the reason's sentinel: ErrAttemptsExhausted,
// ErrBudgetExhausted, ErrBreakerOpen, context.DeadlineExceeded for
// StopDeadline and context.Canceled for StopCancelled. StopPermanent has no
// sentinel of its own; match the wrapped cause. StopInvalidUse wraps its
// cause, ErrHedgeNeedsRunHedged.
type StopError struct {
	Reason   StopReason
	Attempts int
	Err      error
}

func (e *StopError) Error() string {
	s := e.Reason.String() + " (" + strconv.Itoa(e.Attempts) + " attempt"
	if e.Attempts != 1 {
		s += "s"
	}
	s += ")"
	if e.Err != nil {
		s += ": " + e.Err.Error()
	}
	return s
}

// Is matches the sentinel for the stop reason.
func (e *StopError) Is(target error) bool {
	switch e.Reason {
	case StopAttemptsExhausted:
		return target == ErrAttemptsExhausted
	case StopBudget:
		return target == ErrBudgetExhausted
	case StopBreakerOpen:
		return target == ErrBreakerOpen
	case StopDeadline:
		return target == context.DeadlineExceeded
	case StopCancelled:
		return target == context.Canceled
	}
	return false
}

// Unwrap returns the last attempt's error.
func (e *StopError) Unwrap() error { return e.Err }

// AsStop returns the *StopError in err's chain, if any.
func AsStop(err error) (*StopError, bool) {
	var se *StopError
	ok := errors.As(err, &se)
	return se, ok
}

//go:generate go tool stringer -type=StopReason -linecomment

// StopReason says why the executor stopped making attempts.
type StopReason uint8

const (
	// StopSuccess: an attempt came to verdict.OK.
	StopSuccess StopReason = iota // success
	// StopAttemptsExhausted: the last allowed attempt failed retryably.
	StopAttemptsExhausted // attempts exhausted
	// StopDeadline: the policy's or the caller's deadline passed, or the
	// next delay would have run past it.
	StopDeadline // deadline
	// StopBudget: the retry budget refused the retry.
	StopBudget // retry budget exhausted
	// StopBreakerOpen: the circuit breaker refused the attempt.
	StopBreakerOpen // breaker open
	// StopPermanent: an attempt came to verdict.Permanent.
	StopPermanent // permanent
	// StopCancelled: the caller's context was cancelled.
	StopCancelled // cancelled
	// StopInvalidUse: the call was refused before any attempt, its policy
	// wanting another entry point (a Hedge given to Run or Try; the error
	// wraps ErrHedgeNeedsRunHedged).
	StopInvalidUse // invalid use
)
