package clocktest_test

import (
	"context"
	"testing"
	"testing/synctest"
	"time"

	"github.com/egressd/egressd/internal/clocktest"
)

// Advance moves the bubble's clock by exactly d, and what the timers it
// passes wake has run by the time it returns.
func TestAdvance(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		start := time.Now()
		fired := make(chan time.Duration, 2) // when each timer's function ran
		for _, d := range []time.Duration{time.Second, 3 * time.Second} {
			time.AfterFunc(d, func() { fired <- time.Since(start) })
		}
		clocktest.Advance(2 * time.Second)
		if got := time.Since(start); got != 2*time.Second || len(fired) != 1 || <-fired != time.Second {
			t.Fatalf("after Advance(2s): %v passed; want 2s, and the 1s timer's function run, alone", got)
		}
		clocktest.Advance(time.Second)
		if len(fired) != 1 || <-fired != 3*time.Second {
			t.Fatal("after Advance(1s) more: the 3s timer's function did not run at 3s")
		}
	})
}

// Outside a bubble Advance panics before it sleeps: it never waits in
// real time.
func TestAdvanceOutsideABubblePanics(t *testing.T) {
	start := time.Now()
	defer func() {
		if recover() == nil {
			t.Error("Advance outside a bubble returned; want a panic")
		}
		if time.Since(start) >= time.Hour {
			t.Error("Advance slept before it panicked")
		}
	}()
	clocktest.Advance(time.Hour)
}

// Latency takes d of fake time, or less when its context ends, and refuses
// to run outside a bubble.
func TestLatency(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		start := time.Now()
		if err := clocktest.Latency(context.Background(), time.Minute); err != nil || time.Since(start) != time.Minute {
			t.Fatalf("Latency(1m) = %v after %v; want nil after 1m", err, time.Since(start))
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		if err := clocktest.Latency(ctx, time.Hour); err != context.DeadlineExceeded || time.Since(start) != time.Minute+time.Second {
			t.Fatalf("Latency(1h) with 1s left = %v after %v; want DeadlineExceeded after 1s more", err, time.Since(start))
		}
	})
	defer func() {
		if recover() == nil {
			t.Error("Latency outside a bubble returned; want a panic")
		}
	}()
	clocktest.Latency(context.Background(), time.Hour)
}

func TestEventually(t *testing.T) {
	calls := 0
	clocktest.Eventually(t, "the third call", func() bool { calls++; return calls == 3 })
	if calls != 3 {
		t.Fatalf("cond called %d times; want 3: until it held, and no more", calls)
	}
}
