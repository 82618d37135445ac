package limit_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/pkg/adaptive"
	"github.com/egressd/egressd/pkg/limit"
	"github.com/egressd/egressd/pkg/sdk"
	"github.com/egressd/egressd/pkg/verdict"
)

// recorder is an Observer that remembers what it was told.
type recorder struct {
	mu     sync.Mutex
	leases [2]int // by outcome
	waits  []time.Duration
	limits []int
}

func (r *recorder) OnLease(o limit.Outcome) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.leases[o]++
}

func (r *recorder) OnWait(d time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.waits = append(r.waits, d)
}

func (r *recorder) OnLimit(n int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.limits = append(r.limits, n)
}

func mustNew(t testing.TB, opts limit.Options) *limit.Local {
	t.Helper()
	l, err := limit.New(opts)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// TestRefusals checks what each shape's refusal says: a *sdk.RateLimitedError
// naming the limiter, with the shape's hint. Like every test here that
// reads the limiter's time, it runs in a synctest bubble, whose clock
// stands still until the test moves it.
func TestRefusals(t *testing.T) {
	tests := []struct {
		name       string
		opts       limit.Options
		admits     int           // acquires that succeed at t0 first
		retryAfter time.Duration // the next one's hint
	}{
		{"per second: the time to the next token", limit.Options{Name: "api", PerSecond: &limit.PerSecondOptions{Permits: 4, Burst: 2}}, 2, 250 * time.Millisecond},
		{"per window: until the oldest counted segment leaves", limit.Options{Name: "api", PerWindow: &limit.PerWindowOptions{Permits: 3, Window: time.Minute, Segments: 6}}, 3, time.Minute},
		{"concurrency: no hint", limit.Options{Name: "api", Concurrency: 2}, 2, 0},
		{"adaptive: no hint", limit.Options{Name: "api", Adaptive: &adaptive.Options{Minimum: 1, Initial: 2, Maximum: 5}}, 2, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				l := mustNew(t, tt.opts)
				for i := range tt.admits {
					if _, err := l.Acquire(context.Background()); err != nil {
						t.Fatalf("acquire %d: %v", i, err)
					}
				}
				_, err := l.Acquire(context.Background())
				rl, ok := sdk.AsRateLimited(err)
				if !ok || !errors.Is(err, sdk.ErrRateLimited) {
					t.Fatalf("refusal %v (%T); want a *sdk.RateLimitedError", err, err)
				}
				if rl.Limiter != "api" || rl.RetryAfter != tt.retryAfter || rl.Err != nil {
					t.Fatalf("refusal %+v; want limiter api, retry after %v, no cause", rl, tt.retryAfter)
				}
			})
		})
	}
}

// TestRefusalThroughTheExecutor checks the point of the error type: the
// executor reads a refusal as Throttled and SelfImposed with the limiter's
// hint, whatever the classifier's rules say.
func TestRefusalThroughTheExecutor(t *testing.T) { synctest.Test(t, testRefusalThroughTheExecutor) }

func testRefusalThroughTheExecutor(t *testing.T) {
	l := mustNew(t, limit.Options{Name: "payments", PerSecond: &limit.PerSecondOptions{Permits: 2, Burst: 1}})
	p := &sdk.Policy{
		MaxAttempts: 1,
		// A rule that would make every error Transient; a refusal is
		// recognised before it.
		Classifier: sdk.DefaultClassifier().OnRule(func(error) (verdict.Verdict, bool) {
			return verdict.New(verdict.Transient), true
		}),
	}
	call := func(ctx context.Context) (string, error) {
		lease, err := l.Acquire(ctx)
		if err != nil {
			return "", err
		}
		defer lease.Release()
		return "ok", nil
	}
	if r := sdk.Try(context.Background(), p, call); r.Err != nil {
		t.Fatalf("first call: %v", r.Err)
	}
	r := sdk.Try(context.Background(), p, call)
	a := r.Attempts[0]
	ra, ok := a.Verdict().RetryAfter()
	if a.Kind() != verdict.Throttled || !a.SelfImposed() || !ok || ra != 500*time.Millisecond {
		t.Fatalf("refused attempt %v; want Throttled, self-imposed, retry after 500ms", a)
	}
	if rl, ok := sdk.AsRateLimited(r.Err); !ok || rl.Limiter != "payments" || r.Stop != sdk.StopAttemptsExhausted {
		t.Fatalf("call ended %v with %v; want attempts exhausted by payments", r.Stop, r.Err)
	}
}

func TestConcurrency(t *testing.T) {
	rec := &recorder{}
	l := mustNew(t, limit.Options{Concurrency: 2, Observer: rec})
	ctx := context.Background()
	a, err1 := l.Acquire(ctx)
	b, err2 := l.Acquire(ctx)
	_, err3 := l.Acquire(ctx)
	if err1 != nil || err2 != nil || !sdk.IsRateLimited(err3) || l.InFlight() != 2 {
		t.Fatalf("acquires: %v, %v, %v with %d in flight; want two leases and a refusal", err1, err2, err3, l.InFlight())
	}
	a.Release()
	a.Release() // released already: nothing
	if l.InFlight() != 1 {
		t.Fatalf("%d in flight after releasing one lease twice; want 1", l.InFlight())
	}
	c, err := l.Acquire(ctx)
	if err != nil {
		t.Fatalf("after a release: %v", err)
	}
	b.Release()
	c.Release()
	var zero limit.Lease
	zero.Release()
	if l.InFlight() != 0 {
		t.Fatalf("%d in flight after every release; want 0", l.InFlight())
	}
	if rec.leases != [2]int{3, 1} || rec.waits != nil || rec.limits != nil {
		t.Fatalf("observed leases %v, waits %v, limits %v; want 3 acquired, 1 denied, no waits (no queue), no limits (not adaptive)",
			rec.leases, rec.waits, rec.limits)
	}
}

// TestConcurrencyBound is for the race detector as much as for the bound:
// goroutines hammer a bulkhead and never see more than its permits inside.
func TestConcurrencyBound(t *testing.T) {
	for _, queue := range []int{0, 1000} {
		const permits = 3
		l := mustNew(t, limit.Options{Concurrency: permits, QueueLimit: queue})
		var inside, most, refused atomic.Int64
		var wg sync.WaitGroup
		for range 8 {
			wg.Go(func() {
				for range 2000 {
					lease, err := l.Acquire(context.Background())
					if err != nil {
						refused.Add(1)
						continue
					}
					n := inside.Add(1)
					for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
					}
					inside.Add(-1)
					lease.Release()
				}
			})
		}
		wg.Wait()
		if most.Load() > permits || l.InFlight() != 0 || (queue > 0 && refused.Load() != 0) {
			t.Fatalf("queue %d: %d inside at most, %d in flight after, %d refused", queue, most.Load(), l.InFlight(), refused.Load())
		}
	}
}

// TestAdaptive checks the wiring to package adaptive: the hold time is the
// sample, reaching the limit constrains the round, and the observer hears
// the limit move. The loop's own rules are package adaptive's to test; the
// reference loop (no drain probes) keeps this one short.
func TestAdaptive(t *testing.T) { synctest.Test(t, testAdaptive) }

func testAdaptive(t *testing.T) {
	rec := &recorder{}
	var changes [][2]int
	l := mustNew(t, limit.Options{
		Name: "payments",
		Adaptive: &adaptive.Options{
			Minimum: 1, Initial: 4, Maximum: 10, ProbeEvery: adaptive.NoProbes,
			OnChange: func(from, to int) { changes = append(changes, [2]int{from, to}) },
		},
		Observer: rec,
	})
	ctx := context.Background()
	// A round: the limit's worth of leases held at once (so in-flight
	// reaches the limit), each held 10ms.
	round := func(hold time.Duration) {
		t.Helper()
		leases := make([]limit.Lease, l.Limit())
		for i := range leases {
			var err error
			if leases[i], err = l.Acquire(ctx); err != nil {
				t.Fatalf("acquire %d of %d: %v", i, len(leases), err)
			}
		}
		clocktest.Advance(hold)
		for i := range leases {
			leases[i].Release()
		}
	}
	// Rounds of 4 until the window has ten calls; the third one judges.
	round(10 * time.Millisecond)
	round(10 * time.Millisecond)
	if _, ok := l.Baseline(); ok || l.Limit() != 4 {
		t.Fatalf("after 8 calls: limit %d; want 4 with no baseline yet", l.Limit())
	}
	round(10 * time.Millisecond)
	if b, ok := l.Baseline(); !ok || b.Round(time.Millisecond) != 10*time.Millisecond || l.Limit() != 5 {
		t.Fatalf("after 12 calls: limit %d, baseline %v %t; want 5 and 10ms", l.Limit(), b, ok)
	}
	// A round where even the fastest lease is held 30ms is a queue.
	round(30 * time.Millisecond)
	if l.Limit() != 4 {
		t.Fatalf("after a slow round: limit %d; want ⌊5 × 0.9⌋ = 4", l.Limit())
	}
	want := [][2]int{{4, 5}, {5, 4}}
	if len(changes) != 2 || changes[0] != want[0] || changes[1] != want[1] {
		t.Fatalf("OnChange saw %v; want %v", changes, want)
	}
	if len(rec.limits) != 3 || rec.limits[0] != 4 || rec.limits[1] != 5 || rec.limits[2] != 4 {
		t.Fatalf("the observer saw limits %v; want [4 5 4]: the initial one, then each move", rec.limits)
	}
}

// TestAdaptiveProbesByDefault: an adaptive limiter with every default
// runs drain probes: the first round judged starts one at Minimum, and its
// state says so. The observer is told the limit settled on, which a probe
// does not move: its gauge would otherwise dip at every probe.
func TestAdaptiveProbesByDefault(t *testing.T) { synctest.Test(t, testAdaptiveProbesByDefault) }

func testAdaptiveProbesByDefault(t *testing.T) {
	rec := &recorder{}
	l := mustNew(t, limit.Options{Adaptive: &adaptive.Options{}, Observer: rec})
	ctx := context.Background()
	leases := make([]limit.Lease, l.Limit())
	for i := range leases {
		var err error
		if leases[i], err = l.Acquire(ctx); err != nil {
			t.Fatal(err)
		}
	}
	clocktest.Advance(10 * time.Millisecond)
	for _, lease := range leases {
		lease.Release()
	}
	st, ok := l.AdaptiveState()
	if !ok || !st.Probing || st.Limit != adaptive.DefaultMinimum || st.Settled != adaptive.DefaultInitial+1 || l.Limit() != st.Limit {
		t.Fatalf("after the first round: state %+v %t, limit %d; want a probe at Minimum", st, ok, l.Limit())
	}
	if want := []int{adaptive.DefaultInitial, st.Settled}; len(rec.limits) != 2 || rec.limits[0] != want[0] || rec.limits[1] != want[1] {
		t.Errorf("the observer saw limits %v; want %v: the initial one, then the one settled on", rec.limits, want)
	}
	if _, ok := mustNew(t, limit.Options{Concurrency: 3}).AdaptiveState(); ok {
		t.Error("a concurrency limiter has an adaptive state")
	}
}

// TestAdaptiveIdleDoesNotGrow: rounds that never reach the limit hold it,
// and a refusal alone is enough to say the limit constrained.
func TestAdaptiveIdleDoesNotGrow(t *testing.T) { synctest.Test(t, testAdaptiveIdleDoesNotGrow) }

func testAdaptiveIdleDoesNotGrow(t *testing.T) {
	l := mustNew(t, limit.Options{Adaptive: &adaptive.Options{Minimum: 1, Initial: 2, Maximum: 10, ProbeEvery: adaptive.NoProbes}})
	ctx := context.Background()
	one := func() {
		lease, err := l.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		clocktest.Advance(time.Millisecond)
		lease.Release()
	}
	for range 20 { // one at a time: in-flight never reaches 2
		one()
	}
	if l.Limit() != 2 {
		t.Fatalf("idle: limit %d; want 2", l.Limit())
	}
	a, _ := l.Acquire(ctx)
	b, _ := l.Acquire(ctx)
	if _, err := l.Acquire(ctx); !sdk.IsRateLimited(err) {
		t.Fatalf("third acquire at limit 2: %v; want a refusal", err)
	}
	clocktest.Advance(time.Millisecond)
	a.Release()
	b.Release()
	if l.Limit() != 3 {
		t.Fatalf("a constrained round: limit %d; want 3", l.Limit())
	}
}

func TestRateShapesReleaseNothing(t *testing.T) { synctest.Test(t, testRateShapesReleaseNothing) }

func testRateShapesReleaseNothing(t *testing.T) {
	l := mustNew(t, limit.Options{PerSecond: &limit.PerSecondOptions{Permits: 1}})
	lease, err := l.Acquire(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	lease.Release() // a rate permit is spent when taken
	if _, err := l.Acquire(context.Background()); !sdk.IsRateLimited(err) {
		t.Fatalf("after releasing a rate lease: %v; want a refusal", err)
	}
	if l.InFlight() != 0 || l.Limit() != 1 {
		t.Fatalf("in flight %d, limit %d", l.InFlight(), l.Limit())
	}
}

// TestAcquireDoesNotAllocate backs the benchmarks' 0 allocs/op with a test
// that fails: a lease is a value, a bulkhead's refusal is shared.
func TestAcquireDoesNotAllocate(t *testing.T) {
	for _, tt := range []struct {
		name string
		l    *limit.Local
	}{
		{"PerSecond", limit.PerSecond(limit.MaxRate)},
		{"PerWindow", mustNew(t, limit.Options{PerWindow: &limit.PerWindowOptions{Permits: 1 << 40, Window: time.Second}})},
		{"Concurrency", limit.Concurrency(1)},
		{"Concurrency refused", limit.Concurrency(1)},
		{"Adaptive", limit.Adaptive(1)},
	} {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			if tt.name == "Concurrency refused" {
				if _, err := tt.l.Acquire(ctx); err != nil {
					t.Fatal(err)
				}
			}
			allocs := testing.AllocsPerRun(1000, func() {
				lease, _ := tt.l.Acquire(ctx)
				lease.Release()
			})
			if allocs != 0 {
				t.Fatalf("%v allocations per acquire and release; want 0", allocs)
			}
		})
	}
}
