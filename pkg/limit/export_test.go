package limit

import (
	"slices"
	"sync"
	"time"
)

// FakeClock is a Clock for tests: time moves only when Advance or Jump says.
type FakeClock struct {
	mu     sync.Mutex
	now    time.Time
	timers []*fakeTimer
}

type fakeTimer struct {
	c       *FakeClock
	at      time.Time
	f       func()
	stopped bool
	fired   bool
}

// NewFakeClock returns a clock standing at t.
func NewFakeClock(t time.Time) *FakeClock { return &FakeClock{now: t} }

func (c *FakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *FakeClock) AfterFunc(d time.Duration, f func()) Timer {
	c.mu.Lock()
	defer c.mu.Unlock()
	t := &fakeTimer{c: c, at: c.now.Add(d), f: f}
	c.timers = append(c.timers, t)
	return t
}

func (t *fakeTimer) Stop() bool {
	t.c.mu.Lock()
	defer t.c.mu.Unlock()
	pending := !t.fired && !t.stopped
	t.stopped = true
	return pending
}

// Pending returns how many timers are set and have neither fired nor been
// stopped.
func (c *FakeClock) Pending() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for _, t := range c.timers {
		if !t.fired && !t.stopped {
			n++
		}
	}
	return n
}

// Advance moves the clock on by d, calling each timer that falls due, in
// order, with the clock standing at its instant, in the calling goroutine.
func (c *FakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	target := c.now.Add(d)
	c.mu.Unlock()
	for {
		c.mu.Lock()
		c.timers = slices.DeleteFunc(c.timers, func(t *fakeTimer) bool { return t.fired || t.stopped })
		var next *fakeTimer
		for _, t := range c.timers {
			if !t.at.After(target) && (next == nil || t.at.Before(next.at)) {
				next = t
			}
		}
		if next == nil {
			c.now = target
			c.mu.Unlock()
			return
		}
		if next.at.After(c.now) {
			c.now = next.at
		}
		next.fired = true
		c.mu.Unlock()
		next.f()
	}
}

// Jump moves the clock on by d without calling any timer: the moment between
// a token falling due and the wake-up that serves it.
func (c *FakeClock) Jump(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

// HeldSince is when the lease's permit was handed over.
func (ls Lease) HeldSince() time.Time { return ls.l.origin.Add(time.Duration(ls.at)) }
