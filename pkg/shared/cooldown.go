package shared

import (
	"fmt"
	"sync"
	"time"
)

// cooldown keeps a Limiter from asking a Redis that just failed to answer:
// a small breaker around the store. After a failure it is open for a
// while, and calls fail at once with the failure that opened it; then
// one call (a probe) asks again while the others still fail fast, and
// the probe's outcome closes or reopens it. The zero cooldown with every
// zero field is always closed.
type cooldown struct {
	every time.Duration // 0: never open

	mu      sync.Mutex
	until   time.Time // open until; zero when closed
	probing bool
	cause   error
	at      time.Time // when cause happened
}

// ask reports whether a call may ask Redis now; when it may not, err says
// why, to be returned in place of an answer. A call told to ask must report
// its outcome with done.
func (c *cooldown) ask(now time.Time) (err error) {
	if c.every <= 0 {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	switch {
	case c.until.IsZero():
		return nil
	case !now.Before(c.until) && !c.probing:
		c.probing = true
		return nil
	}
	return fmt.Errorf("not asked: Redis failed %v ago: %w", now.Sub(c.at).Round(time.Millisecond), c.cause)
}

// done records the outcome of a call ask let through: cause is Redis's
// failure to answer, nil when it answered (a refusal is an answer).
func (c *cooldown) done(now time.Time, cause error) {
	if c.every <= 0 {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.probing = false
	if cause == nil {
		c.until, c.cause = time.Time{}, nil
		return
	}
	c.until, c.cause, c.at = now.Add(c.every), cause, now
}

// abandon records that a call ask let through ended without learning
// anything of Redis (its context ended): the next call may probe.
func (c *cooldown) abandon() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.probing = false
}
