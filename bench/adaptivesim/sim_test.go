package main

import (
	"bytes"
	"math"
	"testing"
	"time"
)

// shortConfig is DefaultConfig with phases short enough for a unit test.
func shortConfig(seed uint64) Config {
	cfg := DefaultConfig
	cfg.Seed = seed
	cfg.Phase = 5 * time.Second
	return cfg
}

// The same seed gives the same table and the same plots, byte for byte:
// every random draw is seeded, time is virtual, and failsafe-go's wall clock
// is a synctest bubble's.
func TestDeterministic(t *testing.T) {
	cfg := shortConfig(7)
	first, second := Run(t, cfg), Run(t, cfg)
	if a, b := Table(cfg, first), Table(cfg, second); a != b {
		t.Fatalf("same seed, different tables:\n%s\n---\n%s", a, b)
	}
	for _, sc := range cfg.Scenarios() {
		if !bytes.Equal(PlotSVG(sc, first), PlotSVG(sc, second)) {
			t.Errorf("%s: same seed, different plots", sc.Name)
		}
	}

	other := shortConfig(8)
	if Table(cfg, first) == Table(other, Run(t, other)) {
		t.Error("seeds 7 and 8 gave the same table: the seed does not reach the model")
	}
}

// With exactly c closed-loop clients and no limit, every server is busy all
// the time, so the model completes c / mean service time calls a second in
// each phase: c servers, then c/2 (the other clients queue), then c again.
func TestThroughputAtFixedConcurrency(t *testing.T) {
	sc := &Scenario{
		Name: "fixed", Servers: 40, Mean: 10 * time.Millisecond, Sigma: 0.5, QueuePer: 10,
		Clients: 40, Backoff: 10 * time.Millisecond, Phase: 20 * time.Second, Seed: 3,
	}
	tr := Simulate(sc, noLimit{})
	tests := []struct {
		phase   int
		servers int
	}{
		{0, 40},
		{1, 20},
		{2, 40},
	}
	for _, tt := range tests {
		want := float64(tt.servers) / sc.Mean.Seconds()
		got := float64(tr.Completed[tt.phase]) / sc.Phase.Seconds()
		if math.Abs(got-want)/want > 0.02 {
			t.Errorf("phase %d: %.0f calls/s, want %.0f (c=%d / %v) within 2%%", tt.phase, got, want, tt.servers, sc.Mean)
		}
	}
	if tr.Refused != 0 || tr.Failed != 0 {
		t.Errorf("refused %d, failed %d; want none", tr.Refused, tr.Failed)
	}
}

// The service time is lognormal with the configured mean.
func TestServiceTimeMean(t *testing.T) {
	sc := &Scenario{Mean: 10 * time.Millisecond, Sigma: 0.5, Open: true, Load: 1, Servers: 1, Seed: 1}
	s := &sim{sc: sc, mu: math.Log(float64(sc.Mean)) - sc.Sigma*sc.Sigma/2}
	s.arrivals = newStream(sc.Seed, 0)
	const n = 200000
	var sum float64
	for range n {
		sum += float64(s.service(s.arrivals))
	}
	if mean := time.Duration(sum / n); math.Abs(float64(mean-sc.Mean))/float64(sc.Mean) > 0.01 {
		t.Errorf("mean service %v, want %v within 1%%", mean, sc.Mean)
	}
}

// transit and steady read the limit trace as the table's definitions say:
// the settled limit, not a probe's.
func TestTransitAndSteady(t *testing.T) {
	sc := &Scenario{Servers: 40, Phase: 10 * time.Second}
	s := time.Second
	tr := &Trace{
		Limit: []point{
			{0, 20, 0, 20},        // below the band [32, 88]
			{2 * s, 40, 10, 40},   // in
			{3 * s, 100, 12, 100}, // out again
			{4 * s, 80, 15, 80},   // in for good: settles after 15 rounds, 4s
			{5 * s, 40, 20, 80},   // a probe: 40 in force, settled on 80, which is what counts
			{6 * s, 80, 22, 80},   // the probe ends
			{7 * s, 70, 30, 70},   // steady range from 5s: 80 then 70
			{10 * s, 70, 40, 70},  // drop to c/2: band [16, 44]; out
			{19 * s, 30, 90, 30},  // in at last: follows after 50 rounds, 9s
			{20 * s, 40, 100, 40}, // recovery: in band at once
		},
		PhaseAt: [3]int{0, 7, 9},
	}
	tests := []struct {
		phase   int
		want    Transit
		steady  [2]int
		inForce [2]int
	}{
		// The probe at 5s leaves the band in force but not settled.
		{0, Transit{OK: true, Rounds: 15, After: 4 * s}, [2]int{70, 80}, [2]int{40, 80}},
		{1, Transit{OK: true, Rounds: 50, After: 9 * s}, [2]int{30, 70}, [2]int{30, 70}},
		{2, Transit{OK: true}, [2]int{40, 40}, [2]int{40, 40}},
	}
	for _, tt := range tests {
		if got := transit(sc, tr, tt.phase); got != tt.want {
			t.Errorf("phase %d: transit %+v, want %+v", tt.phase, got, tt.want)
		}
		if got := steady(sc, tr, tt.phase); got != tt.steady {
			t.Errorf("phase %d: steady %v, want %v", tt.phase, got, tt.steady)
		}
		if got := steadyOf(sc, tr, tt.phase, func(pt point) int { return pt.limit }); got != tt.inForce {
			t.Errorf("phase %d: steady in force %v, want %v", tt.phase, got, tt.inForce)
		}
	}

	tr.Limit = append(tr.Limit, point{25 * s, 100, 120, 100}) // ends out of band
	if got := transit(sc, tr, 2); got.OK {
		t.Errorf("phase ending out of band: %+v, want never", got)
	}
}
