package limit

import (
	"context"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/egressd/egressd/pkg/adaptive"
	"github.com/egressd/egressd/pkg/verdict"
)

// Limiter hands out leases. Acquire returns a lease, or an error that is
// (or wraps) a *verdict.RateLimitedError naming the limiter when it refuses, or
// the context's error when the context ended while the caller waited.
// Release every lease, once, however the work it guarded ended. A refusal
// may be shared between calls (a bulkhead's is, so that saying no allocates
// nothing): read it, never modify it.
type Limiter interface {
	Acquire(ctx context.Context) (Lease, error)
	Name() string
}

// Lease is a permit held. Release returns it: a concurrency permit is freed,
// and an adaptive limiter reads the time it was held as a latency sample. A
// rate permit is spent when taken, so releasing it does nothing, but release
// it anyway: the limiter behind an interface may change shape.
//
// A Lease is a value, so that acquiring allocates nothing. Release it through
// the variable Acquire returned (defer lease.Release()); Release zeroes it, so
// a second call does nothing, but a copy released as well frees the permit
// twice. The zero Lease holds nothing.
type Lease struct {
	l  *Local
	at int64 // when the permit was handed over (see Local.tick); adaptive only
}

// Release returns the permit. It is safe on the zero Lease and on one already
// released.
func (ls *Lease) Release() {
	l := ls.l
	if l == nil {
		return
	}
	ls.l = nil
	l.release(ls.at)
}

//go:generate go tool stringer -type=shape -linecomment

// shape is what a Local enforces. Its String is a Local's default name.
type shape uint8

const (
	perSecond     shape = iota // perSecond
	perWindow                  // perWindow
	concurrency                // concurrency
	adaptiveShape              // adaptive
)

// Local is a limiter in this process, of one of the four shapes. It is safe
// for concurrent use, and holds no goroutine: give it the lifetime of what it
// protects, and drop it with that.
type Local struct {
	name       string
	shape      shape
	queueLimit int
	newest     bool      // NewestFirst
	origin     time.Time // instants are nanoseconds since this
	obs        Observer
	limit      int                  // Concurrency's; PerSecond's and PerWindow's Permits
	ctrl       *adaptive.Controller // Adaptive's

	// refused is the refusal of the shapes that give no RetryAfter: shared,
	// so that a busy bulkhead allocates nothing to say no.
	refused, queueFull *verdict.RateLimitedError

	// inFlight counts the leases held (concurrency shapes). Without a
	// queue it is the whole state, changed lock-free; with one, it changes
	// only under mu, so that a release and a waiter cannot miss each other.
	inFlight atomic.Int64

	mu     sync.Mutex
	bucket tokenBucket
	window window
	queue  queue
	timer  timer
}

var _ Limiter = (*Local)(nil)

// New returns a limiter, or an [*OptionsError] listing every problem with
// opts.
func New(opts Options) (*Local, error) {
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	l := &Local{
		queueLimit: opts.QueueLimit,
		newest:     opts.QueueOrder == NewestFirst,
		origin:     time.Now(), // with its monotonic reading, for time.Since
		obs:        opts.Observer,
	}
	origin := l.origin
	switch {
	case opts.PerSecond != nil:
		l.shape, l.limit = perSecond, opts.PerSecond.Permits
		l.bucket = newTokenBucket(origin, opts.PerSecond.Permits, opts.PerSecond.burst())
	case opts.PerWindow != nil:
		p := opts.PerWindow
		l.shape, l.limit = perWindow, p.Permits
		l.window = newWindow(origin, p.Permits, p.Window, p.segments())
	case opts.Concurrency != 0:
		l.shape, l.limit = concurrency, opts.Concurrency
	default:
		l.shape = adaptiveShape
		ao := *opts.Adaptive
		if user, obs := ao.OnChange, l.obs; obs != nil {
			ao.OnChange = func(from, to int) {
				if user != nil {
					user(from, to)
				}
				obs.OnLimit(l.settled(to))
			}
		}
		c, err := adaptive.New(&ao)
		if err != nil { // Validate has seen these options; not reached
			return nil, err
		}
		l.ctrl = c
	}
	l.name = opts.Name
	if l.name == "" {
		l.name = l.shape.String()
	}
	l.refused = &verdict.RateLimitedError{Limiter: l.name}
	l.queueFull = &verdict.RateLimitedError{Limiter: l.name, Err: ErrQueueFull}
	if l.ctrl != nil && l.obs != nil {
		l.obs.OnLimit(l.ctrl.Limit())
	}
	return l, nil
}

// must is New for the conveniences, whose arguments are the caller's
// literals: a bad one is a programming error, like a negative size to make.
func must(opts Options) *Local {
	l, err := New(opts)
	if err != nil {
		panic(err)
	}
	return l
}

// atLeastOne panics for a convenience's argument that is below 1 where the
// Options field it fills would read zero as something else.
func atLeastOne(name string, v int) {
	if v < 1 {
		panic(&OptionsError{Problems: []string{name + " " + strconv.Itoa(v) + " must be at least 1"}})
	}
}

// PerSecond returns a token bucket of permits per second with one second of
// burst. It panics if permits is outside 1..MaxRate; use New for numbers
// that come from configuration.
func PerSecond(permits int) *Local {
	return must(Options{PerSecond: &PerSecondOptions{Permits: permits}})
}

// PerWindow returns a limiter of permits in any sliding window, in 8
// segments. It panics on values New would refuse.
func PerWindow(permits int, window time.Duration) *Local {
	return must(Options{PerWindow: &PerWindowOptions{Permits: permits, Window: window}})
}

// Concurrency returns a limiter of n leases held at once. It panics if n is
// below 1.
func Concurrency(n int) *Local {
	atLeastOne("Concurrency", n) // zero would read as "no shape"
	return must(Options{Concurrency: n})
}

// Adaptive returns an adaptive concurrency limiter that never passes maximum,
// with package adaptive's other defaults, Initial and Minimum lowered to
// maximum when it is below them. It panics if maximum is below 1.
func Adaptive(maximum int) *Local {
	atLeastOne("Adaptive.Maximum", maximum) // zero would read as "default"
	return must(Options{Adaptive: &adaptive.Options{
		Maximum: maximum,
		Initial: min(maximum, adaptive.DefaultInitial),
		Minimum: min(maximum, adaptive.DefaultMinimum),
	}})
}

// Name returns the limiter's name.
func (l *Local) Name() string { return l.name }

// Limit returns the limit in force: permits per second or per window, or
// leases at once; for an adaptive limiter during a drain probe, the
// probe's (AdaptiveState has the limit it settled on).
func (l *Local) Limit() int {
	if l.ctrl != nil {
		return l.ctrl.Limit()
	}
	return l.limit
}

// settled is the limit an adaptive limiter settled on when to is in force:
// during a drain probe, the one the probe restores. A probe's dip is not
// the dependency queueing, which is what an observer watches for.
func (l *Local) settled(to int) int {
	if restore, ok := l.ctrl.Probing(); ok {
		return restore
	}
	return to
}

// Baseline returns what an adaptive limiter thinks a fast call takes (see
// adaptive.Controller.Baseline); false until it has seen enough calls, and
// always for the other shapes.
func (l *Local) Baseline() (time.Duration, bool) {
	if l.ctrl == nil {
		return 0, false
	}
	return l.ctrl.Baseline()
}

// AdaptiveState returns what an adaptive limiter's loop is doing (see
// adaptive.Controller.State): its limit, the one it settled on, whether a
// drain probe runs, its baseline and where that comes from. False for the
// other shapes.
func (l *Local) AdaptiveState() (adaptive.State, bool) {
	if l.ctrl == nil {
		return adaptive.State{}, false
	}
	return l.ctrl.State(), true
}

// InFlight returns the leases held of a concurrency or adaptive limiter.
func (l *Local) InFlight() int { return int(l.inFlight.Load()) }

// Queued returns how many callers are waiting.
func (l *Local) Queued() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.queue.len
}

// tick returns the time as nanoseconds since origin. time.Since reads the
// monotonic clock alone: half what time.Now costs, and all a limiter needs.
func (l *Local) tick() int64 { return int64(time.Since(l.origin)) }

func (l *Local) inFlightShape() bool { return l.shape >= concurrency }

// Acquire takes a permit. Without a queue it never waits: it returns a lease
// or a refusal at once. With one, it waits while there is room in the queue,
// until a permit is free or ctx is done.
func (l *Local) Acquire(ctx context.Context) (Lease, error) {
	if l.queueLimit > 0 {
		return l.acquireQueued(ctx)
	}
	var lease Lease
	var err error
	var seg int64
	if l.inFlightShape() {
		lease, err = l.acquireInFlight()
	} else {
		seg, err = l.acquireRate()
	}
	if l.obs != nil {
		l.observeHeld(lease, err, 0, false, seg)
	}
	return lease, err
}

// observeHeld tells the observer what an Acquire came to (with waited, when
// queued), before lease is handed over. Should the observer panic, the
// caller never gets the lease to release, so its permit goes back first:
// a concurrency permit, or a rate permit (taken in window segment seg).
// The deferred check is a flag test when the observer returns.
func (l *Local) observeHeld(lease Lease, err error, waited time.Duration, queued bool, seg int64) {
	told := false
	defer func() {
		switch {
		case told || err != nil:
		case lease.l != nil:
			l.free()
		case !l.inFlightShape():
			l.refundRate(seg)
		}
	}()
	if queued {
		l.obs.OnWait(waited)
	}
	outcome := Acquired
	if err != nil {
		outcome = Denied
	}
	l.obs.OnLease(outcome)
	told = true
}

// acquireRate is a rate shape's Acquire without a queue; seg is the window
// segment the permit was counted in.
func (l *Local) acquireRate() (seg int64, err error) {
	now := l.tick()
	l.mu.Lock()
	wait := l.takeRate(now)
	seg = l.window.taken
	l.mu.Unlock()
	if wait != 0 {
		return 0, &verdict.RateLimitedError{Limiter: l.name, RetryAfter: wait}
	}
	return seg, nil
}

// acquireInFlight is a concurrency shape's Acquire without a queue:
// lock-free.
func (l *Local) acquireInFlight() (Lease, error) {
	if !l.tryInFlight() {
		return Lease{}, l.refused
	}
	var at int64
	if l.ctrl != nil {
		at = l.tick()
	}
	return Lease{l: l, at: at}, nil
}

// takeRate is the rate shape's take at now (a tick). Call with mu held.
func (l *Local) takeRate(now int64) time.Duration {
	if l.shape == perSecond {
		return l.bucket.takeAt(now)
	}
	return l.window.takeAt(now)
}

// tryInFlight takes a concurrency permit if one is free. An adaptive limiter
// hears that its limit constrained the round when this refuses, or when the
// permit it grants is the last.
func (l *Local) tryInFlight() bool {
	limit := int64(l.limit)
	if l.ctrl != nil {
		limit = int64(l.ctrl.Limit())
	}
	for {
		n := l.inFlight.Load()
		if n >= limit {
			if l.ctrl != nil {
				l.ctrl.Constrained()
			}
			return false
		}
		if l.inFlight.CompareAndSwap(n, n+1) {
			if n+1 == limit && l.ctrl != nil {
				l.ctrl.Constrained()
			}
			return true
		}
	}
}

// release returns a permit handed over at at (a tick).
func (l *Local) release(at int64) {
	if l.ctrl != nil {
		l.sample(at)
	}
	l.free()
}

// sample gives the controller the latency of a permit handed over at at,
// before the permit is freed, so that a waiter is served under the limit
// the sample set. Should OnChange or the observer's OnLimit panic, the
// permit is freed all the same: the lease is spent, and nobody else would.
func (l *Local) sample(at int64) {
	sampled := false
	defer func() {
		if !sampled {
			l.free()
		}
	}()
	now := l.tick()
	l.ctrl.Sample(l.origin.Add(time.Duration(now)), time.Duration(now-at))
	sampled = true
}

// free returns a concurrency permit. It is small enough to inline, so that
// a bulkhead without a queue releases without a call.
func (l *Local) free() {
	if l.queueLimit == 0 {
		l.inFlight.Add(-1)
		return
	}
	l.freeQueued()
}

// freeQueued is free with a queue: it passes the permit on to a waiter.
func (l *Local) freeQueued() {
	l.mu.Lock()
	l.inFlight.Add(-1)
	if l.queue.len > 0 {
		l.dispatch(0) // a concurrency shape's dispatch reads no time
	}
	l.mu.Unlock()
}
