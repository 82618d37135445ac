package limit

import "time"

// Observer is told what a limiter does, for metrics. Package limitmetrics
// implements it with Prometheus. Methods are called from the goroutines that
// acquire and release, concurrently, outside the limiter's locks (OnLimit
// excepted: it is called in order, under the adaptive controller's lock, and
// must not call back into the limiter's Acquire or Release). They should be
// cheap and must not block, and must not panic: a panic reaches the caller
// of Acquire, which gets no lease and whose permit goes back, or of
// Release (OnLimit), whose permit is freed all the same.
type Observer interface {
	// OnLease is called once per Acquire with its outcome. A caller whose
	// context ended while it waited was Denied: it asked, and got nothing.
	OnLease(outcome Outcome)
	// OnWait is called once per Acquire on a limiter that has a queue, with
	// how long the caller waited (zero when it did not). A limiter without
	// a queue never waits, and never calls it.
	OnWait(d time.Duration)
	// OnLimit is called by an adaptive limiter with the limit it settled
	// on: once when it is made, then every time the limit moves (during a
	// drain probe, the limit the probe restores, not the probe's own).
	// Watching it fall is watching the dependency say it is queueing.
	OnLimit(limit int)
}

//go:generate go tool stringer -type=Outcome -linecomment

// Outcome is what an Acquire came to. Its String is the label value
// metrics use.
type Outcome uint8

const (
	// Acquired: the caller got a lease.
	Acquired Outcome = iota // acquired
	// Denied: the caller was refused, or its context ended while it waited.
	Denied // denied

	outcomeLen = iota // sentinel, untyped for stringer; keep last.
)

// Valid reports whether o is one of the outcomes, so that an adapter can
// range over them: for o := Outcome(0); o.Valid(); o++.
func (o Outcome) Valid() bool { return o < outcomeLen }
