package sdk

import (
	"context"
	"math/rand/v2"
	"time"

	"github.com/egressd/egressd/pkg/verdict"
)

// Policy says how calls to one dependency are attempted. Fields are read on
// every call; do not change them while calls are running.
//
// The zero Policy (and a nil *Policy) makes exactly one attempt, with no
// timeout of its own, the default classifier, no budget and no breaker: it
// classifies and reports, and never retries. Defaults and HTTPDefaults
// return policies that do.
//
// Copying a Policy shares its Budget, Breaker and Hedge, which is usually
// what you want: one of each per dependency, however many policies call it.
type Policy struct {
	// MaxAttempts is the most attempts one call makes, the first and any
	// hedges included. Zero or negative means one.
	MaxAttempts int
	// AttemptTimeout bounds each attempt. Zero means none: the attempt is
	// bounded only by the deadline and the caller's context.
	AttemptTimeout time.Duration
	// Deadline bounds the whole call, delays included, measured from the
	// start of Run. The caller's context deadline bounds it too. Zero means
	// no deadline of the policy's own.
	Deadline time.Duration
	// Backoff chooses the delay between attempts.
	Backoff Backoff
	// Classifier turns errors into verdicts; nil means the default.
	Classifier *Classifier
	// Budget bounds retries as a fraction of traffic; nil means unbounded.
	Budget *RetryBudget
	// Breaker stops attempts at a failing dependency; nil means none.
	Breaker *Breaker
	// Admit, if set, is asked once per attempt, after the breaker and
	// before the callback, on the attempt's context. Return the zero
	// verdict (OK) to go ahead; anything else - typically verdict.Refused -
	// skips the callback and is processed exactly as if the callback had
	// come to that verdict: the same log entry, the same backoff, the same
	// budget exemption for a self-imposed refusal, the same breaker
	// treatment. The attempt's error is then a *NotAdmittedError. When the
	// attempt's context ends while Admit decides (a hedge that lost, a
	// timeout), the callback is not called. A policy that leaves Admit nil
	// pays one nil check per attempt.
	Admit func(ctx context.Context, next NextAttempt) verdict.Verdict
	// Hedge, if set, sends hedged attempts: copies of an attempt started
	// beside it when it runs too long, behind a gate (see Hedge). Only
	// RunHedged and TryHedged hedge; Run and Try refuse a policy with a
	// Hedge (ErrHedgeNeedsRunHedged). Nil means no hedging.
	Hedge *Hedge

	random func() float64 // nil: math/rand/v2; uniform in [0, 1)
}

// NextAttempt describes the attempt an Admit hook is asked about.
type NextAttempt struct {
	// Number is the attempt's number, 1 for the first; hedges are numbered
	// with the other attempts, in the order they start.
	Number int
	// Hedge reports whether the attempt is a hedge.
	Hedge bool
	// Criticality is the caller's, from the context.
	Criticality Criticality
}

// Defaults returns a general-purpose policy with a budget and a breaker of
// its own: give each dependency its own policy. Three attempts; transient
// retries after about 100ms then 200ms, throttled ones after about 1s then
// 2s, half of each spread by jitter; delays capped at 30s; no attempt
// timeout or deadline of its own (the caller's context governs); a retry
// budget of 10% of successful traffic with a burst of 10; a breaker that
// opens after 5 consecutive transient failures for 5s.
func Defaults() *Policy {
	return &Policy{
		MaxAttempts: 3,
		Backoff: Backoff{
			Transient: Curve{Initial: 100 * time.Millisecond, Multiplier: 2},
			Throttled: Curve{Initial: time.Second, Multiplier: 2},
			MaxDelay:  30 * time.Second,
			Jitter:    0.5,
		},
		Classifier: DefaultClassifier(),
		Budget:     NewRetryBudget(0.1, 10),
		Breaker:    NewBreaker(BreakerOptions{}),
	}
}

// HTTPDefaults returns Defaults with a 10s attempt timeout and a 30s
// deadline, for request/response calls over the network.
func HTTPDefaults() *Policy {
	p := Defaults()
	p.AttemptTimeout = 10 * time.Second
	p.Deadline = 30 * time.Second
	return p
}

// Result is everything Try knows about a call.
type Result[T any] struct {
	// Value is the successful attempt's value, or T's zero value.
	Value T
	// Err is nil on success; otherwise a *StopError wrapping the last
	// attempt's error. (An error a classifier rule called OK is returned
	// as it is, with Stop == StopSuccess.)
	Err error
	// Attempts is the attempt log, in the order the attempts started,
	// hedges included (verdict.Attempt.Hedge).
	Attempts []verdict.Attempt
	// Stop says why the executor stopped.
	Stop StopReason
	// Suppressed says why the last hedge the gate held back was not sent;
	// verdict.SuppressedNone when none was. The attempt log notes each one
	// on the first attempt of its round.
	Suppressed verdict.Suppression
}

// Run calls fn until an attempt succeeds or p says stop, and returns the
// successful value, or T's zero value and a *StopError. fn receives the
// attempt's context: the caller's, bounded by min(AttemptTimeout, remaining
// deadline).
//
// Run never hedges, and so fn never leaves the call: a closure passed to
// Run stays on its caller's stack, and the success path allocates nothing
// (unless the policy's deadlines need a context of their own). A policy
// with a Hedge is refused before any attempt, with a *StopError
// (StopInvalidUse) wrapping ErrHedgeNeedsRunHedged: hedged calls go through
// RunHedged.
func Run[T any](ctx context.Context, p *Policy, fn func(ctx context.Context) (T, error)) (T, error) {
	v, _, err := run(ctx, p, fn, nil)
	return v, err
}

// Try is Run returning the full Result: value, error, attempt log and stop
// reason. Like Run, it refuses a policy with a Hedge; see TryHedged.
func Try[T any](ctx context.Context, p *Policy, fn func(ctx context.Context) (T, error)) Result[T] {
	log := make([]verdict.Attempt, 0, min(p.maxAttempts(), 16))
	v, stop, err := run(ctx, p, fn, &log)
	return Result[T]{Value: v, Err: err, Attempts: log, Stop: stop}
}

// RunHedged is Run with the policy's Hedge: an attempt that runs past the
// hedge's delay gets copies started beside it, behind the hedge gate (see
// Hedge). fn may therefore run concurrently with itself, and is kept where
// the hedge's goroutine can reach it: a closure that captures variables
// costs an allocation per call, hedge or not. With a nil Hedge, RunHedged
// sends no hedges.
func RunHedged[T any](ctx context.Context, p *Policy, fn func(ctx context.Context) (T, error)) (T, error) {
	v, _, err := runHedged(ctx, p, fn, nil, nil)
	return v, err
}

// TryHedged is RunHedged returning the full Result, hedges and the reason
// a hedge was held back included.
func TryHedged[T any](ctx context.Context, p *Policy, fn func(ctx context.Context) (T, error)) Result[T] {
	log := make([]verdict.Attempt, 0, min(p.maxAttempts(), 16))
	var sup verdict.Suppression
	v, stop, err := runHedged(ctx, p, fn, &log, &sup)
	return Result[T]{Value: v, Err: err, Attempts: log, Stop: stop, Suppressed: sup}
}

var zeroPolicy Policy

func (p *Policy) maxAttempts() int {
	if p == nil || p.MaxAttempts < 1 {
		return 1
	}
	return p.MaxAttempts
}

func (p *Policy) uniform() float64 {
	if p.random != nil {
		return p.random()
	}
	return rand.Float64()
}

// stopFor maps a done caller context to its stop reason.
func stopFor(ctxErr error) StopReason {
	if ctxErr == context.DeadlineExceeded {
		return StopDeadline
	}
	return StopCancelled
}

// run is Run and Try: log, when set, receives the attempt log. Each round
// is one attempt, and fn goes nowhere but into it.
func run[T any](ctx context.Context, p *Policy, fn func(context.Context) (T, error), log *[]verdict.Attempt) (T, StopReason, error) {
	var zero T
	if p != nil && p.Hedge != nil {
		stop, err := stopped(StopInvalidUse, 0, nil, ErrHedgeNeedsRunHedged)
		return zero, stop, err
	}
	var c callState
	c.init(ctx, p)
	defer c.unwind()
	for {
		if stop, err := c.begin(ctx); err != nil {
			return zero, stop, err
		}
		var a outcome[T]
		attempt(ctx, ctx, c.p, fn, attemptInfo{n: c.made + 1, start: c.now}, c.now, c.deadline, c.deadlineIsCtx, &a)
		took := time.Since(c.now) // c.now has a monotonic reading: half what time.Now costs
		end := c.now.Add(took)
		c.made++
		delay, stop, err, done := c.after(ctx, &a.settled, a.v, end)
		if log != nil {
			*log = append(*log, verdict.NewAttempt(a.v, took, delay))
		}
		if done {
			return a.val, stop, err
		}
	}
}

// callState is one call's progress from round to round: what the executor
// does between rounds, whether a round is one attempt (run) or an attempt
// and its hedges (runHedged). It never holds the callback.
type callState struct {
	p             *Policy
	maxAttempts   int
	now           time.Time // when the current round started
	deadline      time.Time // the overall deadline; zero: none
	deadlineIsCtx bool      // deadline is the caller's context's own
	made          int       // attempts made, hedges included
	rounds        int
	permit        Permit // the breaker's, for the round's first attempt
	inRound       bool   // begin took permit; after has not given it back
	lastErr       error
}

// init starts c for a call under p: fields are set in place, which costs
// less than copying a callState out of a constructor.
func (c *callState) init(ctx context.Context, p *Policy) {
	if p == nil {
		p = &zeroPolicy
	}
	c.p, c.maxAttempts = p, p.maxAttempts()
	c.now = time.Now()
	// The overall deadline: the policy's, or the caller's if that is sooner.
	if p.Deadline > 0 {
		c.deadline = c.now.Add(p.Deadline)
	}
	ctxDeadline, hasCtxDeadline := ctx.Deadline()
	c.deadlineIsCtx = hasCtxDeadline && (c.deadline.IsZero() || !c.deadline.Before(ctxDeadline))
	if c.deadlineIsCtx {
		c.deadline = ctxDeadline
	}
}

// begin starts a round at c.now, unless the caller's context, the deadline
// or the breaker stops the call; err is then the *StopError.
func (c *callState) begin(ctx context.Context) (StopReason, error) {
	if cerr := ctx.Err(); cerr != nil {
		return stopped(stopFor(cerr), c.made, c.lastErr, cerr)
	}
	if !c.deadline.IsZero() && !c.now.Before(c.deadline) {
		return stopped(StopDeadline, c.made, c.lastErr, context.DeadlineExceeded)
	}
	c.rounds++
	c.permit = Permit{}
	if c.p.Breaker != nil {
		var ok bool
		if c.permit, ok = c.p.Breaker.Allow(c.now); !ok {
			return stopped(StopBreakerOpen, c.made, c.lastErr, nil)
		}
	}
	c.inRound = true
	return StopSuccess, nil
}

// unwind is deferred by run and runHedged: a round that never reached
// after - its callback or Admit panicked - gives its breaker permit back
// as no evidence, or a panicking half-open probe would keep its slot, and
// the breaker would stay half-open for good. The panic goes on.
func (c *callState) unwind() {
	if c.inRound && c.p.Breaker != nil {
		c.p.Breaker.Record(time.Now(), c.permit, noEvidence)
	}
}

// after ends a round that came to o at end; first is what the breaker is
// told of the round's first attempt. The call is done when the round
// succeeded (stop is StopSuccess, err what a classifier rule called OK, if
// anything) or may not be retried (err is the *StopError); otherwise after
// waits delay, and the next round starts at c.now. A call whose caller
// gives up during the wait is done too, its delay still reported.
func (c *callState) after(ctx context.Context, o *settled, first verdict.Verdict, end time.Time) (delay time.Duration, stop StopReason, err error, done bool) {
	p := c.p
	c.inRound = false
	if p.Breaker != nil {
		p.Breaker.Record(end, c.permit, first)
	}
	c.lastErr = o.err
	if o.v.Kind() == verdict.OK {
		if p.Budget != nil {
			p.Budget.Deposit()
		}
		return 0, StopSuccess, o.err, true
	}
	if o.halt {
		stop, err = stopped(o.stop, c.made, c.lastErr, nil)
		return 0, stop, err, true
	}
	reason, delay := p.next(ctx, o.v, c.made, c.rounds, c.maxAttempts, end, c.deadline)
	if reason != StopSuccess {
		stop, err = stopped(reason, c.made, c.lastErr, nil)
		return 0, stop, err, true
	}
	if serr := sleep(ctx, delay); serr != nil {
		if p.Budget != nil && !o.v.SelfImposed() {
			p.Budget.refund() // next took it for a retry that will not happen
		}
		stop, err = stopped(stopFor(serr), c.made, c.lastErr, nil)
		return delay, stop, err, true
	}
	c.now = time.Now()
	return delay, StopSuccess, nil, false
}

// sleep waits d or until ctx is done, returning ctx.Err() in that case.
func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// next decides, after round n came to the retryable-or-not verdict v at
// end with made attempts in all, whether to retry and after what delay.
// StopSuccess means retry.
func (p *Policy) next(ctx context.Context, v verdict.Verdict, made, n, maxAttempts int, end, deadline time.Time) (StopReason, time.Duration) {
	if k := v.Kind(); k != verdict.Transient && k != verdict.Throttled {
		return StopPermanent, 0
	}
	if made >= maxAttempts {
		return StopAttemptsExhausted, 0
	}
	var u float64
	if p.Backoff.Jitter > 0 {
		u = p.uniform()
	}
	delay := p.Backoff.delay(v, n, u)
	// A delay that would run into the deadline leaves no time for the
	// attempt it waits for: stop now rather than sleep to the deadline.
	if !deadline.IsZero() && !end.Add(delay).Before(deadline) {
		return StopDeadline, 0
	}
	// Spend last: a token is taken only for a retry that will happen (and
	// given back if the caller's context ends before it does; see after).
	if p.Budget != nil && !v.SelfImposed() && !p.Budget.TrySpend(CriticalityFrom(ctx)) {
		return StopBudget, 0
	}
	return StopSuccess, delay
}

type outcome[T any] struct {
	val T
	settled
}

// settled is an attempt's outcome but its value.
type settled struct {
	v    verdict.Verdict
	err  error
	halt bool // the caller's context or the overall deadline ended the call
	stop StopReason
}

// attemptInfo is what an Admit hook is told about an attempt besides the
// caller's criticality.
type attemptInfo struct {
	n     int
	hedge bool
	start time.Time // when the attempt was made: what refused it came after
}

// attempt makes an attempt started at start, and classifies it into o.
// ctx is the caller's context; base is what the attempt's context derives
// from: ctx itself, or for a hedge a cancellable child of it. Outcomes are
// written in place: copying one out of a call costs more than the rest of
// an attempt's bookkeeping.
func attempt[T any](ctx, base context.Context, p *Policy, fn func(context.Context) (T, error), info attemptInfo, start, deadline time.Time, deadlineIsCtx bool, o *outcome[T]) {
	actx, cancel, byTimeout := attemptContext(base, p, start, deadline, deadlineIsCtx)
	if cancel != nil {
		defer cancel()
	}
	runAttempt(ctx, actx, byTimeout, p, fn, info, o)
}

// attemptContext derives an attempt's context from base: its deadline is
// min(AttemptTimeout, remaining deadline). When that is the caller's own
// deadline, or there is none, the caller's context already enforces it,
// and base is returned as it is, with a nil cancel.
func attemptContext(base context.Context, p *Policy, start, deadline time.Time, deadlineIsCtx bool) (actx context.Context, cancel context.CancelFunc, byTimeout bool) {
	if p.AttemptTimeout <= 0 && (deadlineIsCtx || deadline.IsZero()) {
		return base, nil, false
	}
	return deriveAttemptContext(base, p, start, deadline, deadlineIsCtx)
}

func deriveAttemptContext(base context.Context, p *Policy, start, deadline time.Time, deadlineIsCtx bool) (actx context.Context, cancel context.CancelFunc, byTimeout bool) {
	attemptDeadline := deadline
	if p.AttemptTimeout > 0 {
		if t := start.Add(p.AttemptTimeout); attemptDeadline.IsZero() || t.Before(attemptDeadline) {
			attemptDeadline, byTimeout = t, true
		}
	}
	if !attemptDeadline.IsZero() && (byTimeout || !deadlineIsCtx) {
		actx, cancel = context.WithDeadline(base, attemptDeadline)
		return actx, cancel, byTimeout
	}
	return base, nil, false
}

// runAttempt asks Admit, runs fn on actx and classifies what it returned
// into o, which it expects zero. ctx is the caller's context: when it has
// ended, so has the call.
func runAttempt[T any](ctx, actx context.Context, byTimeout bool, p *Policy, fn func(context.Context) (T, error), info attemptInfo, o *outcome[T]) {
	if p.Admit != nil {
		next := NextAttempt{Number: info.n, Hedge: info.hedge, Criticality: CriticalityFrom(ctx)}
		if v := p.Admit(actx, next); v.Kind() != verdict.OK {
			o.v, o.err = v, &NotAdmittedError{Verdict: v}
			return
		}
		// Admit may wait, and the attempt end meanwhile (a hedge that
		// lost, a timeout): fn would only be sent out to be cut short.
		if err := actx.Err(); err != nil {
			o.settled = settle(ctx, actx, byTimeout, p, err, info.start)
			return
		}
	}

	val, err := fn(actx)
	if err == nil {
		o.val = val
		return
	}
	// o.val stays zero: a call that fails returns none.
	o.settled = settle(ctx, actx, byTimeout, p, err, info.start)
	if o.v.Kind() == verdict.OK {
		o.val = val // an error a rule calls OK keeps its value
	}
}

// settle classifies an attempt made at start that returned err.
func settle(ctx, actx context.Context, byTimeout bool, p *Policy, err error, start time.Time) (o settled) {
	o.err = err
	// Outcomes the executor recognises itself, before any classifier rule.
	if cerr := ctx.Err(); cerr != nil {
		o.halt, o.stop = true, stopFor(cerr)
		o.v = verdict.New(verdict.Permanent) // cancellation is no evidence
		if o.stop == StopDeadline {
			o.v = verdict.New(verdict.Transient) // a timeout is
		}
		return o
	}
	if actx != ctx && actx.Err() != nil {
		o.v = verdict.New(verdict.Transient)
		if byTimeout {
			o.err = &AttemptTimeoutError{Timeout: p.AttemptTimeout, Err: o.err}
		} else {
			o.halt, o.stop = true, StopDeadline
		}
		return o
	}
	o.v, o.err = p.Classifier.classify(actx, o.err, time.Now(), start)
	return o
}

// stopped builds the error for a call that ended for reason after n
// attempts; cause stands in for the last error when no attempt ran.
func stopped(reason StopReason, n int, lastErr, cause error) (StopReason, error) {
	if lastErr == nil {
		lastErr = cause
	}
	return reason, &StopError{Reason: reason, Attempts: n, Err: lastErr}
}
