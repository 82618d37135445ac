package sdkhttp

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/egressd/egressd/pkg/sdk"
	"github.com/egressd/egressd/pkg/verdict"
)

func TestClassifier(t *testing.T) {
	throttled := verdict.New(verdict.Throttled)
	transient := verdict.New(verdict.Transient)
	permanent := verdict.New(verdict.Permanent)
	tests := []struct {
		code       int
		retryAfter string
		want       verdict.Verdict
	}{
		{400, "", permanent},
		{401, "", permanent},
		{403, "", permanent},
		{404, "", permanent},
		{408, "", transient},
		{429, "", throttled},
		{429, "2", throttled.WithRetryAfter(2 * time.Second)},
		{500, "", transient},
		{500, "1", transient.WithRetryAfter(time.Second)},
		{501, "", permanent},
		{502, "", transient},
		{503, "", transient},
		{503, "3", throttled.WithRetryAfter(3 * time.Second)},
		{503, "0", throttled.WithRetryAfter(0)},
		{503, "later", transient},
		{504, "", transient},
		{505, "", permanent},
		{511, "", permanent},
	}
	c := Classifier(nil)
	for _, tt := range tests {
		if got := c.Classify(context.Background(), &sdk.StatusError{Code: tt.code, RetryAfter: tt.retryAfter}); got != tt.want {
			t.Errorf("status %d, Retry-After %q: %v, want %v", tt.code, tt.retryAfter, got, tt.want)
		}
	}
}

// Classifier adds its rule after the caller's, so a caller's rule about a
// 503 wins, and keeps the caller's attributor.
func TestClassifierKeepsTheCallersRules(t *testing.T) {
	mine := sdk.On(sdk.DefaultClassifier(), func(*sdk.StatusError) verdict.Verdict { return verdict.New(verdict.Permanent) })
	attributed := errors.New("attributed")
	mine = mine.WithAttributor(func(context.Context, error) (*sdk.RateLimitedError, bool) {
		return &sdk.RateLimitedError{Limiter: "rule", Err: attributed}, true
	})
	c := Classifier(mine)
	if got := c.Classify(context.Background(), &sdk.StatusError{Code: 503, RetryAfter: "3"}); got.Kind() != verdict.Permanent {
		t.Errorf("503 with the caller's rule: %v, want Permanent", got)
	}
	if got := c.Classify(context.Background(), eperm()); !got.SelfImposed() {
		t.Errorf("EPERM with the caller's attributor: %v, want a refusal", got)
	}
}

// Defaults is HTTPDefaults with the daemon's attributor: an EPERM the
// daemon does not claim - none runs here, or it refused nothing - stays
// Permanent.
func TestDefaults(t *testing.T) {
	p, want := Defaults(), sdk.HTTPDefaults()
	if p.MaxAttempts != want.MaxAttempts || p.AttemptTimeout != want.AttemptTimeout || p.Deadline != want.Deadline || p.Budget == nil || p.Breaker == nil {
		t.Errorf("Defaults = %+v, want HTTPDefaults' numbers with a budget and a breaker", p)
	}
	if got := p.Classifier.Classify(context.Background(), eperm()); got.Kind() != verdict.Permanent {
		t.Errorf("an EPERM nobody claims: %v, want Permanent", got)
	}
}
