package sdk

import (
	"context"
	"errors"
	"slices"
	"syscall"
	"testing"
	"testing/synctest"
	"time"

	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/pkg/verdict"
)

// The executor's tests that involve time run in synctest bubbles: its
// backoffs and deadlines pass on the bubble's fake clock, at once and to
// the nanosecond.

// A step is what one attempt of a scripted callback does.
type step func(ctx context.Context) error

func ret(err error) step { return func(context.Context) error { return err } }

// takes takes d of the bubble's clock, as an attempt that takes d would,
// then returns err.
func takes(d time.Duration, err error) step {
	return func(context.Context) error { clocktest.Latency(context.Background(), d); return err }
}

// hangs takes d of the bubble's clock and then waits for the attempt's
// context, as a call to an unresponsive dependency would.
func hangs(d time.Duration) step {
	return func(ctx context.Context) error {
		clocktest.Latency(context.Background(), d)
		<-ctx.Done()
		return ctx.Err()
	}
}

// timeline records when each scripted attempt started and ended.
type timeline struct{ starts, ends []time.Time }

// sleeps returns what the executor slept: the time between one attempt's
// end and the next one's start, and after the last, until end, if it slept
// there before it stopped.
func (tl *timeline) sleeps(end time.Time) []time.Duration {
	var d []time.Duration
	for i := 1; i < len(tl.starts); i++ {
		d = append(d, tl.starts[i].Sub(tl.ends[i-1]))
	}
	if n := len(tl.ends); n > 0 && end.After(tl.ends[n-1]) {
		d = append(d, end.Sub(tl.ends[n-1]))
	}
	return d
}

// script returns a callback that plays steps in order and counts calls,
// on tl when it is not nil.
func script(t *testing.T, tl *timeline, calls *int, steps ...step) func(context.Context) (int, error) {
	t.Helper()
	return func(ctx context.Context) (int, error) {
		n := *calls
		*calls++
		if n >= len(steps) {
			t.Errorf("callback called %d times, script has %d steps", n+1, len(steps))
			return n, errCustom
		}
		if tl != nil {
			tl.starts = append(tl.starts, time.Now())
			defer func() { tl.ends = append(tl.ends, time.Now()) }()
		}
		return n, steps[n](ctx)
	}
}

// testPolicy is a policy with the default curves and no jitter.
func testPolicy() *Policy {
	return &Policy{
		MaxAttempts: 3,
		Backoff: Backoff{
			Transient: Curve{Initial: 100 * time.Millisecond, Multiplier: 2},
			Throttled: Curve{Initial: time.Second, Multiplier: 2},
			MaxDelay:  30 * time.Second,
		},
		random: func() float64 { return 0 },
	}
}

func verdicts(log []verdict.Attempt) []string {
	s := make([]string, len(log))
	for i, a := range log {
		s[i] = a.Verdict().String()
	}
	return s
}

func delays(log []verdict.Attempt) []time.Duration {
	d := make([]time.Duration, len(log))
	for i, a := range log {
		d[i] = a.Delay()
	}
	return d
}

var (
	errReset = dialErr(syscall.ECONNRESET)
	err404   = &StatusError{Code: 404}
)

func status(code int, retryAfter string) error {
	return &StatusError{Code: code, RetryAfter: retryAfter}
}

func TestRunStopReasons(t *testing.T) {
	tests := []struct {
		name       string
		policy     func(*Policy) // adjusts testPolicy
		steps      []step
		wantStop   StopReason
		wantLog    []string
		wantSleeps []time.Duration
		wantIs     []error
	}{
		{
			name:     "success at once",
			steps:    []step{ret(nil)},
			wantStop: StopSuccess,
			wantLog:  []string{"OK"},
		},
		{
			name:       "transient then success",
			steps:      []step{ret(errReset), ret(nil)},
			wantStop:   StopSuccess,
			wantLog:    []string{"Transient", "OK"},
			wantSleeps: []time.Duration{100 * time.Millisecond},
		},
		{
			name:       "transient until attempts exhausted",
			steps:      []step{ret(errReset), ret(errReset), ret(errReset)},
			wantStop:   StopAttemptsExhausted,
			wantLog:    []string{"Transient", "Transient", "Transient"},
			wantSleeps: []time.Duration{100 * time.Millisecond, 200 * time.Millisecond},
			wantIs:     []error{ErrAttemptsExhausted, syscall.ECONNRESET},
		},
		{
			name:       "server Retry-After wins over the curve",
			steps:      []step{ret(status(429, "3")), ret(nil)},
			wantStop:   StopSuccess,
			wantLog:    []string{"Throttled(retry after 3s)", "OK"},
			wantSleeps: []time.Duration{3 * time.Second},
		},
		{
			name:       "server throttling without a hint takes the throttled curve",
			steps:      []step{ret(status(429, "")), ret(status(429, "")), ret(nil)},
			wantStop:   StopSuccess,
			wantLog:    []string{"Throttled", "Throttled", "OK"},
			wantSleeps: []time.Duration{time.Second, 2 * time.Second},
		},
		{
			name:       "Retry-After zero retries now",
			steps:      []step{ret(status(503, "0")), ret(nil)},
			wantStop:   StopSuccess,
			wantLog:    []string{"Transient(retry after 0s)", "OK"},
			wantSleeps: []time.Duration{0},
		},
		{
			name:       "curve follows each verdict's kind",
			steps:      []step{ret(status(429, "")), ret(errReset), ret(nil)},
			wantStop:   StopSuccess,
			wantLog:    []string{"Throttled", "Transient", "OK"},
			wantSleeps: []time.Duration{time.Second, 200 * time.Millisecond},
		},
		{
			name:       "limiter hint wins over the curve",
			steps:      []step{ret(&RateLimitedError{Limiter: "payments", RetryAfter: 250 * time.Millisecond}), ret(nil)},
			wantStop:   StopSuccess,
			wantLog:    []string{"Throttled(self-imposed, retry after 250ms)", "OK"},
			wantSleeps: []time.Duration{250 * time.Millisecond},
		},
		{
			name:       "refused every time surfaces the limiter",
			steps:      []step{ret(&RateLimitedError{Limiter: "payments"}), ret(&RateLimitedError{Limiter: "payments"}), ret(&RateLimitedError{Limiter: "payments"})},
			wantStop:   StopAttemptsExhausted,
			wantLog:    []string{"Throttled(self-imposed)", "Throttled(self-imposed)", "Throttled(self-imposed)"},
			wantSleeps: []time.Duration{time.Second, 2 * time.Second},
			wantIs:     []error{ErrAttemptsExhausted, ErrRateLimited},
		},
		{
			name:       "Retry-After capped by MaxDelay",
			policy:     func(p *Policy) { p.Backoff.MaxDelay = 2 * time.Second },
			steps:      []step{ret(status(429, "3600")), ret(nil)},
			wantStop:   StopSuccess,
			wantLog:    []string{"Throttled(retry after 1h0m0s)", "OK"},
			wantSleeps: []time.Duration{2 * time.Second},
		},
		{
			name:     "permanent stops at once",
			steps:    []step{ret(err404)},
			wantStop: StopPermanent,
			wantLog:  []string{"Permanent"},
			wantIs:   []error{err404},
		},
		{
			name:     "unknown error is permanent",
			steps:    []step{ret(errCustom)},
			wantStop: StopPermanent,
			wantLog:  []string{"Permanent"},
			wantIs:   []error{errCustom},
		},
		{
			name:     "delay past the deadline stops without sleeping",
			policy:   func(p *Policy) { p.Deadline = 2 * time.Second },
			steps:    []step{ret(status(429, "5"))},
			wantStop: StopDeadline,
			wantLog:  []string{"Throttled(retry after 5s)"},
			wantIs:   []error{context.DeadlineExceeded},
		},
		{
			name:       "delay inside the deadline sleeps",
			policy:     func(p *Policy) { p.Deadline = 2 * time.Second },
			steps:      []step{takes(500*time.Millisecond, status(429, "1")), ret(nil)},
			wantStop:   StopSuccess,
			wantLog:    []string{"Throttled(retry after 1s)", "OK"},
			wantSleeps: []time.Duration{time.Second},
		},
		{
			name:       "budget exhausted",
			policy:     func(p *Policy) { p.MaxAttempts = 5; p.Budget = NewRetryBudget(0.1, 1) },
			steps:      []step{ret(errReset), ret(errReset)},
			wantStop:   StopBudget,
			wantLog:    []string{"Transient", "Transient"},
			wantSleeps: []time.Duration{100 * time.Millisecond},
			wantIs:     []error{ErrBudgetExhausted, syscall.ECONNRESET},
		},
		{
			name: "breaker opens mid-call",
			policy: func(p *Policy) {
				p.MaxAttempts = 5
				p.Breaker = NewBreaker(BreakerOptions{FailureThreshold: 2, OpenFor: time.Minute})
			},
			steps:      []step{ret(errReset), ret(errReset)},
			wantStop:   StopBreakerOpen,
			wantLog:    []string{"Transient", "Transient"},
			wantSleeps: []time.Duration{100 * time.Millisecond, 200 * time.Millisecond},
			wantIs:     []error{ErrBreakerOpen, syscall.ECONNRESET},
		},
		{
			name:     "error a rule calls OK is a success",
			policy:   func(p *Policy) { p.Classifier = DefaultClassifier().OnError(errCustom, verdict.New(verdict.OK)) },
			steps:    []step{ret(errCustom)},
			wantStop: StopSuccess,
			wantLog:  []string{"OK"},
			wantIs:   []error{errCustom},
		},
		{
			name:     "zero MaxAttempts makes one attempt",
			policy:   func(p *Policy) { p.MaxAttempts = 0 },
			steps:    []step{ret(errReset)},
			wantStop: StopAttemptsExhausted,
			wantLog:  []string{"Transient"},
			wantIs:   []error{ErrAttemptsExhausted},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				p := testPolicy()
				if tt.policy != nil {
					tt.policy(p)
				}
				var calls int
				var tl timeline
				r := Try(context.Background(), p, script(t, &tl, &calls, tt.steps...))
				if r.Stop != tt.wantStop {
					t.Errorf("Stop = %v, want %v (err %v)", r.Stop, tt.wantStop, r.Err)
				}
				if got := verdicts(r.Attempts); !slices.Equal(got, tt.wantLog) {
					t.Errorf("attempt log = %q, want %q", got, tt.wantLog)
				}
				if got := tl.sleeps(time.Now()); !slices.Equal(got, tt.wantSleeps) {
					t.Errorf("sleeps = %v, want %v", got, tt.wantSleeps)
				}
				for _, target := range tt.wantIs {
					if !errors.Is(r.Err, target) {
						t.Errorf("errors.Is(%v, %v) = false", r.Err, target)
					}
				}
				if (r.Err == nil) != (len(tt.wantIs) == 0) {
					t.Errorf("Err = %v, want one matching %v", r.Err, tt.wantIs)
				}
				if calls != len(tt.steps) {
					t.Errorf("callback called %d times, want %d", calls, len(tt.steps))
				}
			})
		})
	}
}

func TestRunStopErrorCountsAttempts(t *testing.T) { synctest.Test(t, testRunStopErrorCountsAttempts) }

func testRunStopErrorCountsAttempts(t *testing.T) {
	var calls int
	r := Try(context.Background(), testPolicy(), script(t, nil, &calls, ret(errReset), ret(errReset), ret(errReset)))
	se, isStop := AsStop(r.Err)
	if !isStop || se.Attempts != 3 || se.Reason != StopAttemptsExhausted {
		t.Fatalf("Err = %#v, want a StopError after 3 attempts", r.Err)
	}
	if want := "attempts exhausted (3 attempts): " + errReset.Error(); r.Err.Error() != want {
		t.Errorf("Error() = %q, want %q", r.Err.Error(), want)
	}
	if got := delays(r.Attempts); !slices.Equal(got, []time.Duration{100 * time.Millisecond, 200 * time.Millisecond, 0}) {
		t.Errorf("logged delays = %v", got)
	}
}

func TestRunReturnsValueAndLogsDurations(t *testing.T) {
	synctest.Test(t, testRunReturnsValueAndLogsDurations)
}

func testRunReturnsValueAndLogsDurations(t *testing.T) {
	var calls int
	r := Try(context.Background(), testPolicy(), script(t, nil, &calls, takes(40*time.Millisecond, errReset), takes(15*time.Millisecond, nil)))
	if r.Err != nil || r.Value != 1 {
		t.Fatalf("Try = %v, %v; want 1, nil", r.Value, r.Err)
	}
	var durations []time.Duration
	for _, a := range r.Attempts {
		durations = append(durations, a.Duration())
	}
	if want := []time.Duration{40 * time.Millisecond, 15 * time.Millisecond}; !slices.Equal(durations, want) {
		t.Errorf("durations = %v, want %v", durations, want)
	}

	calls = 0
	v, err := Run(context.Background(), testPolicy(), script(t, nil, &calls, ret(err404)))
	if v != 0 || !errors.Is(err, err404) {
		t.Errorf("Run = %v, %v; want the zero value and the 404", v, err)
	}
}

// The callback's context ends at min(attempt timeout, remaining deadline).
func TestRunAttemptDeadline(t *testing.T) {
	tests := []struct {
		name           string
		attemptTimeout time.Duration
		deadline       time.Duration
		steps          []step
		want           []time.Duration // deadline each attempt saw, after the call began
	}{
		{"attempt timeout sooner", 2 * time.Second, 10 * time.Second, []step{ret(nil)}, []time.Duration{2 * time.Second}},
		{"deadline sooner", 5 * time.Second, 3 * time.Second, []step{ret(nil)}, []time.Duration{3 * time.Second}},
		{"deadline only", 0, 3 * time.Second, []step{ret(nil)}, []time.Duration{3 * time.Second}},
		{"attempt timeout only", 2 * time.Second, 0, []step{ret(nil)}, []time.Duration{2 * time.Second}},
		{
			"remaining deadline shrinks",
			5 * time.Second, 6 * time.Second,
			[]step{takes(4*time.Second, errReset), ret(nil)},
			// attempt 2 starts at 4.1s: 5s of timeout would end at 9.1s, the deadline at 6s.
			[]time.Duration{5 * time.Second, 6 * time.Second},
		},
		{
			"each attempt gets its own timeout",
			2 * time.Second, 0,
			[]step{takes(time.Second, errReset), ret(nil)},
			[]time.Duration{2 * time.Second, 1100*time.Millisecond + 2*time.Second},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				p := testPolicy()
				p.AttemptTimeout, p.Deadline = tt.attemptTimeout, tt.deadline
				var seen []time.Duration
				var calls int
				play := script(t, nil, &calls, tt.steps...)
				start := time.Now()
				_, err := Run(context.Background(), p, func(ctx context.Context) (int, error) {
					d, _ := ctx.Deadline()
					seen = append(seen, d.Sub(start))
					return play(ctx)
				})
				if err != nil {
					t.Fatalf("Run: %v", err)
				}
				if !slices.Equal(seen, tt.want) {
					t.Errorf("attempt deadlines = %v, want %v", seen, tt.want)
				}
			})
		})
	}
}

func TestRunWithoutDeadlinePassesCallerContext(t *testing.T) {
	for _, tt := range []struct {
		name string
		p    *Policy
		ctx  func() (context.Context, context.CancelFunc)
	}{
		{"no timeouts", &Policy{}, func() (context.Context, context.CancelFunc) { return context.WithCancel(context.Background()) }},
		// The caller's deadline is sooner than the attempt timeout, so the
		// caller's context already enforces it.
		{"caller deadline sooner", &Policy{AttemptTimeout: 2 * time.Hour, Deadline: 3 * time.Hour}, func() (context.Context, context.CancelFunc) {
			return context.WithTimeout(context.Background(), time.Hour)
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := tt.ctx()
			t.Cleanup(cancel)
			_, err := Run(ctx, tt.p, func(got context.Context) (struct{}, error) {
				if got != ctx {
					t.Error("callback got a derived context")
				}
				return struct{}{}, nil
			})
			if err != nil {
				t.Fatalf("Run: %v", err)
			}
		})
	}
}

func TestRunAttemptTimeoutIsTransient(t *testing.T) {
	synctest.Test(t, testRunAttemptTimeoutIsTransient)
}

func testRunAttemptTimeoutIsTransient(t *testing.T) {
	p := testPolicy()
	p.AttemptTimeout = 2 * time.Second
	var calls int
	r := Try(context.Background(), p, script(t, nil, &calls, hangs(3*time.Second), hangs(3*time.Second), ret(nil)))
	if r.Err != nil || r.Stop != StopSuccess {
		t.Fatalf("Try = %v, %v; want success on the third attempt", r.Stop, r.Err)
	}
	if got, want := verdicts(r.Attempts), []string{"Transient", "Transient", "OK"}; !slices.Equal(got, want) {
		t.Errorf("attempt log = %q, want %q", got, want)
	}

	calls = 0
	p.MaxAttempts = 1
	r = Try(context.Background(), p, script(t, nil, &calls, hangs(3*time.Second)))
	if !errors.Is(r.Err, ErrAttemptTimeout) || !errors.Is(r.Err, ErrAttemptsExhausted) {
		t.Errorf("Err = %v, want an attempt timeout, attempts exhausted", r.Err)
	}
}

func TestRunDeadlineDuringAttempt(t *testing.T) { synctest.Test(t, testRunDeadlineDuringAttempt) }

func testRunDeadlineDuringAttempt(t *testing.T) {
	p := testPolicy()
	p.Deadline = 3 * time.Second
	p.Breaker = NewBreaker(BreakerOptions{FailureThreshold: 1})
	var calls int
	r := Try(context.Background(), p, script(t, nil, &calls, hangs(4*time.Second)))
	if r.Stop != StopDeadline || !errors.Is(r.Err, context.DeadlineExceeded) {
		t.Fatalf("Try = %v, %v; want deadline", r.Stop, r.Err)
	}
	if got := verdicts(r.Attempts); !slices.Equal(got, []string{"Transient"}) {
		t.Errorf("attempt log = %q", got)
	}
	// A dependency that hangs until the deadline is evidence.
	if got := p.Breaker.State(time.Now()); got != BreakerOpen {
		t.Errorf("breaker %v after a hung attempt, want open", got)
	}
}

func TestRunCancelled(t *testing.T) {
	cancelInside := func(cancel context.CancelFunc) step {
		return func(ctx context.Context) error { cancel(); return ctx.Err() }
	}
	// cancelDuringDelay fails the attempt, and cancels 50ms into the 100ms
	// backoff after it.
	cancelDuringDelay := func(cancel context.CancelFunc) step {
		return func(context.Context) error { time.AfterFunc(50*time.Millisecond, cancel); return errReset }
	}
	tests := []struct {
		name     string
		steps    func(cancel context.CancelFunc) []step
		early    bool // cancel before Run
		wantLog  []string
		wantCall int
	}{
		{"before the first attempt", func(context.CancelFunc) []step { return nil }, true, []string{}, 0},
		{"during an attempt", func(c context.CancelFunc) []step { return []step{cancelInside(c)} }, false, []string{"Permanent"}, 1},
		{"during a delay", func(c context.CancelFunc) []step { return []step{cancelDuringDelay(c)} }, false, []string{"Transient"}, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				p := testPolicy()
				p.Breaker = NewBreaker(BreakerOptions{FailureThreshold: 1})
				p.Budget = NewRetryBudget(0.1, 10)
				ctx, cancel := context.WithCancel(context.Background())
				t.Cleanup(cancel)
				if tt.early {
					cancel()
				}
				var calls int
				r := Try(ctx, p, script(t, nil, &calls, tt.steps(cancel)...))
				if r.Stop != StopCancelled || !errors.Is(r.Err, context.Canceled) {
					t.Errorf("Try = %v, %v; want cancelled", r.Stop, r.Err)
				}
				if got := verdicts(r.Attempts); !slices.Equal(got, tt.wantLog) {
					t.Errorf("attempt log = %q, want %q", got, tt.wantLog)
				}
				if calls != tt.wantCall {
					t.Errorf("callback called %d times, want %d", calls, tt.wantCall)
				}
				// No retry was made: a token taken for one is given back.
				if got := p.Budget.Tokens(); got != 10 {
					t.Errorf("budget holds %v tokens, want all 10", got)
				}
			})
		})
	}
}

func TestRunCancelledAttemptIsNoEvidence(t *testing.T) {
	synctest.Test(t, testRunCancelledAttemptIsNoEvidence)
}

func testRunCancelledAttemptIsNoEvidence(t *testing.T) {
	p := testPolicy()
	p.Breaker = NewBreaker(BreakerOptions{FailureThreshold: 1})
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	_, _ = Run(ctx, p, func(ctx context.Context) (int, error) { cancel(); return 0, ctx.Err() })
	if got := p.Breaker.State(time.Now()); got != BreakerClosed {
		t.Errorf("breaker %v after the caller cancelled, want closed", got)
	}
}

// A refusal costs the dependency nothing: it neither spends nor funds the
// retry budget, and it is no evidence for the breaker. Both are asserted,
// for a refusal the callback returns and one the Admit hook makes.
func TestRefusalsAreExemptFromBudgetAndBreaker(t *testing.T) {
	refuse := func(context.Context) (int, error) {
		return 0, &RateLimitedError{Limiter: "payments", RetryAfter: 10 * time.Millisecond}
	}
	tests := []struct {
		name  string
		admit func(context.Context, NextAttempt) verdict.Verdict
		fn    func(context.Context) (int, error)
	}{
		{"callback returns RateLimitedError", nil, refuse},
		{"callback returns ErrRateLimited", nil, func(context.Context) (int, error) { return 0, ErrRateLimited }},
		{"Admit refuses", func(context.Context, NextAttempt) verdict.Verdict { return verdict.Refused(10 * time.Millisecond) }, refuse},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				p := testPolicy()
				p.MaxAttempts = 4
				p.Admit = tt.admit
				p.Budget = NewRetryBudget(0.5, 2)
				p.Budget.TrySpend(Critical) // 1 of 2 tokens left: a deposit would show
				p.Breaker = NewBreaker(BreakerOptions{FailureThreshold: 2})
				for i := range 10 {
					r := Try(context.Background(), p, tt.fn)
					if r.Stop != StopAttemptsExhausted || !r.Attempts[0].SelfImposed() {
						t.Fatalf("call %d: %v, %v; want every attempt refused, attempts exhausted", i, r.Stop, r.Err)
					}
				}
				if got := p.Budget.Tokens(); got != 1 {
					t.Errorf("budget holds %v tokens after 40 refusals, want 1 (untouched)", got)
				}
				if got := p.Breaker.State(time.Now()); got != BreakerClosed {
					t.Errorf("breaker %v after 40 refusals, want closed", got)
				}
			})
		})
	}
}

// A user rule cannot turn a refusal into evidence against the dependency.
func TestRefusalCannotBeDowngraded(t *testing.T) { synctest.Test(t, testRefusalCannotBeDowngraded) }

func testRefusalCannotBeDowngraded(t *testing.T) {
	p := testPolicy()
	p.Classifier = On(DefaultClassifier(), func(*RateLimitedError) verdict.Verdict { return verdict.New(verdict.Transient) })
	p.Breaker = NewBreaker(BreakerOptions{FailureThreshold: 1})
	r := Try(context.Background(), p, func(context.Context) (int, error) {
		return 0, &RateLimitedError{Limiter: "l", RetryAfter: time.Millisecond}
	})
	if got := r.Attempts[0].Verdict(); got != verdict.Refused(time.Millisecond) {
		t.Errorf("verdict = %v, want the refusal", got)
	}
	if got := p.Breaker.State(time.Now()); got != BreakerClosed {
		t.Errorf("breaker %v, want closed", got)
	}
}

// probePolicy is a policy of one attempt, whose breaker opens on the first
// Transient failure, for 5s.
func probePolicy() *Policy {
	p := testPolicy()
	p.MaxAttempts = 1
	p.Breaker = NewBreaker(BreakerOptions{FailureThreshold: 1, OpenFor: 5 * time.Second})
	return p
}

// Half-open, the probe is refused by a limiter; the next probe must still be
// admitted, or the breaker is wedged half-open forever.
func TestBreakerNeverWedgesOnRefusedProbe(t *testing.T) {
	tests := []struct {
		name  string
		admit func(context.Context, NextAttempt) verdict.Verdict
		probe func(context.Context) (int, error)
	}{
		{"limiter in the callback", nil, func(context.Context) (int, error) { return 0, &RateLimitedError{Limiter: "l"} }},
		{"Admit hook", func(_ context.Context, n NextAttempt) verdict.Verdict { return verdict.Refused(verdict.NoRetryAfter) }, func(context.Context) (int, error) { return 0, nil }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				p := probePolicy()

				if r := Try(context.Background(), p, func(context.Context) (int, error) { return 0, errReset }); r.Stop != StopAttemptsExhausted {
					t.Fatalf("opening call: %v", r.Stop)
				}
				if r := Try(context.Background(), p, func(context.Context) (int, error) { return 0, nil }); r.Stop != StopBreakerOpen || len(r.Attempts) != 0 {
					t.Fatalf("call while open: %v with %d attempts, want breaker open with none", r.Stop, len(r.Attempts))
				}
				clocktest.Advance(5 * time.Second)

				p.Admit = tt.admit
				if r := Try(context.Background(), p, tt.probe); r.Stop != StopAttemptsExhausted || !r.Attempts[0].SelfImposed() {
					t.Fatalf("refused probe: %v, %v", r.Stop, r.Err)
				}
				if got := p.Breaker.State(time.Now()); got != BreakerHalfOpen {
					t.Fatalf("breaker %v after a refused probe, want half-open", got)
				}

				p.Admit = nil
				var called bool
				r := Try(context.Background(), p, func(context.Context) (int, error) { called = true; return 0, nil })
				if !called || r.Stop != StopSuccess {
					t.Fatalf("next probe: called %v, %v, %v; want admitted and successful", called, r.Stop, r.Err)
				}
				if got := p.Breaker.State(time.Now()); got != BreakerClosed {
					t.Errorf("breaker %v after a successful probe, want closed", got)
				}
			})
		})
	}
}

// Half-open, the probe panics (in the callback or in Admit) and the caller
// recovers, as net/http's server does: the probe slot comes back, or the
// breaker is wedged half-open forever.
func TestBreakerNeverWedgesOnPanickingProbe(t *testing.T) {
	boom := func(context.Context) (int, error) { panic("boom") }
	ok := func(context.Context) (int, error) { return 0, nil }
	tests := []struct {
		name   string
		hedged bool
		admit  func(context.Context, NextAttempt) verdict.Verdict
		probe  func(context.Context) (int, error)
	}{
		{"callback", false, nil, boom},
		{"Admit hook", false, func(context.Context, NextAttempt) verdict.Verdict { panic("boom") }, ok},
		{"hedged callback", true, nil, boom},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				p := probePolicy()
				if tt.hedged {
					p.Hedge = newTestHedge(t, HedgeOptions{Delay: time.Hour})
				}
				run := Run[int]
				if tt.hedged {
					run = RunHedged[int]
				}
				run(context.Background(), p, func(context.Context) (int, error) { return 0, errReset })
				clocktest.Advance(5 * time.Second)

				p.Admit = tt.admit
				func() {
					defer func() {
						if v := recover(); v != "boom" {
							t.Fatalf("probe: recovered %v, want the panic", v)
						}
					}()
					run(context.Background(), p, tt.probe)
				}()

				p.Admit = nil
				var called bool
				if _, err := run(context.Background(), p, func(context.Context) (int, error) { called = true; return 0, nil }); !called || err != nil {
					t.Fatalf("next probe: called %v, %v; want admitted and successful", called, err)
				}
				if got := p.Breaker.State(time.Now()); got != BreakerClosed {
					t.Errorf("breaker %v after a successful probe, want closed", got)
				}
			})
		})
	}
}

func TestAdmit(t *testing.T) {
	tests := []struct {
		name        string
		criticality Criticality
		wantStop    StopReason
		wantLog     []string
		wantCalls   int
		wantNumbers []int
	}{
		{"sheddable is refused", Sheddable, StopAttemptsExhausted, []string{"Throttled(self-imposed, retry after 1s)", "Throttled(self-imposed, retry after 1s)"}, 0, []int{1, 2}},
		{"critical is admitted", Critical, StopSuccess, []string{"OK"}, 1, []int{1}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				p := testPolicy()
				p.MaxAttempts = 2
				var numbers []int
				p.Admit = func(ctx context.Context, next NextAttempt) verdict.Verdict {
					numbers = append(numbers, next.Number)
					if CriticalityFrom(ctx) != next.Criticality {
						t.Errorf("NextAttempt.Criticality %v, context says %v", next.Criticality, CriticalityFrom(ctx))
					}
					if next.Criticality < Critical {
						return verdict.Refused(time.Second)
					}
					return verdict.Verdict{}
				}
				var calls int
				r := Try(WithCriticality(context.Background(), tt.criticality), p, script(t, nil, &calls, ret(nil)))
				if r.Stop != tt.wantStop {
					t.Errorf("Stop = %v, want %v", r.Stop, tt.wantStop)
				}
				if got := verdicts(r.Attempts); !slices.Equal(got, tt.wantLog) {
					t.Errorf("attempt log = %q, want %q", got, tt.wantLog)
				}
				if calls != tt.wantCalls {
					t.Errorf("callback called %d times, want %d", calls, tt.wantCalls)
				}
				if !slices.Equal(numbers, tt.wantNumbers) {
					t.Errorf("Admit saw attempts %v, want %v", numbers, tt.wantNumbers)
				}
			})
		})
	}
}

func TestAdmitRefusalError(t *testing.T) { synctest.Test(t, testAdmitRefusalError) }

func testAdmitRefusalError(t *testing.T) {
	p := testPolicy()
	p.MaxAttempts = 1
	p.Admit = func(context.Context, NextAttempt) verdict.Verdict { return verdict.New(verdict.Permanent) }
	_, err := Run(context.Background(), p, func(context.Context) (int, error) { return 0, nil })
	var na *NotAdmittedError
	if !errors.As(err, &na) || !errors.Is(err, ErrNotAdmitted) || na.Verdict.Kind() != verdict.Permanent {
		t.Fatalf("err = %v, want a NotAdmittedError carrying Permanent", err)
	}
	if se, _ := AsStop(err); se.Reason != StopPermanent {
		t.Errorf("Reason = %v, want permanent", se.Reason)
	}
}

// Work below Critical does not get the budget's last half.
func TestRetryBudgetHonoursCriticality(t *testing.T) {
	synctest.Test(t, testRetryBudgetHonoursCriticality)
}

func testRetryBudgetHonoursCriticality(t *testing.T) {
	p := testPolicy()
	p.MaxAttempts = 10
	p.Budget = NewRetryBudget(0.1, 4)
	failing := func(context.Context) (int, error) { return 0, errReset }

	r := Try(WithCriticality(context.Background(), Sheddable), p, failing)
	if r.Stop != StopBudget || len(r.Attempts) != 3 || p.Budget.Tokens() != 2 {
		t.Fatalf("sheddable: %v after %d attempts, %v tokens left; want budget after 3, 2 left", r.Stop, len(r.Attempts), p.Budget.Tokens())
	}
	r = Try(context.Background(), p, failing)
	if r.Stop != StopBudget || len(r.Attempts) != 3 || p.Budget.Tokens() != 0 {
		t.Fatalf("critical: %v after %d attempts, %v tokens left; want budget after 3, 0 left", r.Stop, len(r.Attempts), p.Budget.Tokens())
	}
	for range 10 {
		if _, err := Run(context.Background(), p, func(context.Context) (int, error) { return 0, nil }); err != nil {
			t.Fatal(err)
		}
	}
	if got := p.Budget.Tokens(); got < 0.999 || got > 1.001 {
		t.Errorf("ten successes funded %v tokens, want 1", got)
	}
}

func TestNilAndZeroPolicy(t *testing.T) {
	for _, p := range []*Policy{nil, {}} {
		calls := 0
		_, err := Run(context.Background(), p, func(context.Context) (int, error) { calls++; return 0, errReset })
		if calls != 1 || !errors.Is(err, ErrAttemptsExhausted) {
			t.Errorf("policy %v: %d calls, %v; want one attempt, attempts exhausted", p, calls, err)
		}
		if v, err := Run(context.Background(), p, func(context.Context) (int, error) { return 7, nil }); v != 7 || err != nil {
			t.Errorf("policy %v: Run = %v, %v", p, v, err)
		}
	}
}

func TestDefaultsRetry(t *testing.T) { synctest.Test(t, testDefaultsRetry) }

func testDefaultsRetry(t *testing.T) {
	for name, p := range map[string]*Policy{"Defaults": Defaults(), "HTTPDefaults": HTTPDefaults()} {
		var calls int
		var tl timeline
		r := Try(context.Background(), p, script(t, &tl, &calls, ret(errReset), ret(status(429, "")), ret(nil)))
		if r.Stop != StopSuccess || calls != 3 {
			t.Errorf("%s: %v after %d calls", name, r.Stop, calls)
		}
		sleeps := tl.sleeps(time.Now())
		// Jitter 0.5: the transient delay is in (50ms, 100ms], the throttled one in (1s, 2s].
		if len(sleeps) != 2 || sleeps[0] <= 50*time.Millisecond || sleeps[0] > 100*time.Millisecond ||
			sleeps[1] <= time.Second || sleeps[1] > 2*time.Second {
			t.Errorf("%s: sleeps %v outside the jittered curves", name, sleeps)
		}
	}
}

// The success path of Run allocates nothing, Admit or not, when no deadline
// forces a derived context.
func TestRunSuccessDoesNotAllocate(t *testing.T) {
	admitting := Defaults()
	admitting.Admit = func(context.Context, NextAttempt) verdict.Verdict { return verdict.Verdict{} }
	for name, p := range map[string]*Policy{"zero": {}, "Defaults": Defaults(), "Defaults+Admit": admitting} {
		ctx := context.Background()
		allocs := testing.AllocsPerRun(100, func() {
			if _, err := Run(ctx, p, succeed); err != nil {
				t.Fatal(err)
			}
		})
		if allocs != 0 {
			t.Errorf("%s: %v allocs per successful Run, want 0", name, allocs)
		}
	}
}

func succeed(context.Context) (int, error) { return 1, nil }

// Run never hedges, so its callback never leaves the call: a closure that
// captures its caller's variables stays on the caller's stack.
func TestRunCapturingClosureDoesNotAllocate(t *testing.T) {
	for name, p := range map[string]*Policy{"zero": {}, "Defaults": Defaults()} {
		ctx := context.Background()
		want := 42
		allocs := testing.AllocsPerRun(100, func() {
			var got int
			v, err := Run(ctx, p, func(context.Context) (int, error) {
				got = want
				return want, nil
			})
			if err != nil || v != got {
				t.Fatal(v, got, err)
			}
		})
		if allocs != 0 {
			t.Errorf("%s: %v allocs per successful Run with a capturing closure, want 0", name, allocs)
		}
	}
}

// Run and Try refuse a policy with a Hedge before any attempt, rather than
// run it unhedged: the hedge is RunHedged's and TryHedged's.
func TestRunRefusesAHedge(t *testing.T) { synctest.Test(t, testRunRefusesAHedge) }

func testRunRefusesAHedge(t *testing.T) {
	p := testPolicy()
	p.Hedge = newTestHedge(t, HedgeOptions{Delay: time.Millisecond})
	p.Budget = NewRetryBudget(0.1, 10)
	p.Breaker = NewBreaker(BreakerOptions{FailureThreshold: 1})
	calls := 0
	fn := func(context.Context) (int, error) { calls++; return 1, nil }

	_, runErr := Run(context.Background(), p, fn)
	r := Try(context.Background(), p, fn)
	for name, err := range map[string]error{"Run": runErr, "Try": r.Err} {
		se, ok := AsStop(err)
		if !errors.Is(err, ErrHedgeNeedsRunHedged) || !ok || se.Reason != StopInvalidUse || se.Attempts != 0 {
			t.Errorf("%s: error %v, want a *StopError (%v, 0 attempts) wrapping ErrHedgeNeedsRunHedged", name, err, StopInvalidUse)
		}
	}
	if r.Stop != StopInvalidUse || len(r.Attempts) != 0 {
		t.Errorf("Try: stop %v with %d attempts logged, want %v and none", r.Stop, len(r.Attempts), StopInvalidUse)
	}
	if calls != 0 || p.Hedge.watching.Load() || p.Budget.Tokens() != 10 || p.Breaker.State(time.Now()) != BreakerClosed {
		t.Errorf("refused calls touched something: %d callback calls, watcher running %v, %v tokens, breaker %v",
			calls, p.Hedge.watching.Load(), p.Budget.Tokens(), p.Breaker.State(time.Now()))
	}

	// The same policy runs through the hedged entry points.
	if v, err := RunHedged(context.Background(), p, fn); err != nil || v != 1 || calls != 1 {
		t.Errorf("RunHedged: %v, %v after %d calls", v, err, calls)
	}
	if r := TryHedged(context.Background(), p, fn); r.Err != nil || r.Stop != StopSuccess || len(r.Attempts) != 1 {
		t.Errorf("TryHedged: %v, %v, %d attempts", r.Err, r.Stop, len(r.Attempts))
	}
}

// Without a Hedge, the hedged entry points are Run and Try.
func TestRunHedgedWithoutAHedge(t *testing.T) { synctest.Test(t, testRunHedgedWithoutAHedge) }

func testRunHedgedWithoutAHedge(t *testing.T) {
	p := testPolicy()
	var calls int
	r := TryHedged(context.Background(), p, script(t, nil, &calls, ret(errReset), ret(nil)))
	if r.Err != nil || r.Stop != StopSuccess || calls != 2 || len(r.Attempts) != 2 || r.Attempts[0].Kind() != verdict.Transient {
		t.Errorf("TryHedged without a Hedge: %v, %v after %d calls, log %v", r.Err, r.Stop, calls, r.Attempts)
	}
	_, err := RunHedged(context.Background(), nil, func(context.Context) (int, error) { return 0, err404 })
	if se, ok := AsStop(err); !ok || se.Reason != StopPermanent || se.Attempts != 1 || !errors.Is(err, err404) {
		t.Errorf("RunHedged with a nil policy: %v, want one attempt, permanent, wrapping the 404", err)
	}
}

// Policies are shared across goroutines; the budget and breaker must hold
// their invariants under concurrent calls (run with -race).
func TestRunConcurrent(t *testing.T) { synctest.Test(t, testRunConcurrent) }

func testRunConcurrent(t *testing.T) {
	p := testPolicy()
	p.Budget = NewRetryBudget(0.1, 10)
	p.Breaker = NewBreaker(BreakerOptions{FailureThreshold: 1000, HalfOpenProbes: 2})
	outcomes := []error{nil, errReset, &RateLimitedError{Limiter: "l"}, err404, status(429, "")}
	done := make(chan struct{})
	for g := range 8 {
		go func() {
			defer func() { done <- struct{}{} }()
			for i := range 200 {
				err := outcomes[(g+i)%len(outcomes)]
				_, _ = Run(context.Background(), p, func(context.Context) (int, error) { return 0, err })
			}
		}()
	}
	for range 8 {
		<-done
	}
	if tokens := p.Budget.Tokens(); tokens < 0 || tokens > 10 {
		t.Errorf("budget holds %v tokens, outside [0, 10]", tokens)
	}
}

// The executor's wait between attempts lasts its delay, and ends early, with
// the context's error, when the context does.
func TestSleep(t *testing.T) { synctest.Test(t, testSleep) }

func testSleep(t *testing.T) {
	start := time.Now()
	if err := sleep(context.Background(), 0); err != nil {
		t.Errorf("sleep(0) = %v", err)
	}
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	if err := sleep(cancelled, time.Hour); err != context.Canceled || time.Since(start) != 0 {
		t.Errorf("sleep(1h) on a cancelled context = %v after %v; want Canceled at once", err, time.Since(start))
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	if err := sleep(ctx, time.Minute); err != context.DeadlineExceeded || time.Since(start) != time.Second {
		t.Errorf("sleep(1m) with 1s left = %v after %v; want DeadlineExceeded after 1s", err, time.Since(start))
	}
	if err := sleep(context.Background(), time.Minute); err != nil || time.Since(start) != time.Second+time.Minute {
		t.Errorf("sleep(1m) = %v after %v in all; want nil, a minute more", err, time.Since(start))
	}
}
