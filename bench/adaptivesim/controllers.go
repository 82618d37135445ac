package main

import (
	"math"
	"time"

	"github.com/failsafe-go/failsafe-go/adaptivelimiter"

	"github.com/egressd/egressd/pkg/adaptive"
)

// Guardrails every adaptive controller gets, so that they differ in how they
// decide and not in where they may go: egressd's defaults (Minimum 4,
// Maximum 200, Initial 20). failsafe-go's own defaults differ only in the
// floor (1); Gradient2's in the floor (20).
const (
	minLimit     = adaptive.DefaultMinimum
	maxLimit     = adaptive.DefaultMaximum
	initialLimit = adaptive.DefaultInitial
)

// egressdController drives pkg/adaptive the way a limiter in front of it
// would: the limit is Controller.Limit(); a refusal, or in-flight reaching
// the limit, calls Constrained(); every completed call is a Sample, at the
// instant it ended with the latency it measured, so that the controller can
// tell from end − latency whether a call started during a probe. A failed
// call is not sampled: the controller has no notion of a dropped call, and a
// fast failure's latency would teach it a baseline no served call can meet.
type egressdController struct {
	c        *adaptive.Controller
	epoch    time.Time
	inflight int
}

// newEgressd returns pkg/adaptive with opts, whose zero value is every
// default, and a fixed ProbeSeed so that the run repeats.
func newEgressd(opts adaptive.Options, seed uint64) Controller {
	opts.ProbeSeed = seed
	c, err := adaptive.New(&opts)
	if err != nil {
		panic(err)
	}
	return &egressdController{c: c, epoch: time.Date(2025, time.January, 1, 0, 0, 0, 0, time.UTC)}
}

func (e *egressdController) Acquire(time.Duration) (any, bool) {
	limit := e.c.Limit()
	if e.inflight >= limit {
		e.c.Constrained()
		return nil, false
	}
	e.inflight++
	if e.inflight >= limit {
		e.c.Constrained()
	}
	return nil, true
}

func (e *egressdController) Done(now time.Duration, _ any, latency time.Duration, failed bool) {
	e.inflight--
	if !failed {
		e.c.Sample(e.epoch.Add(now), latency)
	}
}

func (e *egressdController) Limit() int { return e.c.Limit() }

// Settled is the limit outside probes: during one, the limit it restores.
func (e *egressdController) Settled() int {
	if restore, ok := e.c.Probing(); ok {
		return restore
	}
	return e.c.Limit()
}

// failsafeController drives failsafe-go's AdaptiveLimiter, unmodified, through
// its public permit API: TryAcquirePermit (no queueing, its default), then
// Record, or Drop for a failed call.
//
// The limiter reads the wall clock (time.Now when a permit is taken and when
// it is recorded; its sampling windows are wall-clock durations), and has no
// clock option. It must therefore run inside a testing/synctest bubble, where
// time.Now is a fake clock that moves only when every goroutine in the bubble
// is blocked: before each call into the limiter the adapter sleeps until the
// bubble's clock reads the simulation's instant, which takes no real time and
// moves the fake clock exactly there. The limiter starts no goroutines, so the
// run stays deterministic.
type failsafeController struct {
	l     adaptivelimiter.AdaptiveLimiter[any]
	start time.Time // the bubble's clock at simulated instant 0
}

// newFailsafe must be called inside the synctest bubble the run happens in.
func newFailsafe() Controller {
	l := adaptivelimiter.NewBuilder[any]().
		WithLimits(minLimit, maxLimit, initialLimit).
		Build()
	return &failsafeController{l: l, start: time.Now()}
}

func (f *failsafeController) sync(now time.Duration) {
	if d := time.Until(f.start.Add(now)); d > 0 {
		time.Sleep(d)
	}
}

func (f *failsafeController) Acquire(now time.Duration) (any, bool) {
	f.sync(now)
	p, ok := f.l.TryAcquirePermit()
	return p, ok
}

func (f *failsafeController) Done(now time.Duration, token any, _ time.Duration, failed bool) {
	f.sync(now)
	p := token.(adaptivelimiter.Permit)
	if failed {
		p.Drop()
		return
	}
	p.Record()
}

func (f *failsafeController) Limit() int { return f.l.Limit() }

// oracleController is a reference, not a peer: it knows the capacity
// schedule and holds the limit at exactly the servers the dependency has, the
// least concurrency that keeps them all busy.
type oracleController struct {
	sc       *Scenario
	share    int     // hosts the servers are split between
	times    float64 // the limit is this many times the servers (1: the oracle; more: a fixed overcommit, for the frontier)
	inflight int
	now      time.Duration
}

func (o *oracleController) Acquire(now time.Duration) (any, bool) {
	o.now = now
	if o.inflight >= o.Limit() {
		return nil, false
	}
	o.inflight++
	return nil, true
}

func (o *oracleController) Done(now time.Duration, _ any, _ time.Duration, _ bool) {
	o.now = now
	o.inflight--
}

func (o *oracleController) Limit() int {
	return max(int(math.Round(o.times*float64(o.sc.serversAt(o.now))))/o.share, 1)
}

// noLimit is the other reference: every call goes through, and the
// dependency's own queue is the only bound.
type noLimit struct{}

func (noLimit) Acquire(time.Duration) (any, bool)            { return nil, true }
func (noLimit) Done(time.Duration, any, time.Duration, bool) {}
func (noLimit) Limit() int                                   { return unlimited }
