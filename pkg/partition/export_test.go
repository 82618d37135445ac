package partition

import "time"

// SweepLater is Sweep as it would run d from now, for the tests whose
// partitions keep their budgets in Redis: a synctest bubble cannot hold a
// Redis client, so eviction's time is moved on alone.
func (p *Partitioned) SweepLater(d time.Duration) int {
	now := p.tick() + int64(d)
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.sweepLocked(now)
}

// Locked reports whether p's lock is held.
func Locked(p *Partitioned) bool {
	if !p.mu.TryLock() {
		return true
	}
	p.mu.Unlock()
	return false
}
