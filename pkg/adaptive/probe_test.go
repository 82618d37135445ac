package adaptive_test

import (
	"errors"
	"math"
	"math/bits"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/egressd/egressd/pkg/adaptive"
)

// move is one OnChange call.
type move struct{ from, to int }

// probing is a Controller and what it did: every OnChange, and the instants
// probes began.
type probing struct {
	c      *adaptive.Controller
	moves  []move
	begins []time.Time
	now    time.Time
}

func newProbing(t *testing.T, opts adaptive.Options) *probing {
	t.Helper()
	p := &probing{now: w0}
	opts.OnChange = func(from, to int) {
		p.moves = append(p.moves, move{from, to})
		if _, ok := p.c.Probing(); ok && to < from && len(p.moves) > 0 {
			p.begins = append(p.begins, p.now)
		}
	}
	c, err := adaptive.New(&opts)
	if err != nil {
		t.Fatal(err)
	}
	p.c = c
	return p
}

// calls completes n calls at the current instant, each having taken
// latency, with refusals Constrained calls before each.
func (p *probing) calls(n int, latency time.Duration, refusals int) {
	for range n {
		for range refusals {
			p.c.Constrained()
		}
		p.c.Sample(p.now, latency)
	}
}

// run drives the controller as a busy caller does for d: calls of latency
// complete one after the other, one limit's worth per latency, each
// admitted when an earlier one completed, and every round is constrained.
func (p *probing) run(d, latency time.Duration) {
	for end := p.now.Add(d); p.now.Before(end); {
		p.now = p.now.Add(latency)
		p.calls(p.c.Limit(), latency, 1)
	}
}

// state returns Limit, Probing's restore (0 when not probing) and the
// baseline.
func (p *probing) state() (limit, restore int, baseline time.Duration) {
	restore, _ = p.c.Probing()
	baseline, _ = p.c.Baseline()
	return p.c.Limit(), restore, baseline
}

const ms = time.Millisecond

// w0 is the start of a probe window of every period up to 2^34 ns, so that
// the tables below know where windows fall.
var w0 = time.Unix(0, 1<<34*100)

// period is the one the package computes for ProbeEvery rounds of round:
// rounded up to a power of two.
func period(rounds int, round time.Duration) time.Duration {
	d := uint64(rounds) * uint64(round)
	return time.Duration(uint64(1) << bits.Len64(d-1))
}

func TestFirstProbe(t *testing.T) {
	p := newProbing(t, adaptive.Options{ProbeEvery: 10, ProbeSeed: 1})
	// 20 calls make the first round, and the window a baseline: 15ms. The
	// round grows the limit (fast, constrained) to 21, and the first probe
	// starts at once, at Minimum: no probe has confirmed the baseline.
	p.calls(20, 15*ms, 1)
	if l, r, b := p.state(); l != 4 || r != 21 || !near(b, 15*ms) || !slices.Equal(p.moves, []move{{20, 4}}) {
		t.Fatalf("after the first round: limit %d, restore %d, baseline %v, moves %v; want 4, 21, 15ms, [{20 4}]", l, r, b, p.moves)
	}
	// Calls admitted before the probe, at most the 20 that were in flight,
	// drain unmeasured.
	p.calls(20, 15*ms, 1)
	// It measures 200 calls admitted since it began, and holds on until
	// the window's last probes have begun: 2 × 15% of its period from its
	// start. Before any round was timed, a round counts as Multiple ×
	// baseline: 10 × 2 × 15ms = 300ms → 2^29ns ≈ 537ms, and ≈ 161ms.
	hold := time.Duration(0.3 * float64(period(10, 2*15*ms)))
	p.now = p.now.Add(12 * ms)
	p.calls(199, 12*ms, 1)
	p.now = p.now.Add(hold)
	p.calls(1, 12*ms, 1) // the 200th, admitted 12ms earlier: a batch, after the hold
	// A first probe is believed, whatever it measured: 12ms. No round
	// was judged on it: 21 is restored, not 22.
	if l, r, b := p.state(); l != 21 || r != 0 || !near(b, 12*ms) {
		t.Fatalf("after the first probe: limit %d, restore %d, baseline %v; want 21, 0, 12ms", l, r, b)
	}
	st := p.c.State()
	if st.Source != adaptive.FromProbes || st.Probes != 1 || !st.LastProbe.Equal(p.now) || st.Probing {
		t.Fatalf("state %+v; want baseline from probes, 1 probe ended now", st)
	}
}

func TestFirstProbeHoldsUntilTheWindowsLastProbe(t *testing.T) {
	p := newProbing(t, adaptive.Options{ProbeEvery: 10, ProbeSeed: 1})
	p.calls(20, 10*ms, 1)
	p.now = p.now.Add(10 * ms)
	// 200 calls, and 400 more, before the hold is over: still probing.
	p.calls(600, 10*ms, 0)
	if _, r, _ := p.state(); r != 21 {
		t.Fatalf("restore %d; want 21, still probing", r)
	}
	p.now = p.now.Add(time.Second)
	p.calls(199, 10*ms, 0)
	if _, r, _ := p.state(); r != 21 {
		t.Fatalf("restore %d; want 21: a batch of 200 ends it, not a call", r)
	}
	p.calls(1, 10*ms, 0)
	if _, r, _ := p.state(); r != 0 {
		t.Fatal("still probing after a whole batch past the hold")
	}
}

// Rounds before the first probe are the start's, slow while demand ramps
// up: they do not count toward the period, and so toward how long the first
// probe holds on (a slow one once held a probe at Minimum for 11s in
// TestScenarioTwoHosts).
func TestFirstProbeIgnoresTheStartsRounds(t *testing.T) {
	p := newProbing(t, adaptive.Options{Initial: 8, ProbeEvery: 10, ProbeSeed: 1})
	// Three rounds of 8 calls, 2s apart: the third has a baseline and
	// begins the probe.
	for range 3 {
		p.now = p.now.Add(2 * time.Second)
		p.calls(8, 10*ms, 1)
	}
	if _, r, _ := p.state(); r == 0 {
		t.Fatal("no first probe after three rounds")
	}
	p.calls(8, 10*ms, 0) // admitted before it: drain
	// A round counts as Multiple × baseline, as if none was timed: the
	// probe holds 0.3 × 2^28ns ≈ 81ms, not 0.3 × 2^35ns ≈ 10s.
	hold := time.Duration(0.3 * float64(period(10, 2*10*ms)))
	p.now = p.now.Add(hold)
	p.calls(200, 10*ms, 0)
	if _, r, _ := p.state(); r != 0 {
		t.Fatalf("still probing %v after the first probe began (restore %d); want it over after its batch", hold, r)
	}
}

// confirmed returns a controller past its first probe, with a baseline of
// 10ms from probes, at the limit limit, not probing, at the start of a
// window.
func confirmed(t *testing.T, opts adaptive.Options) *probing {
	t.Helper()
	p := newProbing(t, opts)
	p.calls(20, 10*ms, 1)
	p.now = p.now.Add(10 * ms)
	p.calls(200, 10*ms, 0)
	p.now = p.now.Add(time.Second)
	p.calls(200, 10*ms, 0)
	if st := p.c.State(); st.Probing || st.Source != adaptive.FromProbes || !near(st.Baseline, 10*ms) {
		t.Fatalf("setup: state %+v", st)
	}
	p.moves, p.begins = nil, nil
	return p
}

// untilProbe runs rounds of latency until a probe begins, and fails if
// none does within d.
func (p *probing) untilProbe(t *testing.T, latency, d time.Duration) {
	t.Helper()
	for end := p.now.Add(d); p.now.Before(end); {
		p.now = p.now.Add(latency)
		for range p.c.Limit() {
			p.c.Constrained()
			p.c.Sample(p.now, latency)
			if _, ok := p.c.Probing(); ok {
				return
			}
		}
	}
	t.Fatalf("no probe in %v", d)
}

// batchesUntilEnd completes batches of a probe, every call of latency,
// until it ends, and fails if it does not within 100.
func (p *probing) batchesUntilEnd(t *testing.T, latency time.Duration) {
	t.Helper()
	for range 100 {
		p.now = p.now.Add(latency)
		p.calls(max(p.c.Limit(), 20), latency, 0)
		if _, ok := p.c.Probing(); !ok {
			return
		}
	}
	t.Fatal("still probing after 100 batches")
}

func TestProbe(t *testing.T) {
	tests := []struct {
		name string
		// After a probe began at ⌈limit/2⌉, batches complete, each of
		// calls of the latencies given (one latency per batch, every call
		// of a batch the same; fastest is the batch's fastest, if lower).
		batches []time.Duration
		fastest time.Duration
		// Want: the limit restored, the baseline after, OnChange calls
		// from the probe's start.
		restored int
		baseline time.Duration
		moves    func(start, settled int) []move
	}{{
		name:     "a batch as fast as the baseline ends it, and joins the baseline",
		batches:  []time.Duration{10 * ms},
		baseline: 10 * ms,
	}, {
		name:     "a batch within drainedWithin (1.2×) ends it; beyond acceptWithin (1.1×) it does not join the baseline",
		batches:  []time.Duration{11500 * time.Microsecond},
		baseline: 10 * ms,
	}, {
		name:     "a batch within acceptWithin joins the baseline, which moves a twentieth of the way",
		batches:  []time.Duration{10500 * time.Microsecond},
		baseline: 10 * ms, // the pool's 10th percentile: the old calls still outweigh
	}, {
		name:    "while batches get faster, it measures again, and keeps its fastest",
		batches: []time.Duration{11500 * time.Microsecond, 10 * ms, 10 * ms},
		// The second (10ms) was 13% faster than the first: a third
		// batch, no faster, ends it. Its measurement is the fastest batch.
		baseline: 10 * ms,
	}, {
		name: "a queue at the probe's limit: the batch counts as a round with one, and the probe goes deeper",
		// 13ms is beyond 1.2 × 10ms, its fastest within 2 × 10ms: the
		// held limit decreases, the probe's limit halves again; then
		// drained batches, the second no faster than the first, end it,
		// restoring at most twice the limit it found drained at.
		batches:  []time.Duration{13 * ms, 10 * ms, 10 * ms},
		restored: -1,
		baseline: 10 * ms,
	}, {
		name: "a queue that even the fastest call waited for ends the probe: the limit is falling",
		// 25ms > 2 × 10ms: decreased, as a round would, and nothing
		// learned.
		batches:  []time.Duration{25 * ms},
		restored: -2,
		baseline: 10 * ms,
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := confirmed(t, adaptive.Options{ProbeEvery: 10, ProbeSeed: 3, Minimum: 1, Maximum: 64, Initial: 40})
			p.untilProbe(t, 10*ms, 10*time.Second)
			settled, _ := p.c.Probing()
			low := p.c.Limit()
			if low != (settled+1)/2 {
				t.Fatalf("probe at %d, settled %d; want ⌈%d/2⌉", low, settled, settled)
			}
			for _, latency := range tt.batches {
				p.now = p.now.Add(latency)
				p.calls(max(p.c.Limit(), 20), latency, 0)
			}
			want := settled
			switch tt.restored {
			case -1:
				// 0.9 × settled, capped at twice the deeper probe limit.
				deeper := (low + 1) / 2
				want = min(int(0.9*float64(settled)), 2*deeper)
			case -2:
				want = int(0.9 * float64(settled))
			}
			if l, r, b := p.state(); l != want || r != 0 || !near(b, tt.baseline) {
				t.Fatalf("after the probe: limit %d, restore %d, baseline %v; want %d, 0, %v (moves %v)", l, r, b, want, tt.baseline, p.moves)
			}
		})
	}
}

// Probes begin around the starts of windows, at the multiples of a power
// of two period (ProbeEvery rounds, as long as rounds take) since the Unix
// epoch, ± 15% of it at random, at least half a period apart; the draw is
// the seed's.
func TestProbeWindows(t *testing.T) {
	run := func(seed uint64) []time.Time {
		p := confirmed(t, adaptive.Options{ProbeEvery: 10, ProbeSeed: seed, Minimum: 1, Maximum: 64, Initial: 40})
		p.run(20*time.Second, 10*ms)
		return p.begins
	}
	per := period(10, 10*ms) // rounds of 10ms
	spread := time.Duration(0.15 * float64(per))
	begins := run(1)
	if len(begins) < 40 {
		t.Fatalf("%d probes in 20s of a %v period", len(begins), per)
	}
	var offsets []time.Duration
	for i, b := range begins {
		// The nearest multiple of the period since the Unix epoch.
		window := time.Unix(0, (b.UnixNano()+int64(per/2))/int64(per)*int64(per))
		off := b.Sub(window)
		offsets = append(offsets, off)
		// A probe begins at the end of a round, at most one round (10ms)
		// after its time.
		if off < -spread || off > spread+10*ms {
			t.Errorf("probe %d began %v from its window's start; want within ±%v", i, off, spread)
		}
		if i > 0 && b.Sub(begins[i-1]) < per/2 {
			t.Errorf("probes %d and %d %v apart; want at least %v", i-1, i, b.Sub(begins[i-1]), per/2)
		}
	}
	slices.Sort(offsets)
	if offsets[len(offsets)-1]-offsets[0] < spread {
		t.Errorf("offsets span only %v..%v: no jitter", offsets[0], offsets[len(offsets)-1])
	}
	if again := run(1); !slices.EqualFunc(begins, again, time.Time.Equal) {
		t.Error("the same seed drew other instants")
	}
	if other := run(2); slices.EqualFunc(begins, other, time.Time.Equal) {
		t.Error("seeds 1 and 2 drew the same instants")
	}
}

// A ProbeFactor near 0 probes at Minimum, and a probe that went deeper
// restores what the rounds left, since the limit that would have probed at
// Minimum (Minimum / ProbeFactor) is beyond it; that quotient once
// overflowed an int and restored Minimum.
func TestProbeWithATinyFactor(t *testing.T) {
	p := confirmed(t, adaptive.Options{ProbeEvery: 10, ProbeSeed: 3, ProbeFactor: 1e-300, Minimum: 1, Maximum: 64, Initial: 40})
	p.untilProbe(t, 10*ms, 10*time.Second)
	settled, _ := p.c.Probing()
	if l := p.c.Limit(); l != 1 {
		t.Fatalf("probe at %d; want Minimum, 1", l)
	}
	// A queue (13ms), and two drained batches: as TestProbe's "a queue at
	// the probe's limit".
	for _, latency := range []time.Duration{13 * ms, 10 * ms, 10 * ms} {
		p.now = p.now.Add(latency)
		p.calls(20, latency, 0)
	}
	if l, r, _ := p.state(); l != int(0.9*float64(settled)) || r != 0 {
		t.Fatalf("after the probe: limit %d, restore %d; want 0.9 × %d, not probing", l, r, settled)
	}
}

// ProbeEvery as large as an int goes (probes wanted rarely) caps the
// period at five minutes: a billion rounds of 10s once made it 0, and
// the division by it panicked in Sample.
func TestHugeProbeEvery(t *testing.T) {
	p := newProbing(t, adaptive.Options{ProbeEvery: 1_000_000_000, ProbeSeed: 1, Minimum: 1, Maximum: 64, Initial: 40})
	// The first probe, which holds 0.3 of the period.
	p.calls(40, 10*ms, 1)
	p.now = p.now.Add(90 * time.Second)
	p.calls(200, 10*ms, 0)
	if st := p.c.State(); st.Probing || st.Source != adaptive.FromProbes {
		t.Fatalf("setup: state %+v", st)
	}
	p.begins = nil
	// A quiet destination: a round every 10s, for an hour.
	for range 360 {
		p.now = p.now.Add(10 * time.Second)
		p.calls(p.c.Limit(), 10*ms, 1)
	}
	// Probes come in windows of five minutes, at least half one apart.
	if len(p.begins) < 6 {
		t.Fatalf("%d probes in an hour; want one every 2.5 to 7.5 minutes", len(p.begins))
	}
	for i := 1; i < len(p.begins); i++ {
		if d := p.begins[i].Sub(p.begins[i-1]); d < 150*time.Second || d > 450*time.Second+10*time.Second {
			t.Errorf("probes %d and %d began %v apart", i-1, i, d)
		}
	}
}

// A round that decreases the limit starts no probe, even one that is due.
func TestNoProbeAfterDecrease(t *testing.T) {
	p := confirmed(t, adaptive.Options{ProbeEvery: 10, ProbeSeed: 1, Minimum: 1, Maximum: 64, Initial: 40})
	// Every round shows a queue (25ms > 2 × 10ms) for longer than periods.
	p.run(3*period(10, 25*ms), 25*ms)
	if len(p.begins) != 0 {
		t.Fatalf("probes began at %v while every round decreased", p.begins)
	}
}

// After probeAge of probes that met a queue, with the limit at Minimum
// throughout, the dependency is believed slower: the baseline is the
// window's again, and the next probe is a first probe, at Minimum. A
// loaded machine looks the same, and is believed alike; once calls are
// fast again, nothing of it stays: probes bring the baseline back down.
func TestSlowerIsBelievedAfterFiveMinutesAtTheFloor(t *testing.T) {
	p := confirmed(t, adaptive.Options{ProbeEvery: 10, ProbeSeed: 1, Minimum: 2, Maximum: 64, Initial: 40})
	// 3× slower: rounds decrease to the floor, probes meet a queue.
	p.run(4*time.Minute, 30*ms)
	if st := p.c.State(); st.Source != adaptive.FromProbes || !near(st.Baseline, 10*ms) || st.Settled != 2 {
		t.Fatalf("after 4 minutes: %+v; want still judged by the probes' 10ms, at the floor", st)
	}
	p.run(2*time.Minute, 30*ms)
	st := p.c.State()
	if st.Source != adaptive.FromWindow && st.Source != adaptive.FromProbes || !near(st.Baseline, 30*ms) {
		t.Fatalf("after 6 minutes: %+v; want 30ms, believed", st)
	}
	// And the limit grows again.
	p.run(time.Second, 30*ms)
	if l := p.c.State().Settled; l <= 2 {
		t.Fatalf("settled at %d after believing; want growth", l)
	}
	p.run(time.Second, 10*ms)
	if st := p.c.State(); st.Source != adaptive.FromProbes || !near(st.Baseline, 10*ms) {
		t.Errorf("a fast second later: %+v; want 10ms again, from probes", st)
	}
}

// A dependency 1.6× slower for good, with no queue at any limit: rounds
// see none (16ms < 2 × 10ms) and every batch of a probe is beyond 1.2 ×
// 10ms. A probe whose limit was cut twice with the level no lower, after
// the window's last probes began, found it slower: it restores the limit
// it began from and its measurement is the baseline. Before, each batch
// decreased the limit it restores, the baseline stayed 10ms for good, and
// the limit sawtoothed below Maximum.
func TestModeratelySlowerIsBelievedByAProbe(t *testing.T) {
	p := confirmed(t, adaptive.Options{ProbeEvery: 10, ProbeSeed: 3, Minimum: 1, Maximum: 64, Initial: 40})
	p.untilProbe(t, 10*ms, 10*time.Second)
	settled, _ := p.c.Probing()
	p.batchesUntilEnd(t, 16*ms)
	if st := p.c.State(); st.Limit != settled || st.Source != adaptive.FromProbes || !near(st.Baseline, 16*ms) {
		t.Fatalf("after the probe: %+v; want %d restored, a baseline of 16ms from probes", st, settled)
	}
	// Rounds judged against it grow the limit to Maximum and keep it.
	p.run(time.Minute, 16*ms)
	if st := p.c.State(); st.Settled != 64 || !near(st.Baseline, 16*ms) {
		t.Fatalf("a minute later: %+v; want settled at 64, baseline 16ms", st)
	}
}

// A queue that other callers' probes drain only once the window's last
// probes have begun: batches flat at 13ms while the limit is cut twice
// and more, then 10ms. It is a queue, not a slower dependency: the limit
// restored is decreased, and the baseline stays 10ms.
func TestProbeWaitsForTheWindowsProbesToDrain(t *testing.T) {
	p := confirmed(t, adaptive.Options{ProbeEvery: 10, ProbeSeed: 1, Minimum: 1, Maximum: 64, Initial: 40})
	p.untilProbe(t, 10*ms, 10*time.Second)
	settled, _ := p.c.Probing()
	// The probe holds on while it meets a queue until 2 × 15% of the
	// period past the start of the window it began in.
	per := period(10, 10*ms)
	window := time.Unix(0, (p.now.UnixNano()+int64(per/2))/int64(per)*int64(per))
	wait := window.Add(time.Duration(0.3 * float64(per)))
	flat := 0
	for ; p.now.Add(13 * ms).Before(wait); flat++ {
		p.now = p.now.Add(13 * ms)
		p.calls(max(p.c.Limit(), 20), 13*ms, 0)
	}
	if flat < 3 {
		t.Fatalf("only %d batches before the wait; want 3, the limit cut twice", flat)
	}
	p.batchesUntilEnd(t, 10*ms)
	if st := p.c.State(); st.Limit >= settled || !near(st.Baseline, 10*ms) {
		t.Fatalf("after the probe: %+v; want below %d, the baseline still 10ms", st, settled)
	}
}

// After a quiet spell a probe starts at the next round: its time came
// meanwhile.
func TestProbeAfterQuietSpell(t *testing.T) {
	p := confirmed(t, adaptive.Options{ProbeEvery: 10, ProbeSeed: 1, Minimum: 1, Maximum: 64, Initial: 40})
	p.now = p.now.Add(5 * time.Minute)
	p.calls(p.c.Limit(), 10*ms, 1)
	if _, ok := p.c.Probing(); !ok {
		t.Fatal("no probe at the first round after five quiet minutes")
	}
}

// A probe that cannot tell its calls (now and latency from different
// clocks, so that every call seems admitted before its batch) gives up
// after twice the completions it should have needed.
func TestProbeGivesUpOnAWrongClock(t *testing.T) {
	p := confirmed(t, adaptive.Options{ProbeEvery: 10, ProbeSeed: 1, Minimum: 1, Maximum: 64, Initial: 40})
	p.untilProbe(t, 10*ms, 10*time.Second)
	settled, _ := p.c.Probing()
	need := max((settled+1)/2, 20)
	p.calls(2*(settled+need)-1, time.Hour, 0)
	if _, ok := p.c.Probing(); !ok {
		t.Fatal("gave up early")
	}
	p.calls(1, time.Hour, 0)
	if _, ok := p.c.Probing(); ok || p.c.Limit() != settled {
		t.Fatalf("limit %d, probing %t; want %d restored", p.c.Limit(), ok, settled)
	}
}

// NoProbes is the reference loop: never a probe, and the same limits
// whatever ProbeFactor says.
func TestNoProbes(t *testing.T) {
	plain, err := adaptive.New(&adaptive.Options{ProbeEvery: adaptive.NoProbes})
	if err != nil {
		t.Fatal(err)
	}
	off, err := adaptive.New(&adaptive.Options{ProbeEvery: adaptive.NoProbes, ProbeFactor: 0.25})
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
	if st := off.State(); st.Source != adaptive.FromWindow || st.Probes != 0 || !st.NextProbe.IsZero() {
		t.Fatalf("state %+v; want judged by the window, no probes", st)
	}
}

// By default there are probes.
func TestProbesByDefault(t *testing.T) {
	c, err := adaptive.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	for range adaptive.DefaultInitial {
		c.Constrained()
		c.Sample(t0, 10*ms)
	}
	if restore, ok := c.Probing(); !ok || restore != adaptive.DefaultInitial+1 || c.Limit() != adaptive.DefaultMinimum {
		t.Fatalf("limit %d, probing %d %t; want the first probe at Minimum", c.Limit(), restore, ok)
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
		{name: "a factor without probes is not checked", opts: adaptive.Options{ProbeEvery: adaptive.NoProbes, ProbeFactor: 7}},
		{name: "a fixed baseline turns probes off", opts: adaptive.Options{Baseline: time.Second, ProbeFactor: 7}},
		{name: "guards", opts: adaptive.Options{Baseline: time.Second, MaxHealthy: 2 * time.Second}},
		{
			name: "below NoProbes",
			opts: adaptive.Options{ProbeEvery: -2},
			want: []string{"ProbeEvery -2 must be at least 1, or NoProbes (-1) for none"},
		},
		{
			name: "factor of 1",
			opts: adaptive.Options{ProbeEvery: 10, ProbeFactor: 1},
			want: []string{"ProbeFactor 1 must lie strictly between 0 and 1"},
		},
		{
			name: "default probes, factor not a number",
			opts: adaptive.Options{ProbeFactor: math.NaN()},
			want: []string{"ProbeFactor NaN must lie strictly between 0 and 1"},
		},
		{
			name: "probes and a fixed baseline",
			opts: adaptive.Options{ProbeEvery: 10, Baseline: time.Second},
			want: []string{"ProbeEvery 10 with a fixed Baseline: probes learn a baseline, and this one is given"},
		},
		{
			name: "every problem at once",
			opts: adaptive.Options{Minimum: -1, Maximum: -2, Initial: 3, Multiple: 1, DecreaseFactor: 1, ProbeEvery: -5, ProbeFactor: -0.5, MaxHealthy: -1, Baseline: -1},
			want: []string{
				"Minimum -1 must be at least 1",
				"Maximum -2 must be at least Minimum -1",
				"Initial 3 must lie between Minimum -1 and Maximum -2",
				"Multiple 1 must be a finite number above 1",
				"DecreaseFactor 1 must lie strictly between 0 and 1",
				"ProbeEvery -5 must be at least 1, or NoProbes (-1) for none",
				"ProbeFactor -0.5 must lie strictly between 0 and 1",
				"MaxHealthy -1ns must not be negative (0: no such guard)",
				"Baseline -1ns must not be negative (0: measured)",
			},
		},
		{
			name: "a guard at the baseline",
			opts: adaptive.Options{Baseline: time.Second, MaxHealthy: time.Second},
			want: []string{"MaxHealthy 1s must be above Baseline 1s: every normal call would decrease the limit"},
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
				_ = c.State()
			}
		})
	}
	wg.Wait()
	if l := c.Limit(); l < adaptive.DefaultMinimum || l > adaptive.DefaultMaximum || moves == 0 {
		t.Fatalf("limit %d after %d moves", l, moves)
	}
}

// The names are the control API's baselineSource, which the CLI reads:
// they must not change.
func TestSourceNames(t *testing.T) {
	tests := []struct {
		s    adaptive.Source
		want string
	}{
		{adaptive.NoSource, "none"},
		{adaptive.FromWindow, "window"},
		{adaptive.FromProbes, "probes"},
		{adaptive.Fixed, "fixed"},
		{adaptive.Fixed + 1, "Source(4)"},
	}
	for _, tt := range tests {
		if got := tt.s.String(); got != tt.want {
			t.Errorf("Source(%d).String() = %q, want %q", tt.s, got, tt.want)
		}
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
