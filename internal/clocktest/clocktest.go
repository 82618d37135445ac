// Package clocktest is a clock for tests that moves only when told to.
package clocktest

import (
	"sync"
	"time"

	"github.com/egressd/egressd/pkg/limit"
)

// Manual is a limit.Clock (and any Now-only clock) at a fixed instant
// until Advance. Its AfterFunc never fires: give it only to limiters that
// set no timer (no queue).
type Manual struct {
	mu  sync.Mutex
	now time.Time
}

// New returns a clock at a fixed, arbitrary instant.
func New() *Manual { return &Manual{now: time.Unix(1_750_000_000, 0)} }

// Now returns the clock's instant.
func (c *Manual) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// Advance moves the clock on by d.
func (c *Manual) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

// AfterFunc returns a timer that never fires.
func (c *Manual) AfterFunc(time.Duration, func()) limit.Timer { return stopped{} }

type stopped struct{}

func (stopped) Stop() bool { return false }
