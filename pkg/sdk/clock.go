package sdk

import (
	"context"
	"time"
)

// clock is the executor's source of time. The real one is the default; tests
// inject a fake that advances instantly and fires deadlines by hand.
type clock interface {
	Now() time.Time
	// Since is Now().Sub(t). On the real clock, for a t read from it, it
	// reads only the monotonic clock: half what Now costs, and an attempt's
	// end needs no more.
	Since(t time.Time) time.Duration
	// Sleep waits d or until ctx is done, returning ctx.Err() in that case.
	Sleep(ctx context.Context, d time.Duration) error
	// WithDeadline is context.WithDeadline on this clock's time.
	WithDeadline(ctx context.Context, t time.Time) (context.Context, context.CancelFunc)
	// NewTimer returns a stopped timer on this clock's time.
	NewTimer() timer
}

// timer is a time.Timer on a clock: it sends on C once, when the clock
// reaches the instant Reset last set.
type timer interface {
	C() <-chan time.Time
	// Reset (re)arms the timer for the instant at; it must be stopped or
	// have fired and been received from. An instant past fires at once.
	Reset(at time.Time)
	Stop()
}

type realClock struct{}

func (realClock) Now() time.Time { return time.Now() }

func (realClock) Since(t time.Time) time.Duration { return time.Since(t) }

func (realClock) Sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

func (realClock) WithDeadline(ctx context.Context, t time.Time) (context.Context, context.CancelFunc) {
	return context.WithDeadline(ctx, t)
}

func (realClock) NewTimer() timer {
	t := time.NewTimer(time.Hour)
	t.Stop()
	return realTimer{t}
}

type realTimer struct{ t *time.Timer }

func (t realTimer) C() <-chan time.Time { return t.t.C }
func (t realTimer) Reset(at time.Time)  { t.t.Reset(time.Until(at)) }
func (t realTimer) Stop()               { t.t.Stop() }
