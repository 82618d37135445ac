package sdk

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/egressd/egressd/pkg/verdict"
)

//go:generate go tool stringer -type=BreakerState -linecomment

// BreakerState is the state of a circuit breaker.
type BreakerState uint8

const (
	// BreakerClosed: attempts flow; Transient outcomes are counted.
	BreakerClosed BreakerState = iota // closed
	// BreakerOpen: attempts are refused until OpenFor has passed.
	BreakerOpen // open
	// BreakerHalfOpen: a bounded number of probes may go through; a probe
	// that comes to OK closes the breaker, one that comes to Transient
	// re-opens it.
	BreakerHalfOpen // half-open
)

// BreakerOptions configures a Breaker. Zero fields take the defaults.
type BreakerOptions struct {
	// FailureThreshold is how many consecutive Transient outcomes open the
	// breaker. Default 5.
	FailureThreshold int
	// OpenFor is how long the breaker stays open before it lets probes
	// through. Default 5s.
	OpenFor time.Duration
	// HalfOpenProbes is how many probes may be in flight while half-open.
	// Default 1.
	HalfOpenProbes int
	// OnStateChange, if set, is called after every transition, outside the
	// breaker's lock.
	OnStateChange func(from, to BreakerState)
}

// Breaker is a circuit breaker. Only verdict.Transient is evidence against
// the dependency and only verdict.OK is evidence for it; Throttled (refusals
// included) and Permanent record nothing. Every Allow must be followed by
// exactly one Record with the same Permit - that is what returns a half-open
// probe slot, so a probe that a limiter refused does not wedge the breaker.
//
// Time is an argument, so the breaker's decisions can be tested at fixed
// instants. A Breaker is safe for concurrent use; share one per dependency.
type Breaker struct {
	threshold int
	openFor   time.Duration
	probes    int
	onChange  func(from, to BreakerState)

	// closedGen is gen+1 while the breaker is closed, 0 otherwise: Allow
	// in the closed state - nearly every call - reads it and takes no lock.
	// Like failures, it is read without mu and written under it.
	closedGen atomic.Uint64
	failures  atomic.Int64

	mu       sync.Mutex
	state    BreakerState
	gen      uint64    // bumped on every transition
	until    time.Time // end of the open period
	inFlight int       // probes out while half-open
}

// Permit is what Allow hands out and Record takes back.
type Permit struct {
	gen   uint64
	probe bool
}

// Probe reports whether the permit holds a half-open probe slot.
func (p Permit) Probe() bool { return p.probe }

// NewBreaker returns a closed breaker.
func NewBreaker(o BreakerOptions) *Breaker {
	b := &Breaker{
		threshold: o.FailureThreshold,
		openFor:   o.OpenFor,
		probes:    o.HalfOpenProbes,
		onChange:  o.OnStateChange,
	}
	if b.threshold <= 0 {
		b.threshold = 5
	}
	if b.openFor <= 0 {
		b.openFor = 5 * time.Second
	}
	if b.probes <= 0 {
		b.probes = 1
	}
	b.closedGen.Store(b.gen + 1)
	return b
}

// Allow asks to make an attempt at now. It reports false while the breaker
// is open, or half-open with every probe slot taken.
func (b *Breaker) Allow(now time.Time) (Permit, bool) {
	if g := b.closedGen.Load(); g != 0 {
		return Permit{gen: g - 1}, true
	}
	b.mu.Lock()
	from := b.state
	if b.state == BreakerOpen {
		if now.Before(b.until) {
			b.mu.Unlock()
			return Permit{}, false
		}
		b.setLocked(BreakerHalfOpen, now)
	}
	var p Permit
	ok := true
	switch b.state {
	case BreakerClosed:
		p = Permit{gen: b.gen}
	case BreakerHalfOpen:
		if b.inFlight < b.probes {
			b.inFlight++
			p = Permit{gen: b.gen, probe: true}
		} else {
			ok = false
		}
	}
	to := b.state
	b.mu.Unlock()
	b.notify(from, to)
	return p, ok
}

// Record reports what an allowed attempt came to at now. It returns the
// permit's probe slot whatever the verdict, and counts only OK and Transient.
func (b *Breaker) Record(now time.Time, p Permit, v verdict.Verdict) {
	// Without a probe slot to give back, only a Transient outcome, or an OK
	// one with failures to forget (which only the closed state has), changes
	// anything: a success in a healthy breaker takes no lock.
	k := v.Kind()
	if !p.probe && k != verdict.Transient && (k != verdict.OK || b.failures.Load() == 0) {
		return
	}
	b.mu.Lock()
	from := b.state
	current := p.gen == b.gen
	if p.probe && current && b.inFlight > 0 {
		b.inFlight--
	}
	switch k {
	case verdict.Transient:
		switch {
		case b.state == BreakerClosed:
			if b.failures.Add(1) >= int64(b.threshold) {
				b.setLocked(BreakerOpen, now)
			}
		case b.state == BreakerHalfOpen && p.probe && current:
			b.setLocked(BreakerOpen, now)
		}
	case verdict.OK:
		switch {
		case b.state == BreakerClosed:
			b.failures.Store(0)
		case b.state == BreakerHalfOpen && p.probe && current:
			b.setLocked(BreakerClosed, now)
		}
	}
	to := b.state
	b.mu.Unlock()
	b.notify(from, to)
}

// State returns the breaker's state at now; an open breaker whose open
// period has passed reports half-open.
func (b *Breaker) State(now time.Time) BreakerState {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.state == BreakerOpen && !now.Before(b.until) {
		return BreakerHalfOpen
	}
	return b.state
}

// setLocked moves to state s, starting its bookkeeping afresh.
func (b *Breaker) setLocked(s BreakerState, now time.Time) {
	b.state = s
	b.gen++
	b.failures.Store(0)
	b.inFlight = 0
	if s == BreakerClosed {
		b.closedGen.Store(b.gen + 1)
	} else {
		b.closedGen.Store(0)
	}
	if s == BreakerOpen {
		b.until = now.Add(b.openFor)
	}
}

func (b *Breaker) notify(from, to BreakerState) {
	if from != to && b.onChange != nil {
		b.onChange(from, to)
	}
}
