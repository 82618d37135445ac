package main

import (
	"bytes"
	"image/png"
	"math"
	"slices"
	"strings"
	"testing"
	"time"
)

// shortConfig is DefaultConfig with phases short enough for a unit test.
func shortConfig(seed uint64) Config {
	cfg := DefaultConfig
	cfg.Seed = seed
	cfg.Servers = []int{20}
	cfg.Phase = 5 * time.Second
	return cfg
}

// The same seed gives the same table, byte for byte: every random draw is
// seeded (the probes' jitter too), time is virtual, and failsafe-go's wall
// clock is a synctest bubble's.
func TestDeterministic(t *testing.T) {
	cfg := shortConfig(7)
	s1, m1 := Run(t, cfg)
	s2, m2 := Run(t, cfg)
	if a, b := Table(cfg, s1, m1), Table(cfg, s2, m2); a != b {
		t.Fatalf("same seed, different tables:\n%s\n---\n%s", a, b)
	}
	for i, g := range append(groups(s1), groups(m1)...) {
		again := append(groups(s2), groups(m2)...)[i]
		first, second := PlotPNG(g), PlotPNG(again)
		if !bytes.Equal(first, second) {
			t.Errorf("%s: same seed, different plots", g[0].Scenario.Name)
		}
		img, err := png.Decode(bytes.NewReader(first))
		if err != nil || img.Bounds().Dx() != plotWidth {
			t.Errorf("%s: plot does not decode as a PNG %d wide: %v", g[0].Scenario.Name, plotWidth, err)
		}
	}
	other := shortConfig(8)
	s3, m3 := Run(t, other)
	if Table(cfg, s1, m1) == Table(other, s3, m3) {
		t.Error("seeds 7 and 8 gave the same table: the seed does not reach the model")
	}
}

// With exactly c closed-loop clients and no limit, every server is busy all
// the time, so the model completes c / mean service time calls a second in
// each phase: c servers, then c/2 (the other clients queue), then c again.
// With the clients split between hosts, the same.
func TestThroughputAtFixedConcurrency(t *testing.T) {
	for _, hosts := range []int{1, 4} {
		sc := &Scenario{
			Name: "fixed", Servers: 40, Mean: 10 * time.Millisecond, Sigma: 0.5, QueuePer: 10, Hosts: hosts,
			Clients: 40 / hosts, Backoff: 10 * time.Millisecond, Phase: 20 * time.Second, Seed: 3,
		}
		tr := Simulate(sc, func(int) Controller { return noLimit{} })
		for phase, servers := range []int{40, 20, 40} {
			want := float64(servers) / sc.Mean.Seconds()
			got := float64(tr.Completed[phase]) / sc.Phase.Seconds()
			if math.Abs(got-want)/want > 0.02 {
				t.Errorf("%d hosts, phase %d: %.0f calls/s, want %.0f (c=%d / %v) within 2%%", hosts, phase, got, want, servers, sc.Mean)
			}
		}
		if tr.Refused != 0 || tr.Failed != 0 {
			t.Errorf("%d hosts: refused %d, failed %d; want none", hosts, tr.Refused, tr.Failed)
		}
	}
}

// The service time is lognormal with the configured mean.
func TestServiceTimeMean(t *testing.T) {
	sc := &Scenario{Mean: 10 * time.Millisecond, Sigma: 0.5}
	s := &sim{sc: sc, mu: math.Log(float64(sc.Mean)) - sc.Sigma*sc.Sigma/2}
	r := newStream(1, 0, 0)
	const n = 200000
	var sum float64
	for range n {
		sum += float64(s.service(r))
	}
	if mean := time.Duration(sum / n); math.Abs(float64(mean-sc.Mean))/float64(sc.Mean) > 0.01 {
		t.Errorf("mean service %v, want %v within 1%%", mean, sc.Mean)
	}
}

// follow and weighted read a limit trace as the table's definitions say:
// the settled limit, not a probe's, weighted by time; a probe that holds
// the limit low until it settles low is when the limit followed.
func TestFollowAndWeighted(t *testing.T) {
	sc := &Scenario{Servers: 40, Phase: 10 * time.Second}
	s := time.Second
	st := &Steps{
		Points: []point{
			{0, 20, 0, 20},
			{2 * s, 60, 10, 60},
			{5 * s, 30, 20, 60},   // a probe: 30 in force, settled on 60
			{6 * s, 60, 22, 60},   // the probe ends
			{8 * s, 80, 30, 80},   // 80 for the last 2 s of the phase
			{10 * s, 80, 40, 80},  // the drop: c/2 = 20, top 44
			{11 * s, 50, 50, 50},  // still above
			{13 * s, 40, 58, 40},  // followed: 18 rounds, 3 s after the drop
			{20 * s, 40, 100, 40}, // recovery
		},
		PhaseAt: [3]int{0, 5, 8},
	}
	if got, want := follow(sc, st), (Transit{OK: true, Rounds: 18, After: 3 * s}); got != want {
		t.Errorf("follow %+v, want %+v", got, want)
	}
	settled := func(pt point) int { return pt.settled }
	inForce := func(pt point) int { return pt.limit }
	// Second half of phase 0, [5s, 10s): settled 60 for 3 s, 80 for 2 s.
	if got, want := weighted(st, 5*s, 10*s, settled, 0, 0.5, 0.59, 0.61, 0.95), []float64{60, 60, 60, 80, 80}; !slices.Equal(got, want) {
		t.Errorf("weighted settled %v, want %v", got, want)
	}
	// In force, the probe's 30 is the least, for 1 s of 5.
	if got, want := weighted(st, 5*s, 10*s, inForce, 0, 0.19, 0.21), []float64{30, 30, 60}; !slices.Equal(got, want) {
		t.Errorf("weighted in force %v, want %v", got, want)
	}
	// A probe from 11 s holds 30 in force and restores 40: the limit came
	// down at its start. One at 50 in force does not count.
	st.Points[6] = point{11 * s, 30, 50, 50}
	if got, want := follow(sc, st), (Transit{OK: true, Rounds: 10, After: s}); got != want {
		t.Errorf("follow through a probe %+v, want %+v", got, want)
	}
	st.Points[6].limit = 50
	if got, want := follow(sc, st), (Transit{OK: true, Rounds: 18, After: 3 * s}); got != want {
		t.Errorf("follow after a probe above the bound %+v, want %+v", got, want)
	}
	st.Points[7].settled = 45 // never at most 44 before the recovery
	if got := follow(sc, st); got.OK {
		t.Errorf("follow %+v, want never", got)
	}
}

// Jain's index is 1 for equal shares and 1/n when one host has them all.
func TestJain(t *testing.T) {
	eq := []HostTrace{{Steady: [3]int{5}}, {Steady: [3]int{5}}, {Steady: [3]int{5}}, {Steady: [3]int{5}}}
	one := []HostTrace{{Steady: [3]int{8}}, {}, {}, {}}
	if got := jain(eq, 0); got != 1 {
		t.Errorf("equal shares: %v, want 1", got)
	}
	if got := jain(one, 0); got != 0.25 {
		t.Errorf("one host: %v, want 0.25", got)
	}
}

// A missed comparison with a peer names the bound rows that miss it too,
// and the verdict counts the misses a bound row shares.
func TestVerdictNamesBoundsThatMissToo(t *testing.T) {
	sc := &Scenario{Name: "closed c=20", Servers: 20, Phase: time.Minute}
	row := func(name string, kind Kind, goodput float64, p99ms int) *Result {
		return &Result{Scenario: sc, Controller: name, Kind: kind, Goodput: goodput, P99: time.Duration(p99ms) * time.Millisecond,
			Median: [3]float64{30, 15, 30}, P95: [3]float64{34, 18, 34}, Follow: Transit{OK: true, Rounds: 3},
			Trace: &Trace{Limit: Steps{Points: []point{{limit: 20}}}}}
	}
	group := []*Result{
		row("egressd", Egressd, 0.99, 34),
		row("gradient2", Peer, 0.995, 28),
		row("diag: pinned", Diagnostic, 1.0, 34),
		row("ref: oracle", Reference, 1.0, 28),
	}
	group[2].Goodput, group[3].Goodput = 0.99, 0.99
	for _, open := range []bool{false, true} {
		sc.Open = open
		want := []string{
			"MISSED (2 of 2 by a bound row too)",
			"p99 34.0ms not below gradient2's 28.0ms; missed by diag: pinned and ref: oracle too\n",
			"goodput 99.0% not above gradient2's 99.5%; missed by diag: pinned and ref: oracle too\n",
		}
		if open { // the oracle's goodput bounds nothing in an open loop
			want[2] = "goodput 99.0% not above gradient2's 99.5%; missed by diag: pinned too\n"
		}
		got := verdict(group[0], group)
		for _, w := range want {
			if !strings.Contains(got+"\n", w) {
				t.Errorf("open %v: verdict lacks %q:\n%s", open, w, got)
			}
		}
	}
	group[2].Goodput, group[3].Goodput = 1, 1
	if got := verdict(group[0], group); !strings.Contains(got+"\n", "MISSED (1 of 2 by a bound row too)") ||
		!strings.Contains(got+"\n", "goodput 99.0% not above gradient2's 99.5%\n") {
		t.Errorf("a miss no bound row shares is named alone:\n%s", got)
	}
}
