package adaptive_test

import (
	"errors"
	"math"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/egressd/egressd/pkg/adaptive"
)

// move is one OnChange call.
type move struct{ from, to int }

// pstep is what happens at one instant of a probe table. Every call
// completes at at with latency, so it started at at − latency: whether that
// is before a probe began, during it, or after it ended is what the steps
// below arrange. Before each call, Constrained is called refusals times.
type pstep struct {
	at       time.Time
	latency  time.Duration
	calls    int
	refusals int

	// Want, after the step.
	limit    int           // Limit(): in force
	restore  int           // Probing(): the limit a probe restores; 0 for no probe
	baseline time.Duration // Baseline(); 0 for none
	moves    []move        // OnChange calls during the step, in order
}

func TestProbe(t *testing.T) {
	ms := time.Millisecond
	tests := []struct {
		name  string
		opts  adaptive.Options
		steps []pstep
	}{{
		name: "the first probe follows the first round with a baseline; the probe sets the baseline",
		opts: adaptive.Options{ProbeEvery: 3},
		steps: []pstep{
			// 20 calls make a round and a window baseline; the round is
			// judged against it (fast, constrained: 20 → 21), and a probe
			// starts at once at ⌈21 × 0.5⌉ = 11, to restore 21.
			{at: t0, latency: 15 * ms, calls: 20, refusals: 1, limit: 11, restore: 21, baseline: 15 * ms, moves: []move{{20, 11}}},
			// Calls that started before the probe drain unmeasured;
			// refusals meanwhile change nothing.
			{at: t0, latency: 15 * ms, calls: 40, refusals: 1, limit: 11, restore: 21, baseline: 15 * ms},
			// Calls that started when the probe did are measured: it needs
			// max(11, 10) of them.
			{at: t0.Add(10 * ms), latency: 10 * ms, calls: 10, refusals: 1, limit: 11, restore: 21, baseline: 15 * ms},
			// The 11th ends it. No round is judged on it, so its refusals
			// do not grow the limit: 21 is restored, not 22. The baseline
			// is the probe's 10 ms.
			{at: t0.Add(10 * ms), latency: 10 * ms, calls: 1, refusals: 1, limit: 21, baseline: 10 * ms, moves: []move{{11, 21}}},
			// The refusals of the probe were forgotten with it: this round
			// is not constrained, and a queue (25ms > 2 × 10ms) shrinks it.
			{at: t0.Add(20 * ms), latency: 25 * ms, calls: 21, limit: 18, baseline: 10 * ms, moves: []move{{21, 18}}},
			// Rounds 2 and 3 after the probe grow the limit; the third
			// ends with the next probe, at ⌈20 × 0.5⌉ = 10.
			{at: t0.Add(30 * ms), latency: 10 * ms, calls: 18, refusals: 1, limit: 19, baseline: 10 * ms, moves: []move{{18, 19}}},
			{at: t0.Add(40 * ms), latency: 10 * ms, calls: 19, refusals: 1, limit: 10, restore: 20, baseline: 10 * ms, moves: []move{{19, 10}}},
			{at: t0.Add(50 * ms), latency: 10 * ms, calls: 10, refusals: 1, limit: 20, baseline: 10 * ms, moves: []move{{10, 20}}},
		},
	}, {
		name: "rounds are judged against the probe's calls, not the window's",
		opts: adaptive.Options{ProbeEvery: 1000, Minimum: 1, Initial: 10, Maximum: 100},
		steps: []pstep{
			{at: t0, latency: 15 * ms, calls: 10, refusals: 1, limit: 6, restore: 11, baseline: 15 * ms, moves: []move{{10, 6}}},
			{at: t0.Add(10 * ms), latency: 10 * ms, calls: 10, limit: 11, baseline: 10 * ms, moves: []move{{6, 11}}},
			// Ten rounds at 15ms, 11 calls to 20: 165 calls in the window
			// at 15ms and 10 at 10ms, so its 10th percentile is 15ms. The
			// baseline stays the probe's.
			{at: t0.Add(time.Second), latency: 15 * ms, calls: 155, refusals: 1, limit: 21, baseline: 10 * ms, moves: []move{
				{11, 12}, {12, 13}, {13, 14}, {14, 15}, {15, 16}, {16, 17}, {17, 18}, {18, 19}, {19, 20}, {20, 21},
			}},
			// So 25ms is a queue (> 2 × 10ms), which the window would call
			// normal (< 2 × 15ms).
			{at: t0.Add(2 * time.Second), latency: 25 * ms, calls: 21, limit: 18, baseline: 10 * ms, moves: []move{{21, 18}}},
		},
	}, {
		name: "a decrease at the end of the round that starts a probe is what the probe restores",
		opts: adaptive.Options{ProbeEvery: 1},
		steps: []pstep{
			{at: t0, latency: 10 * ms, calls: 20, limit: 10, restore: 20, baseline: 10 * ms, moves: []move{{20, 10}}},
			{at: t0.Add(10 * ms), latency: 10 * ms, calls: 10, limit: 20, baseline: 10 * ms, moves: []move{{10, 20}}},
			// 20 → 18, and the probe holds ⌈18 × 0.5⌉ = 9 meanwhile: one
			// OnChange, from the limit in force to the probe's.
			{at: t0.Add(time.Second), latency: 25 * ms, calls: 20, limit: 9, restore: 18, baseline: 10 * ms, moves: []move{{20, 9}}},
			{at: t0.Add(time.Second + 25*ms), latency: 25 * ms, calls: 10, limit: 18, baseline: 10 * ms, moves: []move{{9, 18}}},
		},
	}, {
		name: "Minimum holds during a probe, and a probe measures at least ten calls",
		opts: adaptive.Options{ProbeEvery: 1, Minimum: 4, Initial: 4, Maximum: 10},
		steps: []pstep{
			// No baseline in the first 8 calls: no round is judged, so no
			// probe either.
			{at: t0, latency: 10 * ms, calls: 8, limit: 4},
			// The third round has one, and a probe at max(⌈4 × 0.5⌉, 4) =
			// 4: in force nothing moves, so OnChange is not called.
			{at: t0, latency: 10 * ms, calls: 4, limit: 4, restore: 4, baseline: 10 * ms},
			{at: t0.Add(10 * ms), latency: 10 * ms, calls: 9, refusals: 1, limit: 4, restore: 4, baseline: 10 * ms},
			{at: t0.Add(10 * ms), latency: 10 * ms, calls: 1, limit: 4, baseline: 10 * ms},
		},
	}, {
		name: "ProbeFactor, rounded up, never below Minimum",
		opts: adaptive.Options{ProbeEvery: 5, ProbeFactor: 0.3, Minimum: 8},
		steps: []pstep{
			// ⌈21 × 0.3⌉ = 7, under Minimum 8.
			{at: t0, latency: 10 * ms, calls: 20, refusals: 1, limit: 8, restore: 21, baseline: 10 * ms, moves: []move{{20, 8}}},
			{at: t0.Add(10 * ms), latency: 10 * ms, calls: 10, limit: 21, baseline: 10 * ms, moves: []move{{8, 21}}},
		},
	}, {
		name: "a call started during a probe counts for it after the probe ends",
		opts: adaptive.Options{ProbeEvery: 100, Minimum: 1, Initial: 10, Maximum: 100},
		steps: []pstep{
			{at: t0, latency: 40 * ms, calls: 10, limit: 5, restore: 10, baseline: 40 * ms, moves: []move{{10, 5}}},
			// The probe's first ten calls, all 40ms, end it at t0+40ms.
			{at: t0.Add(40 * ms), latency: 40 * ms, calls: 10, limit: 10, baseline: 40 * ms, moves: []move{{5, 10}}},
			// Calls that started at t0+35ms, during the probe, and ended
			// after it: they are the probe's too, and were fast.
			{at: t0.Add(45 * ms), latency: 10 * ms, calls: 2, limit: 10, baseline: 40 * ms},
			// Calls that started at t0+81ms, after it, are not; they finish
			// a round whose fastest calls were those two, so it holds. It
			// is judged against the probe's 12 calls, whose 10th percentile
			// (the 2nd fastest) is 10ms.
			{at: t0.Add(141 * ms), latency: 60 * ms, calls: 8, limit: 10, baseline: 10 * ms},
			// So a round of 60ms calls is a queue, where the probe's first
			// ten calls alone (40ms) would have called it normal.
			{at: t0.Add(200 * ms), latency: 60 * ms, calls: 10, limit: 9, baseline: 10 * ms, moves: []move{{10, 9}}},
		},
	}, {
		name: "a dependency that got slower is believed once three probes have seen it",
		opts: adaptive.Options{ProbeEvery: 1, Minimum: 1, Initial: 10, Maximum: 10},
		steps: []pstep{
			{at: t0, latency: 10 * ms, calls: 10, limit: 5, restore: 10, baseline: 10 * ms, moves: []move{{10, 5}}},
			{at: t0.Add(10 * ms), latency: 10 * ms, calls: 10, limit: 10, baseline: 10 * ms, moves: []move{{5, 10}}},
			// From here every call takes 30ms: a queue against 10ms, so
			// each round decreases, and each probe adds ten 30ms calls.
			{at: t0.Add(time.Second), latency: 30 * ms, calls: 10, limit: 5, restore: 9, baseline: 10 * ms, moves: []move{{10, 5}}},
			{at: t0.Add(time.Second + 30*ms), latency: 30 * ms, calls: 10, limit: 9, baseline: 10 * ms, moves: []move{{5, 9}}},
			{at: t0.Add(2 * time.Second), latency: 30 * ms, calls: 9, limit: 4, restore: 8, baseline: 10 * ms, moves: []move{{9, 4}}},
			// Two of three probes say 30ms, but the pooled 10th percentile
			// is still the first probe's.
			{at: t0.Add(2*time.Second + 30*ms), latency: 30 * ms, calls: 10, limit: 8, baseline: 10 * ms, moves: []move{{4, 8}}},
			{at: t0.Add(3 * time.Second), latency: 30 * ms, calls: 8, limit: 4, restore: 7, baseline: 10 * ms, moves: []move{{8, 4}}},
			// The fourth replaces the first: 30ms is the new normal.
			{at: t0.Add(3*time.Second + 30*ms), latency: 30 * ms, calls: 10, limit: 7, baseline: 30 * ms, moves: []move{{4, 7}}},
			{at: t0.Add(4 * time.Second), latency: 30 * ms, calls: 7, refusals: 1, limit: 4, restore: 8, baseline: 30 * ms, moves: []move{{7, 4}}},
		},
	}, {
		name: "a probe that cannot tell its calls gives up after twice the calls it should have needed",
		opts: adaptive.Options{ProbeEvery: 100, Minimum: 1, Initial: 10, Maximum: 100},
		steps: []pstep{
			{at: t0, latency: 10 * ms, calls: 10, limit: 5, restore: 10, baseline: 10 * ms, moves: []move{{10, 5}}},
			// Every call seems to have started before the probe (as when
			// now and latency come from different clocks). By 10 + 10
			// completions at least 10 must have been its own; at twice
			// that it ends, with nothing measured.
			{at: t0, latency: 10 * ms, calls: 39, limit: 5, restore: 10, baseline: 10 * ms},
			{at: t0, latency: 10 * ms, calls: 1, limit: 10, baseline: 10 * ms, moves: []move{{5, 10}}},
			// The window judges meanwhile, and the next probe waits its
			// 100 rounds rather than start again at once.
			{at: t0.Add(time.Second), latency: 10 * ms, calls: 10, refusals: 1, limit: 11, baseline: 10 * ms, moves: []move{{10, 11}}},
		},
	}, {
		name: "probes age out after five minutes: the window judges, and a probe starts at once",
		opts: adaptive.Options{ProbeEvery: 1000, Minimum: 1, Initial: 10, Maximum: 100},
		steps: []pstep{
			{at: t0, latency: 15 * ms, calls: 10, refusals: 1, limit: 6, restore: 11, baseline: 15 * ms, moves: []move{{10, 6}}},
			{at: t0.Add(10 * ms), latency: 10 * ms, calls: 10, limit: 11, baseline: 10 * ms, moves: []move{{6, 11}}},
			// 4m59.99s after the probe ended, it still judges: 25ms is a
			// queue, and one round of 1000 is no reason to probe.
			{at: t0.Add(5 * time.Minute), latency: 25 * ms, calls: 11, limit: 9, baseline: 10 * ms, moves: []move{{11, 9}}},
			// 5m after, it does not. The window has retired t0's calls and
			// holds only 25ms ones, so 25ms is normal; with no probe left,
			// one starts at once.
			{at: t0.Add(5*time.Minute + 10*ms), latency: 25 * ms, calls: 9, refusals: 1, limit: 5, restore: 10, baseline: 25 * ms, moves: []move{{9, 5}}},
		},
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var moves []move
			opts := tt.opts
			opts.OnChange = func(from, to int) { moves = append(moves, move{from, to}) }
			c, err := adaptive.New(&opts)
			if err != nil {
				t.Fatal(err)
			}
			for i, s := range tt.steps {
				moves = nil
				for range s.calls {
					for range s.refusals {
						c.Constrained()
					}
					c.Sample(s.at, s.latency)
				}
				got, ok := c.Baseline()
				restore, probing := c.Probing()
				if c.Limit() != s.limit || restore != s.restore || probing != (s.restore > 0) ||
					ok != (s.baseline > 0) || !near(got, s.baseline) || !slices.Equal(moves, s.moves) {
					t.Fatalf("step %d: limit %d, probing %d %t, baseline %v %t, OnChange %v;\n"+
						"want limit %d, probing %d, baseline %v, OnChange %v",
						i, c.Limit(), restore, probing, got, ok, moves, s.limit, s.restore, s.baseline, s.moves)
				}
			}
		})
	}
}

// The default is the specified loop: no probes, ever, and the same limits.
func TestNoProbesByDefault(t *testing.T) {
	plain, err := adaptive.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	off, err := adaptive.New(&adaptive.Options{ProbeFactor: 0.25}) // a factor alone does nothing
	if err != nil {
		t.Fatal(err)
	}
	now := t0
	for i := range 100_000 {
		now = now.Add(100 * time.Microsecond)
		latency := time.Duration(5+i%7) * time.Millisecond
		for _, c := range []*adaptive.Controller{plain, off} {
			c.Constrained()
			c.Sample(now, latency)
		}
		if _, probing := off.Probing(); probing || off.Limit() != plain.Limit() {
			t.Fatalf("call %d: limit %d, probing %t; want %d, not probing", i, off.Limit(), probing, plain.Limit())
		}
	}
}

func TestValidateProbe(t *testing.T) {
	tests := []struct {
		name string
		opts adaptive.Options
		want []string
	}{
		{name: "probes with the default factor", opts: adaptive.Options{ProbeEvery: 100}},
		{name: "probes with a factor", opts: adaptive.Options{ProbeEvery: 1, ProbeFactor: 0.9}},
		{name: "a factor without probes is not checked", opts: adaptive.Options{ProbeFactor: 7}},
		{
			name: "negative ProbeEvery",
			opts: adaptive.Options{ProbeEvery: -1},
			want: []string{"ProbeEvery -1 must be at least 0 (0: no probes)"},
		},
		{
			name: "factor of 1",
			opts: adaptive.Options{ProbeEvery: 10, ProbeFactor: 1},
			want: []string{"ProbeFactor 1 must lie strictly between 0 and 1"},
		},
		{
			name: "factor not a number",
			opts: adaptive.Options{ProbeEvery: 10, ProbeFactor: math.NaN()},
			want: []string{"ProbeFactor NaN must lie strictly between 0 and 1"},
		},
		{
			name: "every problem at once",
			opts: adaptive.Options{Minimum: -1, Maximum: -2, Initial: 3, Multiple: 1, DecreaseFactor: 1, ProbeEvery: -5, ProbeFactor: -0.5},
			want: []string{
				"Minimum -1 must be at least 1",
				"Maximum -2 must be at least Minimum -1",
				"Initial 3 must lie between Minimum -1 and Maximum -2",
				"Multiple 1 must be a finite number above 1",
				"DecreaseFactor 1 must lie strictly between 0 and 1",
				"ProbeEvery -5 must be at least 0 (0: no probes)",
				"ProbeFactor -0.5 must lie strictly between 0 and 1",
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.opts.Validate()
			var oe *adaptive.OptionsError
			errors.As(err, &oe)
			if got := problems(oe); !slices.Equal(got, tt.want) || errors.Is(err, adaptive.ErrInvalidOptions) != (len(tt.want) > 0) {
				t.Errorf("Validate() = %v; want problems %q", err, tt.want)
			}
		})
	}
}

func TestSampleDoesNotAllocateWhileProbing(t *testing.T) {
	c, err := adaptive.New(&adaptive.Options{ProbeEvery: 1})
	if err != nil {
		t.Fatal(err)
	}
	now, probes := t0, 0
	allocs := testing.AllocsPerRun(100_000, func() {
		now = now.Add(time.Millisecond)
		c.Constrained()
		c.Sample(now, fast)
		if _, ok := c.Probing(); ok {
			probes++
		}
	})
	if allocs != 0 || probes == 0 {
		t.Fatalf("Sample allocates %v times per call over %d calls in probes; want 0 and some", allocs, probes)
	}
}

// TestConcurrentUseWithProbes is for the race detector, with probes on.
func TestConcurrentUseWithProbes(t *testing.T) {
	var mu sync.Mutex
	var moves int
	c, err := adaptive.New(&adaptive.Options{ProbeEvery: 2, OnChange: func(int, int) { mu.Lock(); moves++; mu.Unlock() }})
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
				_, _ = c.Probing()
			}
		})
	}
	wg.Wait()
	if l := c.Limit(); l < adaptive.DefaultMinimum || l > adaptive.DefaultMaximum || moves == 0 {
		t.Fatalf("limit %d after %d moves", l, moves)
	}
}

func BenchmarkSampleProbing(b *testing.B) {
	c, err := adaptive.New(&adaptive.Options{ProbeEvery: 10})
	if err != nil {
		b.Fatal(err)
	}
	latencies := lognormal(1024, 1)
	now := t0
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		now = now.Add(time.Microsecond)
		c.Constrained()
		c.Sample(now, latencies[i%len(latencies)])
	}
}
