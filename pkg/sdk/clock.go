package sdk

import (
	"context"
	"time"
)

// clock is the executor's source of time. The real one is the default; tests
// inject a fake that advances instantly and fires deadlines by hand.
type clock interface {
	Now() time.Time
	// Sleep waits d or until ctx is done, returning ctx.Err() in that case.
	Sleep(ctx context.Context, d time.Duration) error
	// WithDeadline is context.WithDeadline on this clock's time.
	WithDeadline(ctx context.Context, t time.Time) (context.Context, context.CancelFunc)
}

type realClock struct{}

func (realClock) Now() time.Time { return time.Now() }

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
