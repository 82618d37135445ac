package sdk

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/egressd/egressd/pkg/verdict"
)

var errCustom = errors.New("custom")

type quotaError struct{ wait time.Duration }

func (e *quotaError) Error() string { return "quota " + e.wait.String() }

// dialErr is what a refused or failed connect looks like from net.Dial.
func dialErr(errno syscall.Errno) error {
	return &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", errno)}
}

// attributeAll claims every EPERM for the rule "payments".
func attributeAll(context.Context, error) (*RateLimitedError, bool) {
	return &RateLimitedError{Limiter: "payments", RetryAfter: 300 * time.Millisecond}, true
}

func attributeNone(context.Context, error) (*RateLimitedError, bool) { return nil, false }

func TestClassifierPrecedence(t *testing.T) {
	downgradeRefusals := On(DefaultClassifier(), func(*RateLimitedError) verdict.Verdict { return transient }).
		OnError(ErrRateLimited, transient)
	tests := []struct {
		name string
		c    *Classifier
		err  error
		want verdict.Verdict
	}{
		{"nil error is OK", DefaultClassifier(), nil, ok},
		{"nil classifier uses defaults", nil, errCustom, permanent},
		{"refusal with hint", nil, &RateLimitedError{Limiter: "l", RetryAfter: 2 * time.Second}, verdict.Refused(2 * time.Second)},
		{"refusal without hint", nil, &RateLimitedError{Limiter: "l"}, verdict.Refused(verdict.NoRetryAfter)},
		{"bare sentinel is a refusal", nil, fmt.Errorf("acquire: %w", ErrRateLimited), verdict.Refused(verdict.NoRetryAfter)},
		{"wrapped refusal", nil, fmt.Errorf("call: %w", &RateLimitedError{RetryAfter: time.Second}), verdict.Refused(time.Second)},
		{"user type rule cannot downgrade a refusal", downgradeRefusals, &RateLimitedError{RetryAfter: time.Second}, verdict.Refused(time.Second)},
		{"user sentinel rule cannot downgrade a refusal", downgradeRefusals, ErrRateLimited, verdict.Refused(verdict.NoRetryAfter)},
		{"user rule beats default", DefaultClassifier().OnError(errCustom, transient), fmt.Errorf("x: %w", errCustom), transient},
		{"user rule beats default status", On(nil, func(e *StatusError) verdict.Verdict { return transient }), &StatusError{Code: 404}, transient},
		{"first user rule wins", DefaultClassifier().OnError(errCustom, throttled).OnError(errCustom, transient), errCustom, throttled},
		{"type rule sees the value", On(nil, func(e *quotaError) verdict.Verdict { return verdict.Refused(e.wait) }), fmt.Errorf("q: %w", &quotaError{wait: time.Second}), verdict.Refused(time.Second)},
		{"unmatched rule falls to defaults", DefaultClassifier().OnError(errCustom, permanent), dialErr(syscall.ECONNREFUSED), transient},
		{"EPERM without attributor is permanent", nil, dialErr(syscall.EPERM), permanent},
		{"EPERM attributed is a refusal", DefaultClassifier().WithAttributor(attributeAll), dialErr(syscall.EPERM), verdict.Refused(300 * time.Millisecond)},
		{"attributed EPERM beats user rule", DefaultClassifier().OnError(syscall.EPERM, transient).WithAttributor(attributeAll), dialErr(syscall.EPERM), verdict.Refused(300 * time.Millisecond)},
		{"unattributed EPERM stays permanent", DefaultClassifier().WithAttributor(attributeNone), dialErr(syscall.EPERM), permanent},
		{"unattributed EPERM reaches user rules", DefaultClassifier().WithAttributor(attributeNone).OnError(syscall.EPERM, transient), dialErr(syscall.EPERM), transient},
		{"attributor only asked about EPERM", DefaultClassifier().WithAttributor(attributeAll), dialErr(syscall.ECONNRESET), transient},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tt.c.Classify(context.Background(), tt.err); got != tt.want {
				t.Errorf("Classify(%v) = %v, want %v", tt.err, got, tt.want)
			}
		})
	}
}

func TestAttributedErrorKeepsCause(t *testing.T) {
	cause := dialErr(syscall.EPERM)
	v, err := DefaultClassifier().WithAttributor(attributeAll).classify(context.Background(), cause, t0, time.Time{})
	rl, isRL := AsRateLimited(err)
	if v != verdict.Refused(300*time.Millisecond) || !isRL || rl.Limiter != "payments" {
		t.Fatalf("classify = %v, %v; want the attributed refusal", v, err)
	}
	if !errors.Is(err, syscall.EPERM) {
		t.Errorf("attributed error %v does not wrap the EPERM", err)
	}
}

func TestDefaultVerdict(t *testing.T) {
	dnsNotFound := &net.DNSError{Err: "no such host", Name: "x.invalid", IsNotFound: true}
	dnsTimeout := &net.DNSError{Err: "i/o timeout", Name: "x.example", IsTimeout: true}
	tests := []struct {
		name string
		err  error
		want verdict.Verdict
	}{
		{"deadline exceeded", fmt.Errorf("get: %w", context.DeadlineExceeded), transient},
		{"canceled", context.Canceled, permanent},
		{"connection refused", dialErr(syscall.ECONNREFUSED), transient},
		{"connection reset", fmt.Errorf("read: %w", syscall.ECONNRESET), transient},
		{"broken pipe", syscall.EPIPE, transient},
		{"host unreachable", dialErr(syscall.EHOSTUNREACH), transient},
		{"eperm", dialErr(syscall.EPERM), permanent},
		{"eacces", dialErr(syscall.EACCES), permanent},
		{"dns not found", dnsNotFound, permanent},
		{"dns timeout", dnsTimeout, transient},
		{"i/o timeout", &net.OpError{Op: "read", Err: os.ErrDeadlineExceeded}, transient},
		{"other op error", &net.OpError{Op: "dial", Err: errors.New("weird")}, transient},
		{"unexpected eof", fmt.Errorf("body: %w", io.ErrUnexpectedEOF), transient},
		{"eof", io.EOF, permanent},
		{"unknown", errCustom, permanent},
		{"status 429", &StatusError{Code: 429}, throttled},
		{"status 429 retry-after seconds", &StatusError{Code: 429, RetryAfter: "120"}, throttled.WithRetryAfter(2 * time.Minute)},
		{"status 429 retry-after zero is retry now", &StatusError{Code: 429, RetryAfter: "0"}, throttled.WithRetryAfter(0)},
		{"status 429 retry-after date", &StatusError{Code: 429, RetryAfter: "Thu, 01 Jan 2026 00:00:30 GMT"}, throttled.WithRetryAfter(30 * time.Second)},
		{"status 429 retry-after past date", &StatusError{Code: 429, RetryAfter: "Wed, 31 Dec 2025 23:59:00 GMT"}, throttled.WithRetryAfter(0)},
		{"status 429 retry-after garbage", &StatusError{Code: 429, RetryAfter: "soon"}, throttled},
		{"status 503 retry-after", &StatusError{Code: 503, RetryAfter: " 5 "}, transient.WithRetryAfter(5 * time.Second)},
		{"status 500", &StatusError{Code: 500}, transient},
		{"status 502", &StatusError{Code: 502}, transient},
		{"status 504", &StatusError{Code: 504}, transient},
		{"status 408", &StatusError{Code: 408}, transient},
		{"status 501", &StatusError{Code: 501}, permanent},
		{"status 404 ignores retry-after", &StatusError{Code: 404, RetryAfter: "5"}, permanent},
		{"status 400", &StatusError{Code: 400}, permanent},
		{"wrapped status", fmt.Errorf("get: %w", &StatusError{Code: 503}), transient},
		{"status beats its cause", &StatusError{Code: 404, Err: context.DeadlineExceeded}, permanent},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := DefaultVerdict(tt.err, t0); got != tt.want {
				t.Errorf("DefaultVerdict(%v) = %v, want %v", tt.err, got, tt.want)
			}
		})
	}
}

func TestClassifierIsImmutable(t *testing.T) {
	base := DefaultClassifier().OnError(errCustom, transient)
	_ = base.OnError(errCustom, throttled)
	_ = base.WithAttributor(attributeAll)
	if got := base.Classify(context.Background(), errCustom); got != transient {
		t.Errorf("base classifier changed: %v", got)
	}
	if got := base.Classify(context.Background(), dialErr(syscall.EPERM)); got != permanent {
		t.Errorf("base classifier gained an attributor: %v", got)
	}
}
