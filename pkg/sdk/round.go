package sdk

import (
	"context"
	"sync"
	"time"

	"github.com/egressd/egressd/pkg/verdict"
)

// hedgedCall is a first attempt registered in a slot: what the watcher needs to
// start hedging it. Each slot keeps one per type T and reuses it, so that
// registering allocates nothing.
type hedgedCall[T any] struct {
	ctx           context.Context
	fn            func(context.Context) (T, error)
	p             *Policy // its MaxAttempts are the call's
	n             int     // the first attempt's number
	start         time.Time
	deadline      time.Time
	deadlineIsCtx bool
	sampled       bool // its latency is learned from (see Hedge.sampled)
	// The first attempt's context is cancelled through cancel when the
	// executor derived it, otherwise through hctx.
	cancel context.CancelFunc
	hctx   *hedgeContext

	// The watcher sets round, then sends on ready: the caller reads round
	// once it has received.
	round *round[T]
	ready chan struct{}
}

// runHedged is RunHedged and TryHedged: run with p.Hedge watching each
// round's first attempt. log and sup, when set, receive the attempt log and
// the last reason a hedge was suppressed.
func runHedged[T any](ctx context.Context, p *Policy, fn func(context.Context) (T, error), log *[]verdict.Attempt, sup *verdict.Suppression) (T, StopReason, error) {
	if p == nil || p.Hedge == nil {
		return run(ctx, p, fn, log)
	}
	var c callState
	c.init(ctx, p)
	defer c.unwind()
	for {
		if stop, err := c.begin(ctx); err != nil {
			var zero T
			return zero, stop, err
		}
		var a outcome[T]
		r, end, took := hedged(ctx, &c, fn, &a)
		first := a.v
		c.made++
		if r != nil {
			first = r.firstVerdict()
			c.made += r.sent
			if sup != nil && r.suppressed != verdict.SuppressedNone {
				*sup = r.suppressed
			}
		}
		delay, stop, err, done := c.after(ctx, &a.settled, first, end)
		if log != nil {
			if r == nil {
				*log = append(*log, verdict.NewAttempt(a.v, took, delay))
			} else {
				r.record(log, delay)
			}
		}
		if done {
			return a.val, stop, err
		}
	}
}

// hedged makes the round's first attempt, c.made+1, with c.p.Hedge
// watching it: in the common case the attempt answers before a hedge comes
// due, and this is attempt with a slot taken and given back. Otherwise the
// watcher has started a round, r, which this joins once the attempt has
// returned; the outcome, o, is then the round's. The round ended at end,
// took after it started.
func hedged[T any](ctx context.Context, c *callState, fn func(context.Context) (T, error), o *outcome[T]) (r *round[T], end time.Time, took time.Duration) {
	p, n, start := c.p, c.made+1, c.now
	h := p.Hedge
	startUS := h.micros(start)
	sampled := h.sampled(startUS)
	t := *h.table.Load()
	s := t[startUS&uint64(len(t)-1)]
	if !s.tryClaim() { // calls side by side
		s = h.claim(startUS)
	}
	hc, _ := s.cache.(*hedgedCall[T])
	if hc == nil {
		hc = &hedgedCall[T]{ready: make(chan struct{}, 1)}
		s.cache = hc
	}
	actx, cancel, byTimeout := attemptContext(ctx, p, start, c.deadline, c.deadlineIsCtx)
	var hctx *hedgeContext // when cancel is nil: hc is the next holder's once the slot is released
	if cancel == nil {
		if !hc.hctx.reusable(ctx) {
			hc.hctx = newHedgeContext(ctx)
		}
		hctx = hc.hctx
		actx = hctx
	}
	hc.ctx, hc.fn, hc.p, hc.n = ctx, fn, p, n
	hc.start, hc.deadline, hc.deadlineIsCtx, hc.sampled = start, c.deadline, c.deadlineIsCtx, sampled
	hc.cancel = cancel
	active := word(phaseActive, startUS)
	s.word.Store(active) // publishes hc to the watcher
	h.watch()
	returned := false
	defer hc.unwind(s, active, &returned)

	runAttempt(ctx, actx, byTimeout, p, fn, attemptInfo{n: n, start: start}, o)
	returned = true
	if cancel != nil {
		cancel()
	} else {
		hctx.release()
	}
	took = time.Since(start)
	end = start.Add(took)
	if s.word.CompareAndSwap(active, phaseFree) {
		if sampled && o.v.Kind() == verdict.OK {
			h.sample(false, took)
		}
		return nil, end, took // hc is the next holder's now; it keeps ctx and fn until then
	}
	r, end = hc.join(s, o, end)
	return r, end, end.Sub(start)
}

// unwind is deferred by hedged: when the first attempt panicked (returned
// is false) it gives the slot back and cancels the attempt's context. A
// deferred method call costs the success path less than a deferred closure.
func (hc *hedgedCall[T]) unwind(s *slot, active uint64, returned *bool) {
	if *returned {
		return
	}
	cancel, hctx := hc.cancel, hc.hctx // hc is the next holder's once abandon returns
	hc.abandon(s, active, time.Now())
	if cancel != nil {
		cancel()
	} else {
		hctx.release()
	}
}

// abandon gives the slot back when the first attempt panicked, at end: the
// round the watcher may have started is cancelled and waited for, so that no
// copy of the callback runs on after the call.
func (hc *hedgedCall[T]) abandon(s *slot, active uint64, end time.Time) {
	if s.word.CompareAndSwap(active, phaseFree) {
		return
	}
	hc.takeRound().abandon(end)
	s.word.Store(phaseFree)
}

// takeRound waits for the round the watcher started for hc's attempt, and
// lets go of what the call lent the slot.
func (hc *hedgedCall[T]) takeRound() *round[T] {
	<-hc.ready
	r := hc.round
	hc.round, hc.ctx, hc.fn = nil, nil, nil
	return r
}

// join is hedged once a hedge came due while the first attempt, which came
// to o at end, ran: it waits for the round the watcher started, gives the
// slot back, and hands the watcher the first attempt's latency if it is
// sampled. From then on hc is the next holder's.
func (hc *hedgedCall[T]) join(s *slot, o *outcome[T], end time.Time) (*round[T], time.Time) {
	r := hc.takeRound()
	*o = r.join(*o, end)
	first, sampled := r.atts[0], hc.sampled
	s.word.Store(phaseFree) // hc is the next holder's
	if sampled && (first.lost || first.o.v.Kind() == verdict.OK) {
		r.h.sample(first.lost, first.end.Sub(first.start)) // a censored latency if lost
	}
	if r.panicked {
		panic(r.panicValue) // a hedge's, on the caller's goroutine, as if fn had run there
	}
	return r, time.Now()
}

// round is a first attempt and the hedges sent beside it.
type round[T any] struct {
	h             *Hedge
	ctx           context.Context
	fn            func(context.Context) (T, error)
	p             *Policy
	maxAttempts   int
	deadline      time.Time
	deadlineIsCtx bool

	mu         sync.Mutex
	atts       []*roundAttempt[T] // in the order they started; [0] is the first
	running    int
	winner     int  // index of the attempt whose answer was taken; -1: none
	over       bool // no more hedges: an answer was taken or every attempt returned
	held       bool // the gate held a hedge back: no more in this round
	joined     bool // the caller is waiting for done
	done       chan struct{}
	sent       int
	suppressed verdict.Suppression
	panicked   bool // a hedge panicked, with panicValue
	panicValue any
}

type roundAttempt[T any] struct {
	hedge      bool
	n          int
	start, end time.Time
	o          outcome[T]
	lost       bool
	cancel     func()
	permit     Permit
}

// startRound is called by the watcher, which has taken c's slot to
// phaseFiring: c's fields stay as they are until the caller joins the round.
func (c *hedgedCall[T]) startRound(h *Hedge, now time.Time) hedgeRound {
	r := &round[T]{
		h: h, ctx: c.ctx, fn: c.fn, p: c.p,
		maxAttempts: c.p.maxAttempts(), deadline: c.deadline, deadlineIsCtx: c.deadlineIsCtx,
		winner: -1, done: make(chan struct{}),
	}
	cancel := c.cancel
	if cancel == nil {
		cancel = c.hctx.cancel
	}
	r.atts = append(r.atts, &roundAttempt[T]{n: c.n, start: c.start, cancel: cancel})
	r.running = 1
	r.mu.Lock()
	r.hedgeLocked(now)
	r.mu.Unlock()
	c.round = r
	c.ready <- struct{}{}
	return r
}

// more implements hedgeRound.
func (r *round[T]) more(now time.Time) (time.Time, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for {
		if r.over || r.held || r.sent >= r.h.maxHedges {
			return time.Time{}, false
		}
		due := r.atts[0].start.Add(time.Duration(r.sent+1) * r.h.Delay())
		if now.Before(due) {
			return due, true
		}
		r.hedgeLocked(now)
	}
}

// hedgeLocked asks the gate about a hedge at now and, if it may, sends it.
func (r *round[T]) hedgeLocked(now time.Time) {
	if r.over || r.held || r.sent >= r.h.maxHedges {
		return
	}
	p := r.p
	refused := false
	for _, a := range r.atts {
		refused = refused || a.end != (time.Time{}) && a.o.v.SelfImposed()
	}
	n := r.atts[0].n + r.sent + 1
	closed := p.Breaker == nil || p.Breaker.State(now) == BreakerClosed
	reason := hedgeGate(CriticalityFrom(r.ctx), refused, n <= r.maxAttempts, closed)
	var permit Permit
	if reason == verdict.SuppressedNone && p.Breaker != nil {
		var ok bool
		if permit, ok = p.Breaker.Allow(now); !ok || permit.Probe() {
			if ok { // half-open since State: give the probe slot back
				p.Breaker.Record(now, permit, noEvidence)
			}
			reason = verdict.SuppressedBreaker
		}
	}
	if reason == verdict.SuppressedNone && p.Budget != nil && !p.Budget.trySpendHedge() {
		if p.Breaker != nil {
			p.Breaker.Record(now, permit, noEvidence)
		}
		reason = verdict.SuppressedBudget
	}
	if reason != verdict.SuppressedNone {
		r.held, r.suppressed = true, reason
		if obs := r.h.obs; obs != nil {
			obs.OnHedgeSuppressed(reason)
		}
		return
	}
	hctx, cancel := context.WithCancel(r.ctx)
	a := &roundAttempt[T]{hedge: true, n: n, start: now, cancel: cancel, permit: permit}
	r.atts = append(r.atts, a)
	r.running++
	r.sent++
	if obs := r.h.obs; obs != nil {
		obs.OnHedgeSent()
	}
	go r.runHedge(a, hctx)
}

// noEvidence is what a breaker is told of an attempt whose answer says
// nothing about the dependency: one that lost to another, or a permit given
// back unused.
var noEvidence = verdict.New(verdict.Permanent)

func (r *round[T]) runHedge(a *roundAttempt[T], hctx context.Context) {
	var o outcome[T]
	returned := false
	defer r.unwindHedge(a, &returned)
	attempt(r.ctx, hctx, r.p, r.fn, attemptInfo{n: a.n, hedge: true, start: a.start}, a.start, r.deadline, r.deadlineIsCtx, &o)
	returned = true
	if o.v.SelfImposed() && r.p.Budget != nil {
		// Refused in this process, it cost the dependency nothing: the
		// token hedgeLocked took to send it goes back.
		r.p.Budget.refund()
	}
	end := time.Now()
	r.mu.Lock()
	defer r.mu.Unlock()
	r.finishLocked(a, o, end)
	if r.p.Breaker != nil {
		v := o.v
		if a.lost {
			v = noEvidence
		}
		r.p.Breaker.Record(end, a.permit, v)
	}
	a.cancel()
	if testHookHedgeDone != nil {
		testHookHedgeDone()
	}
	r.leaveLocked()
}

// unwindHedge is deferred by runHedge: a hedge whose callback or Admit
// panicked (returned is false) would otherwise take the process down, its
// permit and the round with it. It gives the permit back as no evidence,
// ends the round as a first attempt's panic does - the other attempts are
// cancelled - and keeps the panic for the caller, whose goroutine raises
// it again once every attempt has returned.
func (r *round[T]) unwindHedge(a *roundAttempt[T], returned *bool) {
	if *returned {
		return
	}
	v := recover()
	end := time.Now()
	if r.p.Breaker != nil {
		r.p.Breaker.Record(end, a.permit, noEvidence)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	a.end, a.lost = end, true
	if !r.panicked {
		r.panicked, r.panicValue = true, v
	}
	r.over = true
	for _, b := range r.atts {
		if b.end == (time.Time{}) {
			b.cancel()
		}
	}
	a.cancel()
	if testHookHedgeDone != nil {
		testHookHedgeDone()
	}
	r.leaveLocked()
}

// testHookHedgeDone, set by tests only, is called when a hedge's attempt
// has been counted out of its round.
var testHookHedgeDone func()

// join is the caller's: the first attempt came to o at end. It waits for
// every attempt of the round and returns the round's outcome.
func (r *round[T]) join(o outcome[T], end time.Time) outcome[T] {
	r.mu.Lock()
	r.joined = true
	r.finishLocked(r.atts[0], o, end)
	r.leaveLocked()
	r.mu.Unlock()
	<-r.done

	if r.winner >= 0 {
		return r.atts[r.winner].o
	}
	// No answer to take: the call's end, or the latest failure, preferring
	// one that reached the dependency.
	var last, reached *roundAttempt[T]
	for _, a := range r.atts {
		if a.o.halt {
			return a.o
		}
		if last == nil || !a.end.Before(last.end) {
			last = a
		}
		if !a.o.v.SelfImposed() && (reached == nil || !a.end.Before(reached.end)) {
			reached = a
		}
	}
	if reached != nil {
		return reached.o
	}
	return last.o
}

// abandon is join for a first attempt that panicked at end: the round ends,
// its hedges are cancelled (lost, as to a winner), and abandon returns once
// they have.
func (r *round[T]) abandon(end time.Time) {
	r.mu.Lock()
	r.joined, r.over, r.winner = true, true, 0
	r.atts[0].end = end
	for _, a := range r.atts[1:] {
		if a.end == (time.Time{}) {
			a.cancel()
		}
	}
	r.leaveLocked()
	r.mu.Unlock()
	<-r.done
}

// finishLocked records that a came to o at end, and takes its answer if it
// is the round's first acceptable one - OK, or a Permanent answer, which
// stops the call whatever the others say - cancelling the others.
func (r *round[T]) finishLocked(a *roundAttempt[T], o outcome[T], end time.Time) {
	a.o, a.end = o, end
	if r.winner >= 0 {
		a.lost = true
		return
	}
	k := o.v.Kind()
	if k != verdict.OK && (k != verdict.Permanent || o.halt) {
		return
	}
	r.over = true
	for i, b := range r.atts {
		if b == a {
			r.winner = i
		} else if b.end == (time.Time{}) {
			b.cancel()
		}
	}
	if a.hedge && r.h.obs != nil {
		r.h.obs.OnHedgeWon()
	}
}

// leaveLocked counts an attempt out, and lets the caller go once every
// attempt is out and it is waiting.
func (r *round[T]) leaveLocked() {
	r.running--
	if r.running == 0 {
		r.over = true
		if r.joined {
			close(r.done)
		}
	}
}

// firstVerdict is what the breaker is told of the round's first attempt.
func (r *round[T]) firstVerdict() verdict.Verdict {
	if a := r.atts[0]; !a.lost {
		return a.o.v
	}
	return noEvidence
}

// record appends the round's attempts to log, the last followed by delay.
func (r *round[T]) record(log *[]verdict.Attempt, delay time.Duration) {
	for i, a := range r.atts {
		v := a.o.v
		if a.lost {
			v = noEvidence
		}
		d := time.Duration(0)
		if i == len(r.atts)-1 {
			d = delay
		}
		e := verdict.NewAttempt(v, a.end.Sub(a.start), d)
		if a.hedge {
			e = e.AsHedge()
		}
		if a.lost {
			e = e.AsLost()
		}
		if i == 0 && r.suppressed != verdict.SuppressedNone {
			e = e.WithSuppressed(r.suppressed)
		}
		*log = append(*log, e)
	}
}
