package sdk

import (
	"math"
	"testing"
	"time"

	"github.com/egressd/egressd/pkg/verdict"
)

func TestBackoffDelay(t *testing.T) {
	b := Backoff{
		Transient: Curve{Initial: 100 * time.Millisecond, Multiplier: 2},
		Throttled: Curve{Initial: time.Second, Multiplier: 2},
		MaxDelay:  30 * time.Second,
	}
	jittered := b
	jittered.Jitter = 0.5
	transient := verdict.New(verdict.Transient)
	throttled := verdict.New(verdict.Throttled)
	tests := []struct {
		name string
		b    Backoff
		v    verdict.Verdict
		n    int
		u    float64
		want time.Duration
	}{
		{"transient first retry", b, transient, 1, 0, 100 * time.Millisecond},
		{"transient second retry", b, transient, 2, 0, 200 * time.Millisecond},
		{"transient fifth retry", b, transient, 5, 0, 1600 * time.Millisecond},
		{"throttled first retry", b, throttled, 1, 0, time.Second},
		{"throttled third retry", b, throttled, 3, 0, 4 * time.Second},
		{"refusal takes the throttled curve", b, verdict.Refused(verdict.NoRetryAfter), 2, 0, 2 * time.Second},
		{"capped by MaxDelay", b, throttled, 10, 0, 30 * time.Second},
		{"huge retry number saturates then caps", b, transient, 10_000, 0, 30 * time.Second},
		{"server RetryAfter wins over the curve", b, throttled.WithRetryAfter(3 * time.Second), 1, 0, 3 * time.Second},
		{"limiter RetryAfter wins over the curve", b, verdict.Refused(250 * time.Millisecond), 4, 0, 250 * time.Millisecond},
		{"RetryAfter zero means now", b, transient.WithRetryAfter(0), 3, 0, 0},
		{"RetryAfter capped by MaxDelay", b, throttled.WithRetryAfter(time.Hour), 1, 0, 30 * time.Second},
		{"jitter u=0 keeps the curve", jittered, transient, 2, 0, 200 * time.Millisecond},
		{"jitter u=0.5 takes a quarter", jittered, transient, 2, 0.5, 150 * time.Millisecond},
		{"jitter applies below the cap", jittered, throttled, 10, 0.5, 22500 * time.Millisecond},
		{"no jitter on RetryAfter", jittered, throttled.WithRetryAfter(3 * time.Second), 1, 0.99, 3 * time.Second},
		{"zero backoff retries at once", Backoff{}, transient, 3, 0.7, 0},
		{"multiplier below one is constant", Backoff{Transient: Curve{Initial: time.Second, Multiplier: 0.5}}, transient, 4, 0, time.Second},
		{"no cap saturates", Backoff{Transient: Curve{Initial: time.Second, Multiplier: 10}}, transient, 100, 0, math.MaxInt64},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tt.b.delay(tt.v, tt.n, tt.u); got != tt.want {
				t.Errorf("delay(%v, %d, %v) = %v, want %v", tt.v, tt.n, tt.u, got, tt.want)
			}
		})
	}
}
