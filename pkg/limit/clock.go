package limit

import "time"

// Clock is a limiter's source of time. Tests inject one that moves only when
// told to; nil in [Options] is the real clock.
type Clock interface {
	Now() time.Time
	// AfterFunc calls f once d has passed, like time.AfterFunc, and never
	// from within AfterFunc itself: the limiter calls it with its lock
	// held. A rate limiter with a queue uses it to wake its waiters when the
	// next token or segment is due.
	AfterFunc(d time.Duration, f func()) Timer
}

// Timer is a pending AfterFunc. *time.Timer is one.
type Timer interface {
	// Stop prevents the call if it has not happened yet.
	Stop() bool
}

type realClock struct{}

func (realClock) Now() time.Time { return time.Now() }

func (realClock) AfterFunc(d time.Duration, f func()) Timer { return time.AfterFunc(d, f) }
