package sdk

import (
	"context"
	"sync"
	"testing"
	"time"
)

// t0 is the fixed instant every fake clock starts at.
var t0 = time.Date(2026, time.January, 1, 0, 0, 0, 0, time.UTC)

// fakeClock is a clock that moves only when told: Sleep advances it
// instantly, and Advance fires the deadlines it passes.
type fakeClock struct {
	mu      sync.Mutex
	now     time.Time
	sleeps  []time.Duration
	pending map[*fakeDeadlineCtx]struct{}
	timers  map[*fakeTimer]struct{} // armed
	onSleep func()                  // called at the start of every Sleep, if set
}

func newFakeClock() *fakeClock {
	return &fakeClock{now: t0, pending: map[*fakeDeadlineCtx]struct{}{}, timers: map[*fakeTimer]struct{}{}}
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) Since(t time.Time) time.Duration { return c.Now().Sub(t) }

// Advance moves the clock on by d and fires every deadline and timer it
// reaches.
func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	var due []*fakeDeadlineCtx
	for fc := range c.pending {
		if !fc.deadline.After(c.now) {
			due = append(due, fc)
			delete(c.pending, fc)
		}
	}
	c.fireTimersLocked()
	c.mu.Unlock()
	for _, fc := range due {
		fc.expire()
	}
}

func (c *fakeClock) fireTimersLocked() {
	for ft := range c.timers {
		if !ft.when.After(c.now) {
			delete(c.timers, ft)
			ft.c <- c.now // buffered, and armed only when drained
		}
	}
}

func (c *fakeClock) NewTimer() timer { return &fakeTimer{clk: c, c: make(chan time.Time, 1)} }

// fakeTimer is a timer on a fakeClock.
type fakeTimer struct {
	clk  *fakeClock
	c    chan time.Time
	when time.Time
}

func (t *fakeTimer) C() <-chan time.Time { return t.c }

func (t *fakeTimer) Reset(at time.Time) {
	c := t.clk
	c.mu.Lock()
	defer c.mu.Unlock()
	t.when = at
	c.timers[t] = struct{}{}
	c.fireTimersLocked()
}

func (t *fakeTimer) Stop() {
	t.clk.mu.Lock()
	delete(t.clk.timers, t)
	t.clk.mu.Unlock()
}

func (c *fakeClock) Sleep(ctx context.Context, d time.Duration) error {
	if c.onSleep != nil {
		c.onSleep()
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	c.mu.Lock()
	c.sleeps = append(c.sleeps, d)
	c.mu.Unlock()
	c.Advance(d)
	return nil
}

func (c *fakeClock) Sleeps() []time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]time.Duration(nil), c.sleeps...)
}

func (c *fakeClock) WithDeadline(ctx context.Context, t time.Time) (context.Context, context.CancelFunc) {
	inner, cancel := context.WithCancel(ctx)
	fc := &fakeDeadlineCtx{Context: inner, deadline: t, cancel: cancel}
	c.mu.Lock()
	due := !t.After(c.now)
	if !due {
		c.pending[fc] = struct{}{}
	}
	c.mu.Unlock()
	if due {
		fc.expire()
	}
	return fc, func() {
		c.mu.Lock()
		delete(c.pending, fc)
		c.mu.Unlock()
		cancel()
	}
}

// fakeDeadlineCtx is a context whose deadline is on a fakeClock.
type fakeDeadlineCtx struct {
	context.Context
	deadline time.Time
	cancel   context.CancelFunc

	mu      sync.Mutex
	expired bool
}

func (c *fakeDeadlineCtx) Deadline() (time.Time, bool) {
	if d, ok := c.Context.Deadline(); ok && d.Before(c.deadline) {
		return d, true
	}
	return c.deadline, true
}

func (c *fakeDeadlineCtx) Err() error {
	c.mu.Lock()
	expired := c.expired
	c.mu.Unlock()
	if expired {
		return context.DeadlineExceeded
	}
	return c.Context.Err()
}

func (c *fakeDeadlineCtx) expire() {
	c.mu.Lock()
	if c.Context.Err() == nil {
		c.expired = true
	}
	c.mu.Unlock()
	c.cancel()
}

func TestFakeClockFiresDeadlines(t *testing.T) {
	clk := newFakeClock()
	ctx, cancel := clk.WithDeadline(context.Background(), t0.Add(time.Second))
	t.Cleanup(cancel)
	clk.Advance(999 * time.Millisecond)
	if err := ctx.Err(); err != nil {
		t.Fatalf("Err() before the deadline = %v", err)
	}
	clk.Advance(time.Millisecond)
	<-ctx.Done()
	if err := ctx.Err(); err != context.DeadlineExceeded {
		t.Fatalf("Err() at the deadline = %v, want DeadlineExceeded", err)
	}
}

func TestRealClockSleepHonoursContext(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	start := time.Now()
	if err := (realClock{}).Sleep(ctx, time.Hour); err != context.Canceled {
		t.Fatalf("Sleep on a cancelled context = %v, want Canceled", err)
	}
	if time.Since(start) > time.Minute {
		t.Fatal("Sleep ignored the cancelled context")
	}
	if err := (realClock{}).Sleep(context.Background(), 0); err != nil {
		t.Fatalf("Sleep(0) = %v", err)
	}
}
