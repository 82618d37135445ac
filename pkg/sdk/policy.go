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
// Copying a Policy shares its Budget and Breaker, which is usually what you
// want: one budget and one breaker per dependency, however many policies
// call it.
type Policy struct {
	// MaxAttempts is the most attempts one call makes, the first included.
	// Zero or negative means one.
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
	// treatment. The attempt's error is then a *NotAdmittedError. A policy
	// that leaves Admit nil pays one nil check per attempt.
	Admit func(ctx context.Context, next NextAttempt) verdict.Verdict

	clock  clock          // nil: the real clock
	random func() float64 // nil: math/rand/v2; uniform in [0, 1)
}

// NextAttempt describes the attempt an Admit hook is asked about.
type NextAttempt struct {
	// Number is the attempt's number, 1 for the first.
	Number int
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
	// Attempts is the attempt log, in order.
	Attempts []verdict.Attempt
	// Stop says why the executor stopped.
	Stop StopReason
}

// Run calls fn until an attempt succeeds or p says stop, and returns the
// successful value, or T's zero value and a *StopError. fn receives the
// attempt's context: the caller's, bounded by min(AttemptTimeout, remaining
// deadline).
func Run[T any](ctx context.Context, p *Policy, fn func(ctx context.Context) (T, error)) (T, error) {
	v, _, err := run(ctx, p, fn, nil)
	return v, err
}

// Try is Run returning the full Result: value, error, attempt log and stop
// reason.
func Try[T any](ctx context.Context, p *Policy, fn func(ctx context.Context) (T, error)) Result[T] {
	log := make([]verdict.Attempt, 0, min(p.maxAttempts(), 16))
	v, stop, err := run(ctx, p, fn, &log)
	return Result[T]{Value: v, Err: err, Attempts: log, Stop: stop}
}

var zeroPolicy Policy

func (p *Policy) maxAttempts() int {
	if p == nil || p.MaxAttempts < 1 {
		return 1
	}
	return p.MaxAttempts
}

func (p *Policy) clockOrReal() clock {
	if p.clock != nil {
		return p.clock
	}
	return realClock{}
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

func run[T any](ctx context.Context, p *Policy, fn func(context.Context) (T, error), log *[]verdict.Attempt) (val T, stop StopReason, err error) {
	if p == nil {
		p = &zeroPolicy
	}
	clk := p.clockOrReal()
	maxAttempts := p.maxAttempts()
	now := clk.Now()

	// The overall deadline: the policy's, or the caller's if that is sooner.
	var deadline time.Time
	if p.Deadline > 0 {
		deadline = now.Add(p.Deadline)
	}
	ctxDeadline, hasCtxDeadline := ctx.Deadline()
	deadlineIsCtx := hasCtxDeadline && (deadline.IsZero() || !deadline.Before(ctxDeadline))
	if deadlineIsCtx {
		deadline = ctxDeadline
	}

	var lastErr error
	for n := 1; ; n++ {
		if cerr := ctx.Err(); cerr != nil {
			stop, err = stopped(stopFor(cerr), n-1, lastErr, cerr)
			return
		}
		if !deadline.IsZero() && !now.Before(deadline) {
			stop, err = stopped(StopDeadline, n-1, lastErr, context.DeadlineExceeded)
			return
		}
		var permit Permit
		if p.Breaker != nil {
			var ok bool
			if permit, ok = p.Breaker.Allow(now); !ok {
				stop, err = stopped(StopBreakerOpen, n-1, lastErr, nil)
				return
			}
		}

		a := attempt(ctx, p, clk, fn, n, now, deadline, deadlineIsCtx)
		end := clk.Now()
		if p.Breaker != nil {
			p.Breaker.Record(end, permit, a.v)
		}
		lastErr = a.err

		if a.v.Kind() == verdict.OK {
			if p.Budget != nil {
				p.Budget.Deposit()
			}
			record(log, a.v, end.Sub(now), 0)
			return a.val, StopSuccess, a.err
		}
		if a.halt {
			record(log, a.v, end.Sub(now), 0)
			stop, err = stopped(a.stop, n, lastErr, nil)
			return
		}

		reason, delay := p.next(ctx, a.v, n, maxAttempts, end, deadline)
		if reason != StopSuccess {
			record(log, a.v, end.Sub(now), 0)
			stop, err = stopped(reason, n, lastErr, nil)
			return
		}
		record(log, a.v, end.Sub(now), delay)
		if serr := clk.Sleep(ctx, delay); serr != nil {
			stop, err = stopped(stopFor(serr), n, lastErr, nil)
			return
		}
		now = clk.Now()
	}
}

// next decides, after attempt n came to the retryable-or-not verdict v at
// end, whether to retry and after what delay. StopSuccess means retry.
func (p *Policy) next(ctx context.Context, v verdict.Verdict, n, maxAttempts int, end, deadline time.Time) (StopReason, time.Duration) {
	if k := v.Kind(); k != verdict.Transient && k != verdict.Throttled {
		return StopPermanent, 0
	}
	if n >= maxAttempts {
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
	// Spend last: a token is taken only for a retry that will happen.
	if p.Budget != nil && !v.SelfImposed() && !p.Budget.TrySpend(CriticalityFrom(ctx)) {
		return StopBudget, 0
	}
	return StopSuccess, delay
}

type outcome[T any] struct {
	val  T
	v    verdict.Verdict
	err  error
	halt bool // the caller's context or the overall deadline ended the call
	stop StopReason
}

// attempt makes attempt n, started at start, and classifies it.
func attempt[T any](ctx context.Context, p *Policy, clk clock, fn func(context.Context) (T, error), n int, start, deadline time.Time, deadlineIsCtx bool) (o outcome[T]) {
	// The attempt's deadline: min(AttemptTimeout, remaining deadline). When
	// it is the caller's own, the caller's context already enforces it.
	actx := ctx
	attemptDeadline, byTimeout := deadline, false
	if p.AttemptTimeout > 0 {
		if t := start.Add(p.AttemptTimeout); attemptDeadline.IsZero() || t.Before(attemptDeadline) {
			attemptDeadline, byTimeout = t, true
		}
	}
	if !attemptDeadline.IsZero() && (byTimeout || !deadlineIsCtx) {
		var cancel context.CancelFunc
		actx, cancel = clk.WithDeadline(ctx, attemptDeadline)
		defer cancel()
	}

	if p.Admit != nil {
		next := NextAttempt{Number: n, Criticality: CriticalityFrom(ctx)}
		if v := p.Admit(actx, next); v.Kind() != verdict.OK {
			o.v, o.err = v, &NotAdmittedError{Verdict: v}
			return o
		}
	}

	o.val, o.err = fn(actx)
	if o.err == nil {
		return o
	}
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
	o.v, o.err = p.Classifier.classify(actx, o.err, clk.Now())
	return o
}

func record(log *[]verdict.Attempt, v verdict.Verdict, duration, delay time.Duration) {
	if log != nil {
		*log = append(*log, verdict.NewAttempt(v, duration, delay))
	}
}

// stopped builds the error for a call that ended for reason after n
// attempts; cause stands in for the last error when no attempt ran.
func stopped(reason StopReason, n int, lastErr, cause error) (StopReason, error) {
	if lastErr == nil {
		lastErr = cause
	}
	return reason, &StopError{Reason: reason, Attempts: n, Err: lastErr}
}
