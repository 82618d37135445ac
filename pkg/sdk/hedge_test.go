package sdk

import (
	"context"
	"errors"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/pkg/verdict"
)

const hedgeDelay = 100 * time.Millisecond

// hedgeObs is a HedgeObserver that counts and signals.
type hedgeObs struct {
	sent, won  atomic.Int64
	mu         sync.Mutex
	suppressed []verdict.Suppression
	events     chan string
}

func newHedgeObs() *hedgeObs { return &hedgeObs{events: make(chan string, 16)} }

func (o *hedgeObs) OnHedgeSent() { o.sent.Add(1); o.events <- "sent" }
func (o *hedgeObs) OnHedgeWon()  { o.won.Add(1) }
func (o *hedgeObs) OnHedgeSuppressed(r verdict.Suppression) {
	o.mu.Lock()
	o.suppressed = append(o.suppressed, r)
	o.mu.Unlock()
	o.events <- "suppressed:" + r.String()
}

// waitEvent waits for the observer's next event, failing after a while: the
// watcher runs on its own goroutine.
func (o *hedgeObs) waitEvent(t *testing.T) string {
	t.Helper()
	select {
	case e := <-o.events:
		return e
	case <-time.After(10 * time.Second):
		t.Fatal("no hedge event")
		return ""
	}
}

// newTestHedge is NewHedge for a test in a synctest bubble. A hedge's
// watcher goroutine runs until it has looked twice and found no call, and a
// bubble ends only once every goroutine in it has: when the test ends, the
// bubble's clock is moved on a day for the watcher to stop.
func newTestHedge(t *testing.T, o HedgeOptions) *Hedge {
	t.Cleanup(func() { clocktest.Advance(24 * time.Hour) })
	return NewHedge(o)
}

// hedgeRig runs a call whose attempts follow a script. Its tests run in
// synctest bubbles, and move the clock to bring hedges due.
type hedgeRig struct {
	t       *testing.T
	p       *Policy
	obs     *hedgeObs
	started chan int // attempt numbers, as their callbacks start
	release []chan struct{}
	mu      sync.Mutex
	ctxs    map[int]context.Context
	calls   atomic.Int64
}

func newHedgeRig(t *testing.T, o HedgeOptions) *hedgeRig {
	rig := &hedgeRig{t: t, p: testPolicy(), obs: newHedgeObs(), started: make(chan int, 8), ctxs: map[int]context.Context{}}
	for range 4 {
		rig.release = append(rig.release, make(chan struct{}))
	}
	o.Observer = rig.obs
	if o.Delay == 0 && o.Percentile == 0 {
		o.Delay = hedgeDelay
	}
	rig.p.Hedge = newTestHedge(t, o)
	return rig
}

// An act is what one attempt's callback does once started.
type act func(ctx context.Context, release <-chan struct{}) (int, error)

// hang waits for the attempt's context to end.
func hang(ctx context.Context, _ <-chan struct{}) (int, error) { <-ctx.Done(); return 0, ctx.Err() }

// answer returns at once.
func answer(v int, err error) act {
	return func(context.Context, <-chan struct{}) (int, error) { return v, err }
}

// held answers v once released, or returns when its context ends.
func held(v int, err error) act {
	return func(ctx context.Context, release <-chan struct{}) (int, error) {
		select {
		case <-release:
			return v, err
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	}
}

// fn plays acts[i] for the callback's i-th call.
func (rig *hedgeRig) fn(acts ...act) func(context.Context) (int, error) {
	return func(ctx context.Context) (int, error) {
		i := int(rig.calls.Add(1)) - 1
		rig.mu.Lock()
		rig.ctxs[i] = ctx
		rig.mu.Unlock()
		rig.started <- i
		if i >= len(acts) {
			rig.t.Errorf("callback called %d times, script has %d acts", i+1, len(acts))
			return 0, errCustom
		}
		return acts[i](ctx, rig.release[i])
	}
}

func (rig *hedgeRig) ctx(i int) context.Context {
	rig.mu.Lock()
	defer rig.mu.Unlock()
	return rig.ctxs[i]
}

func (rig *hedgeRig) waitStarted(want int) {
	rig.t.Helper()
	select {
	case got := <-rig.started:
		if got != want {
			rig.t.Fatalf("callback call %d started, want %d", got, want)
		}
	case <-time.After(10 * time.Second):
		rig.t.Fatalf("callback call %d never started", want)
	}
}

// try starts the call; wait returns its result.
func (rig *hedgeRig) try(ctx context.Context, fn func(context.Context) (int, error)) (wait func() Result[int]) {
	done := make(chan Result[int], 1)
	go func() { done <- TryHedged(ctx, rig.p, fn) }()
	return func() Result[int] {
		rig.t.Helper()
		select {
		case r := <-done:
			return r
		case <-time.After(10 * time.Second):
			rig.t.Fatal("call never returned")
			return Result[int]{}
		}
	}
}

func hedgeLog(log []verdict.Attempt) []string {
	s := make([]string, len(log))
	for i, a := range log {
		s[i] = a.String()
	}
	return s
}

func TestHedgeGate(t *testing.T) {
	tests := []struct {
		name          string
		c             Criticality
		refused       bool
		attemptsLeft  bool
		breakerClosed bool
		want          verdict.Suppression
	}{
		{"critical, all clear", Critical, false, true, true, verdict.SuppressedNone},
		{"critical plus, all clear", CriticalPlus, false, true, true, verdict.SuppressedNone},
		{"sheddable", Sheddable, false, true, true, verdict.SuppressedCriticality},
		{"sheddable plus", SheddablePlus, false, true, true, verdict.SuppressedCriticality},
		{"round refused", Critical, true, true, true, verdict.SuppressedRefused},
		{"no attempts left", Critical, false, false, true, verdict.SuppressedAttempts},
		{"breaker not closed", Critical, false, true, false, verdict.SuppressedBreaker},
		{"criticality is reported first", Sheddable, true, false, false, verdict.SuppressedCriticality},
		{"then a refusal", Critical, true, false, false, verdict.SuppressedRefused},
		{"then attempts", Critical, false, false, false, verdict.SuppressedAttempts},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := hedgeGate(tt.c, tt.refused, tt.attemptsLeft, tt.breakerClosed); got != tt.want {
				t.Errorf("hedgeGate = %v, want %v", got, tt.want)
			}
		})
	}
}

// The hedge answers first: its value is the call's, the first attempt is
// cancelled through its context and logged as lost, no evidence.
func TestHedgeWinsAndCancelsTheFirst(t *testing.T) { synctest.Test(t, testHedgeWinsAndCancelsTheFirst) }

func testHedgeWinsAndCancelsTheFirst(t *testing.T) {
	rig := newHedgeRig(t, HedgeOptions{})
	rig.p.Budget = NewRetryBudget(0.1, 10)
	rig.p.Breaker = NewBreaker(BreakerOptions{FailureThreshold: 1})
	wait := rig.try(context.Background(), rig.fn(hang, answer(2, nil)))
	rig.waitStarted(0)
	clocktest.Advance(hedgeDelay)
	rig.waitStarted(1)
	r := wait()

	if r.Err != nil || r.Value != 2 || r.Stop != StopSuccess {
		t.Fatalf("Try = %v, %v, %v; want the hedge's 2", r.Value, r.Stop, r.Err)
	}
	want := []string{"Permanent in 100ms, then 0s (lost)", "hedge: OK in 0s, then 0s"}
	if got := hedgeLog(r.Attempts); !slices.Equal(got, want) {
		t.Errorf("attempt log = %q, want %q", got, want)
	}
	if err := rig.ctx(0).Err(); !errors.Is(err, context.Canceled) {
		t.Errorf("first attempt's context: %v, want cancelled", err)
	}
	if rig.obs.sent.Load() != 1 || rig.obs.won.Load() != 1 {
		t.Errorf("observer: %d sent, %d won; want 1, 1", rig.obs.sent.Load(), rig.obs.won.Load())
	}
	// The hedge spent a token; the success funded a tenth of one.
	if got := rig.p.Budget.Tokens(); got < 9.09 || got > 9.11 {
		t.Errorf("budget holds %v tokens, want 9.1", got)
	}
	if got := rig.p.Breaker.State(time.Now()); got != BreakerClosed {
		t.Errorf("breaker %v after a cancelled loser, want closed (no evidence)", got)
	}
}

// The first attempt answers while the hedge runs: the hedge is cancelled
// and logged as lost.
func TestFirstWinsAndCancelsTheHedge(t *testing.T) { synctest.Test(t, testFirstWinsAndCancelsTheHedge) }

func testFirstWinsAndCancelsTheHedge(t *testing.T) {
	rig := newHedgeRig(t, HedgeOptions{})
	wait := rig.try(context.Background(), rig.fn(held(1, nil), hang))
	rig.waitStarted(0)
	clocktest.Advance(hedgeDelay)
	rig.waitStarted(1)
	close(rig.release[0])
	r := wait()

	if r.Err != nil || r.Value != 1 {
		t.Fatalf("Try = %v, %v; want the first attempt's 1", r.Value, r.Err)
	}
	want := []string{"OK in 100ms, then 0s", "hedge: Permanent in 0s, then 0s (lost)"}
	if got := hedgeLog(r.Attempts); !slices.Equal(got, want) {
		t.Errorf("attempt log = %q, want %q", got, want)
	}
	if err := rig.ctx(1).Err(); !errors.Is(err, context.Canceled) {
		t.Errorf("hedge's context: %v, want cancelled", err)
	}
	if rig.obs.won.Load() != 0 {
		t.Errorf("observer counted %d hedges won, want 0", rig.obs.won.Load())
	}
}

// A hedge whose Admit is still deciding when the first attempt wins is
// never sent: its callback does not run.
func TestHedgeLostInAdmitSkipsTheCallback(t *testing.T) {
	synctest.Test(t, testHedgeLostInAdmitSkipsTheCallback)
}

func testHedgeLostInAdmitSkipsTheCallback(t *testing.T) {
	rig := newHedgeRig(t, HedgeOptions{})
	admitting := make(chan struct{})
	rig.p.Admit = func(ctx context.Context, next NextAttempt) verdict.Verdict {
		if next.Hedge {
			close(admitting)
			<-ctx.Done()
		}
		return verdict.Verdict{}
	}
	wait := rig.try(context.Background(), rig.fn(held(1, nil)))
	rig.waitStarted(0)
	clocktest.Advance(hedgeDelay)
	<-admitting
	close(rig.release[0])
	r := wait()

	if r.Err != nil || r.Value != 1 {
		t.Fatalf("Try = %v, %v; want the first attempt's 1", r.Value, r.Err)
	}
	if n := rig.calls.Load(); n != 1 {
		t.Errorf("callback called %d times, want 1: the lost hedge was sent after Admit", n)
	}
}

// Each reason the gate holds a hedge back, through the executor: the reason
// is in the attempt log, in Result and told to the observer, and no hedge
// attempt is made.
func TestHedgeSuppressed(t *testing.T) {
	tests := []struct {
		name  string
		setup func(rig *hedgeRig) context.Context
		want  verdict.Suppression
	}{
		{"sheddable work", func(*hedgeRig) context.Context {
			return WithCriticality(context.Background(), Sheddable)
		}, verdict.SuppressedCriticality},
		{"no attempts left", func(rig *hedgeRig) context.Context {
			rig.p.MaxAttempts = 1
			return context.Background()
		}, verdict.SuppressedAttempts},
		{"budget down to half", func(rig *hedgeRig) context.Context {
			rig.p.Budget = NewRetryBudget(0.1, 2)
			rig.p.Budget.TrySpend(Critical)
			return context.Background()
		}, verdict.SuppressedBudget},
		{"breaker half-open", func(rig *hedgeRig) context.Context {
			rig.p.Breaker = NewBreaker(BreakerOptions{FailureThreshold: 1, OpenFor: time.Second})
			rig.p.Breaker.Record(time.Now(), Permit{}, verdict.New(verdict.Transient))
			clocktest.Advance(time.Second) // the call's attempt is the half-open probe
			return context.Background()
		}, verdict.SuppressedBreaker},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				rig := newHedgeRig(t, HedgeOptions{})
				ctx := tt.setup(rig)
				tokens := -1.0
				if rig.p.Budget != nil {
					tokens = rig.p.Budget.Tokens()
				}
				wait := rig.try(ctx, rig.fn(held(1, nil)))
				rig.waitStarted(0)
				clocktest.Advance(hedgeDelay)
				if e := rig.obs.waitEvent(t); e != "suppressed:"+tt.want.String() {
					t.Fatalf("observer: %s, want suppressed:%v", e, tt.want)
				}
				close(rig.release[0])
				r := wait()
				if r.Err != nil || r.Value != 1 || r.Suppressed != tt.want {
					t.Fatalf("Try = %v, %v, suppressed %v; want 1 with %v", r.Value, r.Err, r.Suppressed, tt.want)
				}
				want := []string{"OK in 100ms, then 0s (hedge suppressed: " + tt.want.String() + ")"}
				if got := hedgeLog(r.Attempts); !slices.Equal(got, want) {
					t.Errorf("attempt log = %q, want %q", got, want)
				}
				if rig.calls.Load() != 1 || rig.obs.sent.Load() != 0 {
					t.Errorf("%d callback calls, %d hedges sent; want 1, 0", rig.calls.Load(), rig.obs.sent.Load())
				}
				if rig.p.Budget != nil && rig.p.Budget.Tokens() < tokens {
					t.Errorf("budget went from %v to %v tokens: a suppressed hedge spent one", tokens, rig.p.Budget.Tokens())
				}
				if rig.p.Breaker != nil {
					if got := rig.p.Breaker.State(time.Now()); got != BreakerClosed {
						t.Errorf("breaker %v after the probe succeeded, want closed", got)
					}
				}
			})
		})
	}
}

// A hedge an Admit hook (a limiter per attempt) refuses is an attempt,
// logged as a self-imposed refusal; the next hedge of the round is then
// suppressed, since the limit refused the last copy.
func TestHedgeRefusedThenSuppressed(t *testing.T) { synctest.Test(t, testHedgeRefusedThenSuppressed) }

func testHedgeRefusedThenSuppressed(t *testing.T) {
	done := make(chan struct{}, 4)
	testHookHedgeDone = func() { done <- struct{}{} }
	t.Cleanup(func() { testHookHedgeDone = nil })
	rig := newHedgeRig(t, HedgeOptions{MaxHedges: 2})
	rig.p.Budget = NewRetryBudget(0.1, 10)
	rig.p.Budget.TrySpend(Critical) // below capacity, so that a refund shows
	// Attempts are admitted one at a time here, but on two goroutines.
	var mu sync.Mutex
	var admitted []NextAttempt
	rig.p.Admit = func(_ context.Context, next NextAttempt) verdict.Verdict {
		mu.Lock()
		admitted = append(admitted, next)
		mu.Unlock()
		if next.Hedge {
			return verdict.Refused(time.Second)
		}
		return verdict.Verdict{}
	}
	wait := rig.try(context.Background(), rig.fn(held(1, nil)))
	rig.waitStarted(0)
	clocktest.Advance(hedgeDelay)
	if e := rig.obs.waitEvent(t); e != "sent" {
		t.Fatalf("observer: %s, want sent", e)
	}
	<-done
	clocktest.Advance(hedgeDelay)
	if e := rig.obs.waitEvent(t); e != "suppressed:refused" {
		t.Fatalf("observer: %s, want suppressed:refused", e)
	}
	close(rig.release[0])
	r := wait()

	want := []string{
		"OK in 200ms, then 0s (hedge suppressed: refused)",
		"hedge: Throttled(self-imposed, retry after 1s) in 0s, then 0s",
	}
	if got := hedgeLog(r.Attempts); !slices.Equal(got, want) {
		t.Errorf("attempt log = %q, want %q", got, want)
	}
	if len(admitted) != 2 || admitted[1] != (NextAttempt{Number: 2, Hedge: true, Criticality: Critical}) {
		t.Errorf("Admit saw %+v, want the first attempt and hedge number 2", admitted)
	}
	// The refused hedge never left the process: the token it took when
	// sent is given back, as a retry after a refusal spends none. 9 tokens
	// and the OK call's deposit.
	if got := rig.p.Budget.Tokens(); got < 9.09 || got > 9.11 {
		t.Errorf("budget holds %v tokens, want 9.1", got)
	}
}

// Several hedges, MaxHedges of them, each a delay after the last; the last
// answers.
func TestHedgesUpToMax(t *testing.T) { synctest.Test(t, testHedgesUpToMax) }

func testHedgesUpToMax(t *testing.T) {
	rig := newHedgeRig(t, HedgeOptions{MaxHedges: 2})
	rig.p.MaxAttempts = 5
	wait := rig.try(context.Background(), rig.fn(hang, hang, answer(3, nil)))
	rig.waitStarted(0)
	clocktest.Advance(hedgeDelay)
	rig.waitStarted(1)
	clocktest.Advance(hedgeDelay)
	rig.waitStarted(2)
	r := wait()
	if r.Value != 3 || r.Err != nil {
		t.Fatalf("Try = %v, %v; want the second hedge's 3", r.Value, r.Err)
	}
	want := []string{"Permanent in 200ms, then 0s (lost)", "hedge: Permanent in 100ms, then 0s (lost)", "hedge: OK in 0s, then 0s"}
	if got := hedgeLog(r.Attempts); !slices.Equal(got, want) {
		t.Errorf("attempt log = %q, want %q", got, want)
	}
	clocktest.Advance(time.Hour) // nothing more is sent
	if n := rig.calls.Load(); n != 3 {
		t.Errorf("callback called %d times, want 3", n)
	}
}

// A failure does not end a round while another attempt may still answer;
// when none does, the call retries, and hedges count as attempts.
func TestHedgedRoundFailsThenRetries(t *testing.T) { synctest.Test(t, testHedgedRoundFailsThenRetries) }

func testHedgedRoundFailsThenRetries(t *testing.T) {
	rig := newHedgeRig(t, HedgeOptions{})
	rig.p.MaxAttempts = 3
	wait := rig.try(context.Background(), rig.fn(held(0, errReset), held(0, errReset), answer(7, nil)))
	rig.waitStarted(0)
	clocktest.Advance(hedgeDelay)
	rig.waitStarted(1)
	close(rig.release[0])
	close(rig.release[1])
	released := time.Now()
	rig.waitStarted(2) // the retry, after the transient backoff
	if slept := time.Since(released); slept != 100*time.Millisecond {
		t.Errorf("the retry started %v after the round's attempts answered, want the 100ms backoff", slept)
	}
	r := wait()
	if r.Value != 7 || r.Err != nil {
		t.Fatalf("Try = %v, %v; want 7 from the retry", r.Value, r.Err)
	}
	if got := verdicts(r.Attempts); !slices.Equal(got, []string{"Transient", "Transient", "OK"}) {
		t.Errorf("attempt log = %q", got)
	}
	if !r.Attempts[1].Hedge() || r.Attempts[1].Delay() != 100*time.Millisecond || r.Attempts[0].Delay() != 0 {
		t.Errorf("the round's last entry should be the hedge, followed by the backoff: %q", hedgeLog(r.Attempts))
	}
}

// A Permanent answer is final: it ends the round and the call, cancelling
// the attempt still running.
func TestHedgePermanentEndsTheRound(t *testing.T) { synctest.Test(t, testHedgePermanentEndsTheRound) }

func testHedgePermanentEndsTheRound(t *testing.T) {
	rig := newHedgeRig(t, HedgeOptions{})
	wait := rig.try(context.Background(), rig.fn(hang, answer(0, err404)))
	rig.waitStarted(0)
	clocktest.Advance(hedgeDelay)
	r := wait()
	if r.Stop != StopPermanent || !errors.Is(r.Err, err404) {
		t.Fatalf("Try = %v, %v; want the hedge's 404", r.Stop, r.Err)
	}
	if err := rig.ctx(0).Err(); !errors.Is(err, context.Canceled) {
		t.Errorf("first attempt's context: %v, want cancelled", err)
	}
}

// The call's deadline bounds the hedges too.
func TestHedgeBoundedByDeadline(t *testing.T) { synctest.Test(t, testHedgeBoundedByDeadline) }

func testHedgeBoundedByDeadline(t *testing.T) {
	rig := newHedgeRig(t, HedgeOptions{})
	rig.p.Deadline = 250 * time.Millisecond
	start := time.Now()
	var deadlines []time.Duration
	var mu sync.Mutex
	fn := rig.fn(hang, hang)
	wait := rig.try(context.Background(), func(ctx context.Context) (int, error) {
		d, _ := ctx.Deadline()
		mu.Lock()
		deadlines = append(deadlines, d.Sub(start))
		mu.Unlock()
		return fn(ctx)
	})
	rig.waitStarted(0)
	clocktest.Advance(hedgeDelay)
	rig.waitStarted(1)
	clocktest.Advance(150 * time.Millisecond)
	r := wait()
	if r.Stop != StopDeadline {
		t.Fatalf("Stop = %v, want deadline", r.Stop)
	}
	if want := []time.Duration{250 * time.Millisecond, 250 * time.Millisecond}; !slices.Equal(deadlines, want) {
		t.Errorf("attempt deadlines %v after the call began, want both %v", deadlines, want[0])
	}
	if len(r.Attempts) != 2 || !r.Attempts[1].Hedge() {
		t.Errorf("attempt log = %q, want the first attempt and its hedge", hedgeLog(r.Attempts))
	}
}

// The delay is learned: the percentile of the first attempts' latencies,
// never below the floor.
// A first attempt that panics takes its slot with it: the panic reaches
// the caller, no hedge is sent for it afterwards, and a hedge already sent
// is cancelled and has returned by then. No copy of the callback runs on
// after the call, the watcher has nothing left to watch, and an attempt
// context the executor derived (an attempt timeout) is cancelled.
func TestHedgeFirstAttemptPanics(t *testing.T) { synctest.Test(t, testHedgeFirstAttemptPanics) }

func testHedgeFirstAttemptPanics(t *testing.T) {
	panics := func(_ context.Context, release <-chan struct{}) (int, error) {
		<-release
		panic("boom")
	}
	for _, tc := range []struct {
		hedgeSent      bool
		attemptTimeout time.Duration
	}{
		{false, 0},
		{true, 0},
		{false, time.Hour},
		{true, time.Hour},
	} {
		hedgeSent := tc.hedgeSent
		rig := newHedgeRig(t, HedgeOptions{})
		rig.p.AttemptTimeout = tc.attemptTimeout
		var hedgeReturned atomic.Bool
		hedge := func(ctx context.Context, release <-chan struct{}) (int, error) {
			defer hedgeReturned.Store(true)
			return hang(ctx, release)
		}
		recovered := make(chan any, 1)
		go func() {
			defer func() { recovered <- recover() }()
			RunHedged(context.Background(), rig.p, rig.fn(panics, hedge))
		}()
		rig.waitStarted(0)
		if hedgeSent {
			clocktest.Advance(hedgeDelay)
			rig.waitStarted(1)
		}
		close(rig.release[0])
		select {
		case v := <-recovered:
			if v != "boom" {
				t.Fatalf("hedge sent %v: recovered %v, want the callback's panic", hedgeSent, v)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("hedge sent %v: the panic never reached the caller", hedgeSent)
		}
		if hedgeSent && (!hedgeReturned.Load() || !errors.Is(rig.ctx(1).Err(), context.Canceled)) {
			t.Errorf("the hedge was not cancelled and done when the panic reached the caller")
		}
		if tc.attemptTimeout > 0 && !errors.Is(rig.ctx(0).Err(), context.Canceled) {
			t.Errorf("hedge sent %v: the first attempt's derived context was not cancelled: %v", hedgeSent, rig.ctx(0).Err())
		}
		clocktest.Advance(10 * hedgeDelay)
		if next, busy := rig.p.Hedge.scan(time.Now()); busy {
			t.Errorf("hedge sent %v: the watcher still sees a call running (next look %v)", hedgeSent, next)
		}
		if want := int64(map[bool]int{false: 0, true: 1}[hedgeSent]); rig.obs.sent.Load() != want || rig.obs.won.Load() != 0 {
			t.Errorf("hedge sent %v: observer saw %d sent, %d won; want %d, 0", hedgeSent, rig.obs.sent.Load(), rig.obs.won.Load(), want)
		}
	}
}

// A hedge that panics does not take the process down: the round ends as
// when the first attempt panics - the first attempt is cancelled and has
// returned - and the panic reaches the caller, on its own goroutine.
func TestHedgePanics(t *testing.T) { synctest.Test(t, testHedgePanics) }

func testHedgePanics(t *testing.T) {
	rig := newHedgeRig(t, HedgeOptions{})
	var firstReturned atomic.Bool
	first := func(ctx context.Context, release <-chan struct{}) (int, error) {
		defer firstReturned.Store(true)
		return hang(ctx, release)
	}
	panics := func(context.Context, <-chan struct{}) (int, error) { panic("boom") }
	recovered := make(chan any, 1)
	go func() {
		defer func() { recovered <- recover() }()
		RunHedged(context.Background(), rig.p, rig.fn(first, panics))
	}()
	rig.waitStarted(0)
	clocktest.Advance(hedgeDelay)
	rig.waitStarted(1)
	select {
	case v := <-recovered:
		if v != "boom" {
			t.Fatalf("recovered %v, want the hedge's panic", v)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the panic never reached the caller")
	}
	if !firstReturned.Load() || !errors.Is(rig.ctx(0).Err(), context.Canceled) {
		t.Errorf("the first attempt was not cancelled and done when the panic reached the caller")
	}
	clocktest.Advance(10 * hedgeDelay)
	if next, busy := rig.p.Hedge.scan(time.Now()); busy {
		t.Errorf("the watcher still sees a call running (next look %v)", next)
	}
}

func TestHedgeLearnsTheDelay(t *testing.T) { synctest.Test(t, testHedgeLearnsTheDelay) }

func testHedgeLearnsTheDelay(t *testing.T) {
	h := newTestHedge(t, HedgeOptions{Percentile: 0.9, MinDelay: 5 * time.Millisecond})
	p := testPolicy()
	p.Hedge = h
	p.MaxAttempts = 1 // learn, but send nothing
	// 90 calls of 10ms and 10 of 50ms; the 90th percentile is 10ms.
	for i := range 200 {
		d := 10 * time.Millisecond
		if i%10 == 9 {
			d = 50 * time.Millisecond
		}
		if _, err := RunHedged(context.Background(), p, func(context.Context) (int, error) { clocktest.Latency(context.Background(), d); return 0, nil }); err != nil {
			t.Fatal(err)
		}
		h.scanNow() // as the watcher would, between calls
	}
	if got := h.Delay(); got < 10*time.Millisecond || got > 11*time.Millisecond {
		t.Errorf("learned delay %v, want about 10ms", got)
	}
	for range 2 * latencyWindow {
		_, _ = RunHedged(context.Background(), p, func(context.Context) (int, error) {
			clocktest.Latency(context.Background(), time.Millisecond)
			return 0, nil
		})
		h.scanNow()
	}
	if got := h.Delay(); got != 5*time.Millisecond {
		t.Errorf("learned delay %v once calls take 1ms, want the 5ms floor", got)
	}
}

// scanNow does what the watcher does when it wakes.
func (h *Hedge) scanNow() { h.scan(time.Now()) }

// Which first attempts the delay learns from depends on when they started,
// never on how long they took or on how many ended between two looks of
// the watcher: a burst is learned from whole, as far as the ring holds it,
// and once a high rate has thinned the sample, slow and fast calls are in
// it alike. Here the test looks, and no watcher does.
func TestHedgeSamplesByStart(t *testing.T) { synctest.Test(t, testHedgeSamplesByStart) }

func testHedgeSamplesByStart(t *testing.T) {
	h := NewHedge(HedgeOptions{Percentile: 0.95, MinDelay: time.Hour})
	h.watching.Store(true)
	p := testPolicy()
	p.Hedge = h
	// calls makes n calls, one in twenty slow, and looks once they are done.
	calls := func(n int) {
		for i := range n {
			d := 20 * time.Microsecond
			if i%20 == 19 {
				d = 100 * time.Millisecond
			}
			if _, err := RunHedged(context.Background(), p, func(context.Context) (int, error) { clocktest.Latency(context.Background(), d); return 0, nil }); err != nil {
				t.Fatal(err)
			}
		}
		h.scanNow()
	}
	// slow returns the latencies learned from, in all and the slow ones.
	slow := func() (slow, all uint32) {
		for _, c := range h.lat.counts[bucketOf(50000):] {
			slow += c
		}
		return slow / sampleWeight, h.lat.total / sampleWeight
	}
	calls(sampleRing / 2)
	if s, n := slow(); s != sampleRing/40 || n != sampleRing/2 {
		t.Errorf("a burst of %d calls, %d slow: %d learned from, %d slow", sampleRing/2, sampleRing/40, n, s)
	}
	for range 2 * adaptLooks {
		calls(10 * sampleTarget)
	}
	s, n := slow()
	if mask := h.sampleMask.Load(); mask == 0 || s*25 < n || s*15 > n {
		t.Errorf("%d calls a look: sampleMask %#x, %d learned from, %d slow; want thinned, one in twenty slow", 10*sampleTarget, mask, n, s)
	}
}

func TestLatencies(t *testing.T) {
	var l latencies
	if _, ok := l.delay(0.5, 0); ok {
		t.Fatal("a delay from nothing")
	}
	for v := range uint64(100) {
		l.add(v * 100) // 0µs ... 9.9ms
	}
	for _, tt := range []struct {
		q    float64
		want time.Duration
	}{
		// No bucket between the margin and the quantile is empty: the
		// quantile.
		{0.5, 4900 * time.Microsecond},
		{0.95, 9400 * time.Microsecond},
		{0.99, 9800 * time.Microsecond},
		{1, 9900 * time.Microsecond},
	} {
		got, ok := l.delay(tt.q, 0)
		// The top of the value's bucket: at most 1/16 above it.
		if !ok || got < tt.want || float64(got) > float64(tt.want)*(1+1.0/16) {
			t.Errorf("delay(%v) = %v, %v; want %v or up to 1/16 above", tt.q, got, ok, tt.want)
		}
	}
	for v := range uint64(1 << 20) {
		if b := bucketOf(v); bucketTop(b) < v || (b > 0 && bucketTop(b-1) >= v) {
			t.Fatalf("%d is in bucket %d, which runs to %d", v, b, bucketTop(b))
		}
	}
	if b := bucketOf(1<<63 + 5); b != latencyBuckets-1 && bucketTop(b) < 1<<63 {
		t.Errorf("the largest values land in bucket %d", b)
	}
	// It forgets: after many more samples of 20ms, the old ones weigh nothing.
	for range 10 * latencyWindow {
		l.add(20000)
	}
	if got, _ := l.delay(0.5, time.Second); got < 20*time.Millisecond || got > 21250*time.Microsecond {
		t.Errorf("median after the shift = %v, want about 20ms", got)
	}
}

// A slower mode past a gap: the delay stays below the gap, at the top of
// the fast calls, wherever the quantile falls - among the fast calls when
// more than 1-q are slow, among the slow ones when fewer are.
func TestLatenciesSlowerMode(t *testing.T) {
	for _, slow := range []int{40, 50, 60} {
		var l latencies
		for i := range 1000 - slow {
			l.add(1000 + uint64(i*1000/(1000-slow))) // 1ms to 2ms
		}
		for range slow {
			l.add(20000)
		}
		got, ok := l.delay(0.95, 0)
		lo, hi := 1950*time.Microsecond, 2047*time.Microsecond
		if slow > 50 {
			lo = 1999 * time.Microsecond // the top of the fast calls
		}
		if !ok || got < lo || got > hi {
			t.Errorf("%d of 1000 slow: delay %v, %v; want %v to %v", slow, got, ok, lo, hi)
		}
	}
}

// Old latencies are forgotten, however few: a bucket that held one long
// ago is empty again. (Weights halved rounding up kept a one forever.)
func TestLatenciesForget(t *testing.T) {
	var l latencies
	l.add(5000)
	for range 10 * latencyWindow {
		l.add(1000)
	}
	if c := l.counts[bucketOf(5000)]; c != 0 {
		t.Errorf("a latency of long ago still weighs %d", c)
	}
}

// fill is latencies to add to a histogram: n of them spread evenly over
// [from, to) microseconds, added by add - seen in full or censored.
type fill struct {
	n        int
	from, to uint64
	add      func(*latencies, uint64)
}

func full(n int, from, to uint64) fill { return fill{n, from, to, (*latencies).add} }
func cut(n int, from, to uint64) fill  { return fill{n, from, to, (*latencies).addCensored} }

func (f fill) into(l *latencies) {
	for i := range uint64(f.n) {
		f.add(l, f.from+i*(f.to-f.from)/uint64(f.n))
	}
}

// top is the top of the bucket of us, where a delay learned there lands.
func top(us uint64) time.Duration { return time.Duration(bucketTop(bucketOf(us))) * time.Microsecond }

// The delay at p95 over fast calls of 1 to 2ms, a slow mode at 100ms or
// 200ms, and first attempts cut short by their hedges (censored) after
// running past the delay in force: it goes to the target where nothing
// censored hides it; it goes down to the most the target can be, censored
// latencies counted slower than any; it grows when even the least it can
// be, censored latencies counted as ending when cut short, is above the
// delay, by half or to the least; and it stays otherwise. Slow first
// attempts seen in full (a hedge held back by the budget, or slower than
// the attempt) never lift it into the slow mode.
func TestLatenciesDelay(t *testing.T) {
	const fast, edge = 1000, 2000 // the fast mode, µs
	tests := []struct {
		name  string
		fills []fill
		cur   time.Duration
		want  time.Duration
	}{
		{"no censoring: the quantile", []fill{full(1000, fast, edge)}, 0, top(1950)},
		{"no censoring, slow mode of 2%: the quantile among the fast", []fill{full(980, fast, edge), full(20, 100000, 100001)}, 0, top(1970)},
		{"no censoring, slow mode of 5%: its edge", []fill{full(950, fast, edge), full(50, 100000, 100001)}, 0, top(1999)},
		{"no censoring, slow mode of 10%: inside it, where p95 is", []fill{full(900, fast, edge), full(100, 100000, 100001)}, 0, top(100000)},

		{"censored above the quantile: exact, the delay comes down to it", []fill{full(960, fast, edge), cut(40, 30000, 30001)}, 25 * time.Millisecond, top(1989)},
		{"censored below the quantile: by half, all the target may be", []fill{full(500, fast, 1500), full(400, 1500, edge), cut(100, 1600, 1601)}, 1500 * time.Microsecond, 2250 * time.Microsecond},
		{"censored below the quantile, fewer: up to the most it can be", []fill{full(500, fast, 1500), full(450, 1500, edge), cut(50, 1600, 1601)}, 1500 * time.Microsecond, top(1999)},

		{"slow mode of 2%, cut short at the edge: the quantile among the fast", []fill{full(980, fast, edge), cut(20, 3000, 3001)}, top(1999), top(1970)},
		{"slow mode of 5%, cut short at the edge: stays there", []fill{full(950, fast, edge), cut(50, 3000, 3001)}, top(1999), top(1999)},
		{"slow mode of 5%, a few seen in full: stays at the edge", []fill{full(950, fast, edge), cut(45, 3000, 3001), full(5, 100000, 100001)}, top(1999), top(1999)},
		{"slow mode of 10%, cut short at the edge: grows, to the least", []fill{full(900, fast, edge), cut(100, 3000, 3001)}, top(1999), top(3000)},
		{"slow mode of 10%, the delay past it: inside it, where p95 is", []fill{full(900, fast, edge), full(100, 100000, 100001)}, 150 * time.Millisecond, top(100000)},

		// Issue 46's case: 920 fast calls up to 6ms and 80 past the delay.
		{"8% past the delay, all cut short: by half", []fill{full(920, fast, 6000), cut(80, 7000, 7001)}, top(6000), 9214500 * time.Nanosecond},
		{"8% past the delay, 5 seen in full at 200ms: by half, not into the slow mode", []fill{full(920, fast, 6000), cut(75, 7000, 7001), full(5, 200000, 200001)}, top(6000), 9214500 * time.Nanosecond},
		{"8% past the delay, half seen in full: by half", []fill{full(920, fast, 6000), cut(40, 7000, 7001), full(40, 200000, 200001)}, top(6000), 9214500 * time.Nanosecond},
		{"cut short under a lower delay, some seen in full: stays", []fill{full(920, fast, 6000), cut(75, 5000, 5001), full(5, 200000, 200001)}, 9214500 * time.Nanosecond, 9214500 * time.Nanosecond},

		{"drift up, seen in full: followed at once", []fill{full(400, fast, edge), full(1000, 5000, 10000)}, top(1999), top(9650)},
		{"drift up, half cut short: at once to the least", []fill{full(400, fast, edge), full(500, 5000, 10000), cut(500, 6000, 6001)}, top(1999), top(9300)},
		{"drift up by less than half, a few cut short: to the most", []fill{full(400, fast, edge), full(1000, 2100, 2300), cut(100, 2400, 2401)}, top(1999), top(2299)},
		{"drift down: followed at once", []fill{full(50, 5000, 10000), full(1900, fast, edge)}, top(9999), top(1975)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var l latencies
			for _, f := range tt.fills {
				f.into(&l)
			}
			if got, ok := l.delay(0.95, tt.cur); !ok || got != tt.want {
				t.Errorf("delay from %v = %v, %v; want %v", tt.cur, got, ok, tt.want)
			}
		})
	}
}

// The delay learned over many calls to a dependency with a slow mode at 100
// to 200ms, each call's first attempt hedged at the delay in force: cut
// short when its hedge, as slow as any call, answers first; seen in full
// when it answers first, or when the hedge is held back (the budget) or
// the fast mode has stragglers (a loaded machine). The delay never enters
// a slow mode of 2 or 5%, and ends in one of 10%, where p95 is.
func TestLatenciesClosedLoop(t *testing.T) {
	const slowFrom = 100 * time.Millisecond
	tests := []struct {
		name              string
		slow, held, strag float64 // shares of calls: slow; hedges held back; fast stragglers
		maxBelow, lo, hi  time.Duration
	}{
		{"slow mode of 2%", 0.02, 0.1, 0.03, slowFrom, time.Millisecond, 10 * time.Millisecond},
		{"slow mode of 5%", 0.05, 0.1, 0.03, slowFrom, time.Millisecond, 10 * time.Millisecond},
		{"slow mode of 5%, hedges held back", 0.05, 0.3, 0.03, slowFrom, time.Millisecond, 10 * time.Millisecond},
		{"slow mode of 5%, many stragglers", 0.05, 0.1, 0.06, slowFrom, time.Millisecond, 30 * time.Millisecond},
		{"slow mode of 10%", 0.10, 0.1, 0.03, time.Hour, slowFrom, 2 * slowFrom},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for seed := range uint64(5) {
				r := rand.New(rand.NewPCG(seed, 46))
				draw := func() uint64 { // µs
					switch v := r.Float64(); {
					case v < tt.slow:
						return uint64(slowFrom/time.Microsecond) + r.Uint64N(100000)
					case v < tt.slow+tt.strag:
						return 1000 + uint64(r.ExpFloat64()*10000)
					default:
						return 1000 + r.Uint64N(1000)
					}
				}
				var l latencies
				var cur, highest time.Duration
				for range 20000 {
					lat, d := draw(), uint64(cur/time.Microsecond)
					switch hedge := draw(); {
					case cur == 0 || lat <= d || r.Float64() < tt.held || d+hedge >= lat:
						l.add(lat)
					default:
						l.addCensored(d + hedge)
					}
					if next, ok := l.delay(0.95, cur); ok {
						cur = max(next, time.Millisecond)
					}
					highest = max(highest, cur)
				}
				if highest >= tt.maxBelow || cur < tt.lo || cur > tt.hi {
					t.Errorf("seed %d: delay at most %v, at the end %v; want below %v, ending in [%v, %v]", seed, highest, cur, tt.maxBelow, tt.lo, tt.hi)
				}
			}
		})
	}
}

func TestHedgeContext(t *testing.T) {
	type key struct{}
	parent, cancelParent := context.WithCancel(context.WithValue(context.Background(), key{}, "v"))
	t.Cleanup(cancelParent)

	c := newHedgeContext(parent)
	if !c.reusable(parent) || c.reusable(context.Background()) {
		t.Error("a fresh hedgeContext is for its own parent only")
	}
	if c.Value(key{}) != "v" || c.Err() != nil {
		t.Error("values and state are the parent's")
	}
	child, cancelChild := context.WithCancel(c) // waits on c: makes it real
	t.Cleanup(cancelChild)
	if c.reusable(parent) {
		t.Error("a hedgeContext something waited on is not reused")
	}
	c.cancel()
	<-child.Done()
	if !errors.Is(c.Err(), context.Canceled) || !errors.Is(context.Cause(c), context.Canceled) || parent.Err() != nil {
		t.Errorf("after cancel: Err %v, Cause %v, parent %v", c.Err(), context.Cause(c), parent.Err())
	}

	// Cancelled before anything waited on it: Done is closed when asked for.
	c = newHedgeContext(parent)
	c.cancel()
	if c.reusable(parent) || !errors.Is(c.Err(), context.Canceled) || !errors.Is(context.Cause(c), context.Canceled) {
		t.Error("a cancelled hedgeContext reports it, and is not reused")
	}
	<-c.Done()

	// The parent's cancellation reaches it, waited on or not.
	c, w := newHedgeContext(parent), newHedgeContext(parent)
	done := w.Done()
	cancelParent()
	<-done
	if !errors.Is(c.Err(), context.Canceled) {
		t.Errorf("Err after the parent was cancelled: %v", c.Err())
	}

	// Contexts that cannot be compared are never reused, and comparing
	// never panics, however deep the uncomparable value.
	for _, ctx := range []context.Context{
		uncomparableCtx{Context: parent},
		wrappedCtx{uncomparableCtx{Context: parent}},
	} {
		if c := newHedgeContext(ctx); c.reusable(ctx) {
			t.Errorf("%T: an uncomparable context is reused", ctx)
		}
	}
	c = newHedgeContext(wrappedCtx{parent})
	if !c.reusable(wrappedCtx{parent}) || c.reusable(wrappedCtx{uncomparableCtx{Context: parent}}) {
		t.Error("a comparable wrapper is reused for an equal context only")
	}
}

// A first attempt's context that the callback waited on is cancelled once
// the attempt returns. It is a child of the caller's context, which may live
// as long as the process (a server's base context): left alone, it stays
// registered there, one per call.
func TestHedgedCallReleasesItsContext(t *testing.T) {
	parent := &childCounter{Context: t.Context()}
	p := Defaults()
	p.Hedge = NewHedge(HedgeOptions{Delay: time.Hour})
	var last context.Context
	for range 100 {
		_, err := RunHedged(parent, p, func(ctx context.Context) (int, error) {
			last = ctx
			select { // as net/http and grpc do
			case <-ctx.Done():
				return 0, ctx.Err()
			default:
				return 1, nil
			}
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	if n := parent.live.Load(); n != 0 {
		t.Errorf("100 calls left %d children on the caller's context", n)
	}
	if !errors.Is(last.Err(), context.Canceled) {
		t.Errorf("the last attempt's context after the call: %v, want cancelled", last.Err())
	}
}

// childCounter counts the contexts derived from it that are still waiting
// on it.
type childCounter struct {
	context.Context
	live atomic.Int64
}

// Value hides the embedded context's cancelCtx, so that children register
// through AfterFunc, where they are counted, rather than in its map.
func (c *childCounter) Value(any) any { return nil }

func (c *childCounter) AfterFunc(f func()) func() bool {
	c.live.Add(1)
	stop := context.AfterFunc(c.Context, f)
	return func() bool {
		c.live.Add(-1)
		return stop()
	}
}

type uncomparableCtx struct {
	context.Context
	_ []int
}

// wrappedCtx is a comparable type whose values need not be.
type wrappedCtx struct{ context.Context }

// Hedged calls on the real clock, many at once, some hedged, some not:
// for the race detector, and the invariants that hold whatever the timing.
func TestHedgeConcurrent(t *testing.T) {
	p := Defaults()
	p.Backoff = Backoff{}
	p.Hedge = NewHedge(HedgeOptions{Delay: time.Millisecond, MaxHedges: 2})
	p.MaxAttempts = 4
	var wg sync.WaitGroup
	var inFlight, maxInFlight atomic.Int64
	for g := range 8 {
		wg.Go(func() {
			for i := range 50 {
				r := TryHedged(context.Background(), p, func(ctx context.Context) (int, error) {
					n := inFlight.Add(1)
					defer inFlight.Add(-1)
					for m := maxInFlight.Load(); n > m && !maxInFlight.CompareAndSwap(m, n); m = maxInFlight.Load() {
					}
					if (g+i)%3 == 0 { // slow: a hedge comes due
						select {
						case <-ctx.Done():
							return 0, ctx.Err()
						case <-time.After(3 * time.Millisecond):
						}
					}
					return 1, nil
				})
				if r.Err != nil || r.Value != 1 {
					t.Errorf("call: %v, %v", r.Value, r.Err)
				}
				if len(r.Attempts) > p.MaxAttempts {
					t.Errorf("%d attempts, more than %d", len(r.Attempts), p.MaxAttempts)
				}
			}
		})
	}
	wg.Wait()
	if n := inFlight.Load(); n != 0 {
		t.Errorf("%d callbacks still running after every call returned", n)
	}
}

// A hedge that does not fire costs RunHedged no allocation with the
// caller's context of the previous call (its first attempt's context is
// reused), and exactly one, that context, with a context of its own, as a
// request's is. Run is the baseline. Each slot allocates what it keeps on
// its first use, so the slots are warmed first.
func TestRunHedgedNotFiringAllocations(t *testing.T) {
	type key struct{}
	bg := context.Background()
	for _, tc := range []struct {
		name  string
		ctx   func() context.Context
		extra float64
	}{
		{"the same context", func() context.Context { return bg }, 0},
		{"a context per call", func() context.Context { return context.WithValue(bg, key{}, 1) }, 1},
	} {
		plain, hedged := Defaults(), Defaults()
		hedged.Hedge = NewHedge(HedgeOptions{Delay: time.Hour})
		plainCall := func() { _, _ = Run(tc.ctx(), plain, succeed) }
		hedgedCall := func() { _, _ = RunHedged(tc.ctx(), hedged, succeed) }
		for range 1000 {
			plainCall()
			hedgedCall()
		}
		run, hedgedRun := testing.AllocsPerRun(1000, plainCall), testing.AllocsPerRun(1000, hedgedCall)
		if hedgedRun != run+tc.extra {
			t.Errorf("%s: RunHedged %v allocs, Run %v; want %v more", tc.name, hedgedRun, run, tc.extra)
		}
	}
}

// Calls that start in the same microsecond hash to the same slot: each
// takes the next free one, and the table grows only when every slot is
// taken. Before, once the eight slots after the hash were taken the table
// doubled for as long as their calls ran: in a bubble, where forty calls
// start at one instant and none ends, without end.
func TestHedgeSlotsForCallsStartingTogether(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p := &Policy{Hedge: NewHedge(HedgeOptions{Delay: time.Hour})}
		release := make(chan struct{})
		var wg sync.WaitGroup
		for range 40 {
			wg.Go(func() {
				_, _ = RunHedged(context.Background(), p, func(context.Context) (int, error) { <-release; return 0, nil })
			})
		}
		synctest.Wait()
		if n := len(*p.Hedge.table.Load()); n != 64 {
			t.Errorf("%d slots for 40 calls running; want 64: 16 doubled until every call has one", n)
		}
		close(release)
		wg.Wait()
		clocktest.Advance(3 * time.Hour) // the watcher's two idle looks, an hour apart
	})
}
