package limit

import "time"

// HeldSince is when the lease's permit was handed over.
func (ls Lease) HeldSince() time.Time { return ls.l.origin.Add(time.Duration(ls.at)) }

// WakeupArmed reports whether a queue's wake-up is set and has not run.
func (l *Local) WakeupArmed() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.timer.armed
}
