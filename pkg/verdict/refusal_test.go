package verdict

import (
	"errors"
	"fmt"
	"syscall"
	"testing"
	"time"
)

func TestRateLimitedError(t *testing.T) {
	tests := []struct {
		err         *RateLimitedError
		wantMessage string
		wantVerdict Verdict
	}{
		{&RateLimitedError{}, "rate limited", Refused(NoRetryAfter)},
		{&RateLimitedError{Limiter: "payments"}, `rate limited by "payments"`, Refused(NoRetryAfter)},
		{&RateLimitedError{Limiter: "web", RetryAfter: 2 * time.Second}, `rate limited by "web" (retry after 2s)`, Refused(2 * time.Second)},
		// Zero or negative is no hint, not "retry now": the throttled curve decides.
		{&RateLimitedError{RetryAfter: -time.Second}, "rate limited", Refused(NoRetryAfter)},
		{&RateLimitedError{Limiter: "kernel", Err: syscall.EPERM}, `rate limited by "kernel": operation not permitted`, Refused(NoRetryAfter)},
	}
	for _, tt := range tests {
		if got := tt.err.Error(); got != tt.wantMessage {
			t.Errorf("Error() = %q, want %q", got, tt.wantMessage)
		}
		if got := tt.err.Verdict(); got != tt.wantVerdict {
			t.Errorf("%q: Verdict() = %v, want %v", tt.wantMessage, got, tt.wantVerdict)
		}
		wrapped := fmt.Errorf("call: %w", tt.err)
		if rl, ok := AsRateLimited(wrapped); !ok || rl != tt.err || !IsRateLimited(wrapped) || !errors.Is(wrapped, ErrRateLimited) {
			t.Errorf("%q wrapped: AsRateLimited = %v, %v; IsRateLimited = %v", tt.wantMessage, rl, ok, IsRateLimited(wrapped))
		}
	}
}

func TestRateLimitedErrorUnwrapsItsCause(t *testing.T) {
	err := error(&RateLimitedError{Limiter: "kernel", Err: syscall.EPERM})
	if !errors.Is(err, syscall.EPERM) {
		t.Errorf("%v does not match its cause", err)
	}
	other := fmt.Errorf("dial: %w", syscall.EPERM)
	if IsRateLimited(other) {
		t.Errorf("%v matches ErrRateLimited", other)
	}
	if rl, ok := AsRateLimited(other); ok || rl != nil {
		t.Errorf("AsRateLimited(%v) = %v, %v", other, rl, ok)
	}
	// The bare sentinel is a refusal without a hint, and no *RateLimitedError.
	if _, ok := AsRateLimited(ErrRateLimited); ok || !IsRateLimited(ErrRateLimited) {
		t.Errorf("bare sentinel: AsRateLimited ok = %v, IsRateLimited = %v", ok, IsRateLimited(ErrRateLimited))
	}
}
