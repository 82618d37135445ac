package adaptive_test

import (
	"sync"
	"testing"
	"time"

	"github.com/egressd/egressd/pkg/adaptive"
)

// t0 is the fixed instant every step table starts from.
var t0 = time.Date(2025, time.January, 1, 0, 0, 0, 0, time.UTC)

const (
	fast   = 10 * time.Millisecond
	fast19 = 19 * time.Millisecond // under 2 × fast: not a queue
	slow25 = 25 * time.Millisecond // over 2 × fast: a queue
	slow   = 100 * time.Millisecond
)

// step is what happens at one instant. Every call completes at at with
// latency; before each call, Constrained is called refusals times, so a step
// with refusals constrains every round it touches.
type step struct {
	at       time.Time
	latency  time.Duration
	rounds   int // whole rounds: Limit() calls each
	calls    int // then this many more calls, a partial round
	refusals int
	limit    int           // want, after the step
	baseline time.Duration // want, after the step; 0 for none
}

// TestController holds the loop to the reference's semantics: every row
// runs it with ProbeEvery NoProbes, which is that loop exactly (the
// probes' own table is in probe_test.go), and the guards MaxHealthy and a
// fixed Baseline.
func TestController(t *testing.T) {
	tests := []struct {
		name  string
		opts  adaptive.Options
		steps []step
	}{{
		name: "holds at Initial before enough samples",
		opts: adaptive.Options{Minimum: 1, Initial: 4, Maximum: 10},
		steps: []step{
			{at: t0, latency: fast, rounds: 1, refusals: 1, limit: 4},
			// Slow, and constrained, but 8 calls have no 10th percentile.
			{at: t0, latency: slow, rounds: 1, refusals: 1, limit: 4},
			// 12 calls: the 2nd fastest is the baseline, and a fast round grows.
			{at: t0, latency: fast, rounds: 1, refusals: 1, limit: 5, baseline: fast},
		},
	}, {
		name: "the first round at defaults teaches the baseline",
		steps: []step{
			{at: t0, latency: fast, calls: 19, refusals: 1, limit: 20},
			{at: t0, latency: fast, calls: 1, limit: 21, baseline: fast},
		},
	}, {
		name: "idle: no growth",
		steps: []step{
			{at: t0, latency: fast, rounds: 5, limit: 20, baseline: fast},
			{at: t0.Add(time.Minute), latency: fast, rounds: 1, refusals: 1, limit: 21, baseline: fast},
			// Busy, but never at the limit.
			{at: t0.Add(2 * time.Minute), latency: fast, rounds: 50, limit: 21, baseline: fast},
			// An hour without a call, then calls that never reach the limit.
			{at: t0.Add(time.Hour), latency: fast, rounds: 3, limit: 21, baseline: fast},
		},
	}, {
		name: "decrease factor applied",
		steps: []step{
			{at: t0, latency: fast, rounds: 10, limit: 20, baseline: fast},
			{at: t0.Add(10 * time.Second), latency: slow25, rounds: 1, limit: 18, baseline: fast},
			{at: t0.Add(20 * time.Second), latency: slow25, rounds: 1, limit: 16, baseline: fast},
			{at: t0.Add(30 * time.Second), latency: fast19, rounds: 1, refusals: 1, limit: 17, baseline: fast},
		},
	}, {
		name: "custom decrease factor, rounded down to Minimum",
		opts: adaptive.Options{DecreaseFactor: 0.5},
		steps: []step{
			{at: t0, latency: fast, rounds: 10, limit: 20, baseline: fast},
			{at: t0.Add(10 * time.Second), latency: slow, rounds: 1, limit: 10, baseline: fast},
			{at: t0.Add(20 * time.Second), latency: slow, rounds: 1, limit: 5, baseline: fast},
			{at: t0.Add(30 * time.Second), latency: slow, rounds: 1, limit: 4, baseline: fast},
		},
	}, {
		name: "one slow call is a tail, not a queue",
		steps: []step{
			{at: t0, latency: fast, rounds: 10, limit: 20, baseline: fast},
			{at: t0.Add(10 * time.Second), latency: fast, calls: 1, limit: 20, baseline: fast},
			{at: t0.Add(10 * time.Second), latency: slow, calls: 19, limit: 20, baseline: fast},
		},
	}, {
		name: "slow for unrelated reasons: holds at the floor and samples recovery",
		steps: []step{
			{at: t0, latency: fast, rounds: 50, limit: 20, baseline: fast},
			// 20 18 16 14 12 10 9 8 7 6 5 → 4.
			{at: t0.Add(10 * time.Second), latency: slow, rounds: 11, limit: 4, baseline: fast},
			// Rounds of four keep completing at the floor, constrained or not.
			{at: t0.Add(20 * time.Second), latency: slow, rounds: 20, refusals: 1, limit: 4, baseline: fast},
			// So the first fast round after it is seen.
			{at: t0.Add(30 * time.Second), latency: fast, rounds: 1, refusals: 1, limit: 5, baseline: fast},
			{at: t0.Add(40 * time.Second), latency: fast, rounds: 2, refusals: 1, limit: 7, baseline: fast},
		},
	}, {
		name: "recovery after a slow spell",
		steps: []step{
			{at: t0, latency: fast, rounds: 10, limit: 20, baseline: fast},
			{at: t0.Add(10 * time.Second), latency: slow25, rounds: 3, refusals: 1, limit: 14, baseline: fast},
			// Down in three rounds, back up in six: the directions differ in speed.
			{at: t0.Add(20 * time.Second), latency: fast, rounds: 6, refusals: 1, limit: 20, baseline: fast},
		},
	}, {
		name: "ceiling",
		opts: adaptive.Options{Maximum: 25},
		steps: []step{
			{at: t0, latency: fast, rounds: 10, refusals: 1, limit: 25, baseline: fast},
			{at: t0.Add(10 * time.Second), latency: fast, rounds: 20, refusals: 1, limit: 25, baseline: fast},
		},
	}, {
		// The documented limitation: a baseline learned while the dependency
		// queues calls the queue normal, and only Maximum stops the growth.
		name: "baseline learned while queueing grows to Maximum",
		steps: []step{
			{at: t0, latency: 500 * time.Millisecond, rounds: 180, refusals: 1, limit: 200, baseline: 500 * time.Millisecond},
			{at: t0.Add(10 * time.Second), latency: 500 * time.Millisecond, rounds: 10, refusals: 1, limit: 200, baseline: 500 * time.Millisecond},
		},
	}, {
		name: "five-minute window ages out old samples",
		opts: adaptive.Options{Minimum: 1, Initial: 8},
		steps: []step{
			{at: t0, latency: fast, rounds: 10, limit: 8, baseline: fast},
			// 4m50s on, the fast calls still set the baseline.
			{at: t0.Add(4*time.Minute + 50*time.Second), latency: slow25, rounds: 1, limit: 7, baseline: fast},
			// 5m on, they are gone: 25ms is the new normal.
			{at: t0.Add(5 * time.Minute), latency: slow25, rounds: 1, refusals: 1, limit: 8, baseline: slow25},
			// 5m later the window is empty; 8 calls are too few to judge,
			// and the limit holds where it was rather than resetting.
			{at: t0.Add(10 * time.Minute), latency: slow25, rounds: 1, refusals: 1, limit: 8},
			{at: t0.Add(10 * time.Minute), latency: slow25, rounds: 1, refusals: 1, limit: 9, baseline: slow25},
		},
	}, {
		name: "MaxHealthy: a round whose fastest call is slower decreases, whatever the baseline says",
		opts: adaptive.Options{MaxHealthy: 20 * time.Millisecond},
		steps: []step{
			// Learned while slow: 25ms is the baseline, and a round of
			// 25ms calls is no queue by it; but it breaks MaxHealthy.
			{at: t0, latency: slow25, rounds: 1, refusals: 1, limit: 18, baseline: slow25},
			{at: t0, latency: slow25, rounds: 1, refusals: 1, limit: 16, baseline: slow25},
			// At MaxHealthy exactly, rounds are judged by the baseline
			// (the window's, which now holds 20ms calls too).
			{at: t0, latency: 20 * time.Millisecond, rounds: 1, refusals: 1, limit: 17, baseline: 20 * time.Millisecond},
		},
	}, {
		name: "MaxHealthy decreases before there is a baseline",
		opts: adaptive.Options{MaxHealthy: 50 * time.Millisecond, Minimum: 1, Initial: 4},
		steps: []step{
			// 4 calls are too few for a baseline, but 100ms breaks MaxHealthy.
			{at: t0, latency: slow, rounds: 1, refusals: 1, limit: 3},
			// A fast round without a baseline still holds.
			{at: t0, latency: fast, rounds: 1, refusals: 1, limit: 3},
		},
	}, {
		name: "a fixed Baseline judges from the first round",
		opts: adaptive.Options{Baseline: fast, Minimum: 1, Initial: 4},
		steps: []step{
			{at: t0, latency: fast19, rounds: 1, refusals: 1, limit: 5, baseline: fast},
			{at: t0, latency: slow25, rounds: 1, limit: 4, baseline: fast},
			// Hours of slow calls teach it nothing: it is fixed.
			{at: t0.Add(time.Hour), latency: slow, rounds: 30, refusals: 1, limit: 1, baseline: fast},
		},
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			opts := tt.opts
			if opts.Baseline == 0 {
				opts.ProbeEvery = adaptive.NoProbes
			}
			c, err := adaptive.New(&opts)
			if err != nil {
				t.Fatal(err)
			}
			for i, s := range tt.steps {
				for range s.rounds {
					for range c.Limit() {
						call(c, s)
					}
				}
				for range s.calls {
					call(c, s)
				}
				got, ok := c.Baseline()
				if c.Limit() != s.limit || ok != (s.baseline > 0) || !near(got, s.baseline) {
					t.Fatalf("step %d: limit %d, baseline %v %t; want %d, %v", i, c.Limit(), got, ok, s.limit, s.baseline)
				}
			}
		})
	}
}

func call(c *adaptive.Controller, s step) {
	for range s.refusals {
		c.Constrained()
	}
	c.Sample(s.at, s.latency)
}

// near reports whether a baseline is within the histogram's 1/64 of want.
func near(got, want time.Duration) bool {
	return (got - want).Abs() <= want/64
}

func TestOnChange(t *testing.T) {
	type change struct{ from, to, seen int }
	var changes []change
	var c *adaptive.Controller
	c, err := adaptive.New(&adaptive.Options{
		Maximum:    21,
		ProbeEvery: adaptive.NoProbes,
		OnChange: func(from, to int) {
			// Limit is lock-free, so the callback may read it, and it
			// already shows the new value.
			changes = append(changes, change{from, to, c.Limit()})
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []step{
		{at: t0, latency: fast, rounds: 3, refusals: 1},
		{at: t0, latency: slow, rounds: 2},
	} {
		for range s.rounds {
			for range c.Limit() {
				call(c, s)
			}
		}
	}
	want := []change{{20, 21, 21}, {21, 18, 18}, {18, 16, 16}}
	if len(changes) != len(want) {
		t.Fatalf("changes %v; want %v", changes, want)
	}
	for i := range want {
		if changes[i] != want[i] {
			t.Errorf("change %d: %v; want %v", i, changes[i], want[i])
		}
	}
}

// TestConcurrentUse is for the race detector: a ring-buffer reader feeding
// samples while limiter goroutines report refusals and read the state.
func TestConcurrentUse(t *testing.T) {
	var moves int
	c, err := adaptive.New(&adaptive.Options{OnChange: func(int, int) { moves++ }})
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			for i := range 5000 {
				c.Constrained()
				c.Sample(t0.Add(time.Duration(i)*time.Millisecond), time.Duration(g+1)*fast)
				_, _ = c.Baseline()
			}
		})
	}
	wg.Wait()
	if l := c.Limit(); l < adaptive.DefaultMinimum || l > adaptive.DefaultMaximum || moves == 0 {
		t.Fatalf("limit %d after %d moves", l, moves)
	}
}

func TestSampleDoesNotAllocate(t *testing.T) {
	c, err := adaptive.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	now := t0
	allocs := testing.AllocsPerRun(100_000, func() {
		now = now.Add(time.Millisecond) // crosses slots, so retiring is measured too
		c.Constrained()
		c.Sample(now, fast)
	})
	// The window's next slot, once every ten seconds of now, is far
	// below one allocation per call.
	if allocs != 0 {
		t.Fatalf("Sample allocates %v times per call; want 0", allocs)
	}
}

func BenchmarkSample(b *testing.B) {
	c, err := adaptive.New(nil)
	if err != nil {
		b.Fatal(err)
	}
	latencies := lognormal(1024, 1)
	now := t0
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		now = now.Add(time.Microsecond)
		c.Sample(now, latencies[i%len(latencies)])
	}
}

func BenchmarkSampleParallel(b *testing.B) {
	c, err := adaptive.New(nil)
	if err != nil {
		b.Fatal(err)
	}
	latencies := lognormal(1024, 1)
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		now := t0
		for i := 0; pb.Next(); i++ {
			now = now.Add(time.Microsecond)
			c.Constrained()
			c.Sample(now, latencies[i%len(latencies)])
		}
	})
}

// TestStateSaysWhetherItProbes: a loop without probes says so, where its
// other figures look like those of a loop with probes none of which has
// yet been due.
func TestStateSaysWhetherItProbes(t *testing.T) {
	for _, tt := range []struct {
		name string
		opts adaptive.Options
		want bool
	}{
		{"defaults", adaptive.Options{}, false},
		{"probeEvery 0", adaptive.Options{ProbeEvery: adaptive.NoProbes}, true},
		{"a fixed baseline", adaptive.Options{Baseline: 5 * time.Millisecond}, true},
	} {
		c, err := adaptive.New(&tt.opts)
		if err != nil {
			t.Fatal(err)
		}
		if st := c.State(); st.NoProbes != tt.want || st.Probes != 0 || !st.NextProbe.IsZero() {
			t.Errorf("%s: state %+v, want NoProbes %v", tt.name, st, tt.want)
		}
	}
}
