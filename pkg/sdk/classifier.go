package sdk

import (
	"context"
	"errors"
	"io"
	"net"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/egressd/egressd/pkg/verdict"
)

// StatusError carries an HTTP status code, and the response's Retry-After,
// from a callback to the classifier.
type StatusError struct {
	// Code is the HTTP status code.
	Code int
	// RetryAfter is the Retry-After header as the server sent it (delay
	// seconds or an HTTP-date); empty when it sent none. "0" means retry now.
	RetryAfter string
	// Err is the underlying cause, if any.
	Err error
}

func (e *StatusError) Error() string {
	s := "status " + strconv.Itoa(e.Code)
	if e.Err != nil {
		s += ": " + e.Err.Error()
	}
	return s
}

// Unwrap returns the cause.
func (e *StatusError) Unwrap() error { return e.Err }

// Attributor asks whether an EPERM from connect was a refusal by this host's
// egress policy (the daemon saw the refusal event) and, if so, returns it as
// a *RateLimitedError naming the rule and when to retry. It runs on the
// attempt's context. An unattributed EPERM - a firewall, say - stays
// Permanent.
type Attributor func(ctx context.Context, err error) (*RateLimitedError, bool)

// attemptStartKey keys, in the context an Attributor is given, when the
// attempt whose error it is was made (only on that path: the value costs
// an allocation).
type attemptStartKey struct{}

// attemptStarted returns when the attempt whose error an Attributor was
// given was made, if the executor ran it.
func attemptStarted(ctx context.Context) (time.Time, bool) {
	t, ok := ctx.Value(attemptStartKey{}).(time.Time)
	return t, ok
}

// WithDialStart returns err, the error of a connect(), marked with when
// that connect() was made, for a client whose attempts can fail with the
// error of a dial made before them: a gRPC channel whose dial was refused
// fails the calls of its reconnect backoff at once with that dial's error.
// [DaemonAttributor] claims the daemon's refusal for an attempt only if it
// came after the attempt began, or, for an error so marked, after the dial
// began.
func WithDialStart(err error, started time.Time) error {
	if err == nil {
		return nil
	}
	return &dialStartError{err: err, started: started}
}

type dialStartError struct {
	err     error
	started time.Time
}

func (e *dialStartError) Error() string { return e.err.Error() }
func (e *dialStartError) Unwrap() error { return e.err }

// dialStarted returns when the connect() that err is the error of was
// made, if err was marked with WithDialStart.
func dialStarted(err error) (time.Time, bool) {
	var d *dialStartError
	if errors.As(err, &d) {
		return d.started, true
	}
	return time.Time{}, false
}

// A Rule classifies the errors it recognises; ok is false for the rest.
type Rule func(err error) (v verdict.Verdict, ok bool)

// Classifier turns an attempt's error into a verdict. Precedence, first
// match wins:
//
//  1. nil is verdict.OK;
//  2. a refusal by this process - a *RateLimitedError or ErrRateLimited
//     anywhere in the chain, or an EPERM the Attributor claims - is
//     verdict.Refused; no rule can override it;
//  3. the user's rules, in the order they were added;
//  4. the defaults (see DefaultVerdict).
//
// The executor recognises its own attempt timeout and the caller's
// cancellation before it asks the classifier at all.
//
// A Classifier is immutable: On, OnError, OnRule and WithAttributor return a
// new one. The nil *Classifier is the default classifier.
type Classifier struct {
	rules     []Rule
	attribute Attributor
}

// DefaultClassifier returns a classifier with no rules of its own.
func DefaultClassifier() *Classifier { return &Classifier{} }

// OnRule returns a classifier that asks r before the defaults, after any
// rule already present.
func (c *Classifier) OnRule(r Rule) *Classifier {
	n := &Classifier{}
	if c != nil {
		n.rules = append(n.rules, c.rules...)
		n.attribute = c.attribute
	}
	n.rules = append(n.rules, r)
	return n
}

// OnError returns a classifier that maps any error matching target
// (errors.Is) to v.
func (c *Classifier) OnError(target error, v verdict.Verdict) *Classifier {
	return c.OnRule(func(err error) (verdict.Verdict, bool) {
		return v, errors.Is(err, target)
	})
}

// On returns a classifier that maps any error whose chain holds an E
// (errors.As) to fn of it.
func On[E error](c *Classifier, fn func(E) verdict.Verdict) *Classifier {
	return c.OnRule(func(err error) (verdict.Verdict, bool) {
		var e E
		if !errors.As(err, &e) {
			return verdict.Verdict{}, false
		}
		return fn(e), true
	})
}

// WithAttributor returns a classifier that asks a about EPERM errors.
func (c *Classifier) WithAttributor(a Attributor) *Classifier {
	n := &Classifier{attribute: a}
	if c != nil {
		n.rules = c.rules
	}
	return n
}

// Classify returns err's verdict.
func (c *Classifier) Classify(ctx context.Context, err error) verdict.Verdict {
	v, _ := c.classify(ctx, err, time.Now(), time.Time{})
	return v
}

// classify returns err's verdict and the error to surface for it, which is
// the attributed *RateLimitedError when the Attributor claimed an EPERM.
// started is when the attempt was made (zero: not known), which the
// Attributor may read with attemptStarted.
func (c *Classifier) classify(ctx context.Context, err error, now, started time.Time) (verdict.Verdict, error) {
	if err == nil {
		return verdict.Verdict{}, nil
	}
	if rl, ok := AsRateLimited(err); ok {
		return rl.Verdict(), err
	}
	if errors.Is(err, ErrRateLimited) {
		return verdict.Refused(verdict.NoRetryAfter), err
	}
	if c == nil {
		return DefaultVerdict(err, now), err
	}
	if c.attribute != nil && errors.Is(err, syscall.EPERM) {
		if !started.IsZero() {
			ctx = context.WithValue(ctx, attemptStartKey{}, started)
		}
		if rl, ok := c.attribute(ctx, err); ok && rl != nil {
			if rl.Err == nil {
				cp := *rl
				cp.Err = err
				rl = &cp
			}
			return rl.Verdict(), rl
		}
	}
	for _, r := range c.rules {
		if v, ok := r(err); ok {
			return v, err
		}
	}
	return DefaultVerdict(err, now), err
}

// DefaultVerdict is the classifier's last word on err, at now:
//
//   - *StatusError: 429 Throttled; 408, 500, 502, 503, 504 Transient; any
//     other code Permanent. A Retry-After on a retryable status is its hint.
//   - context.DeadlineExceeded Transient; context.Canceled Permanent.
//   - connection refused, reset or aborted, broken pipe, host or network
//     unreachable, errno timeouts: Transient. EPERM Permanent.
//   - *net.DNSError: not found Permanent, otherwise Transient.
//   - any other net.Error that timed out, any other *net.OpError, and
//     io.ErrUnexpectedEOF: Transient.
//   - anything else: Permanent - an error nobody recognises is not retried.
func DefaultVerdict(err error, now time.Time) verdict.Verdict {
	if err == nil {
		return verdict.Verdict{}
	}
	var se *StatusError
	if errors.As(err, &se) {
		return statusVerdict(se.Code, se.RetryAfter, now)
	}
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return verdict.New(verdict.Transient)
	case errors.Is(err, context.Canceled):
		return verdict.New(verdict.Permanent)
	}
	var errno syscall.Errno
	if errors.As(err, &errno) {
		switch errno {
		case syscall.ECONNREFUSED, syscall.ECONNRESET, syscall.ECONNABORTED,
			syscall.EPIPE, syscall.ETIMEDOUT, syscall.EHOSTUNREACH, syscall.ENETUNREACH:
			return verdict.New(verdict.Transient)
		case syscall.EPERM, syscall.EACCES:
			return verdict.New(verdict.Permanent)
		}
	}
	var dns *net.DNSError
	if errors.As(err, &dns) {
		if dns.IsNotFound {
			return verdict.New(verdict.Permanent)
		}
		return verdict.New(verdict.Transient)
	}
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return verdict.New(verdict.Transient)
	}
	var op *net.OpError
	if errors.As(err, &op) {
		return verdict.New(verdict.Transient)
	}
	if errors.Is(err, io.ErrUnexpectedEOF) {
		return verdict.New(verdict.Transient)
	}
	return verdict.New(verdict.Permanent)
}

func statusVerdict(code int, retryAfter string, now time.Time) verdict.Verdict {
	var v verdict.Verdict
	switch code {
	case 429:
		v = verdict.New(verdict.Throttled)
	case 408, 500, 502, 503, 504:
		v = verdict.New(verdict.Transient)
	default:
		return verdict.New(verdict.Permanent)
	}
	if d, ok := parseRetryAfter(retryAfter, now); ok {
		v = v.WithRetryAfter(d)
	}
	return v
}

// httpDateLayouts are the formats an HTTP-date may take (RFC 9110 5.6.7).
var httpDateLayouts = [...]string{
	"Mon, 02 Jan 2006 15:04:05 GMT",
	"Monday, 02-Jan-06 15:04:05 GMT",
	"Mon Jan _2 15:04:05 2006",
}

// parseRetryAfter reads a Retry-After value: delay seconds, or an HTTP-date
// measured from now (a date already past means retry now).
func parseRetryAfter(s string, now time.Time) (time.Duration, bool) {
	s = strings.TrimSpace(s)
	if s == "" {
		return 0, false
	}
	if secs, err := strconv.ParseUint(s, 10, 64); err == nil {
		const maxSecs = uint64(1<<63-1) / uint64(time.Second)
		return time.Duration(min(secs, maxSecs)) * time.Second, true
	}
	for _, layout := range httpDateLayouts {
		if t, err := time.Parse(layout, s); err == nil {
			return max(t.Sub(now), 0), true
		}
	}
	return 0, false
}
