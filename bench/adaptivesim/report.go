package main

import (
	"fmt"
	"io"
	"math"
	"strings"
	"testing"
	"testing/synctest"
	"text/tabwriter"
	"time"

	"github.com/egressd/egressd/pkg/adaptive"
)

// Kind says what a row of the table is for.
type Kind int

const (
	Peer       Kind = iota // a peer egressd is judged against
	Diagnostic             // a variant of egressd's rule that explains its rows
	Reference              // a bound to read the others against
	Egressd                // pkg/adaptive itself, judged against the targets
)

// spec is one controller in the comparison.
type spec struct {
	name   string
	desc   string // for the plot
	kind   Kind
	bubble bool // reads the wall clock, so runs inside a synctest bubble
	make   func(sc *Scenario) Controller
}

func specs(cfg Config) []spec {
	return []spec{
		{name: "egressd", desc: "pkg/adaptive, defaults", kind: Egressd, make: func(*Scenario) Controller { return newEgressd(nil) }},
		{name: "egressd probe", desc: fmt.Sprintf("pkg/adaptive, opt-in ProbeEvery %d, ProbeFactor 0.5 (default); the dips are probes", cfg.ProbeEvery), kind: Egressd, make: func(*Scenario) Controller {
			return newEgressd(&adaptive.Options{ProbeEvery: cfg.ProbeEvery})
		}},
		{name: "failsafe-go", desc: "adaptivelimiter, defaults", bubble: true, make: func(*Scenario) Controller { return newFailsafe() }},
		{name: "gradient2", desc: "updated on every sample", make: func(*Scenario) Controller { return newGradient2(0) }},
		{name: "gradient2/1s", desc: "updated on 1 s windows", make: func(*Scenario) Controller { return newGradient2(time.Second) }},
		{name: "diag: pinned", desc: "egressd's rule, true no-queue baseline; not a peer", kind: Diagnostic, make: newPinned},
		{name: "ref: oracle", kind: Reference, make: func(sc *Scenario) Controller { return &oracleController{sc: sc} }},
		{name: "ref: no limit", kind: Reference, make: func(*Scenario) Controller { return noLimit{} }},
	}
}

// Config is what the command line can change.
type Config struct {
	Seed    uint64
	Servers int
	Mean    time.Duration
	Sigma   float64
	Load    float64
	Clients int // closed loop; 0 means 3 × Servers
	Phase   time.Duration

	// ProbeEvery is the "egressd probe" row's Options.ProbeEvery.
	ProbeEvery int
}

// DefaultConfig is the run the README's table comes from.
var DefaultConfig = Config{
	Seed:    1,
	Servers: 40,
	Mean:    10 * time.Millisecond,
	Sigma:   0.5,
	Load:    1.5,
	Phase:   60 * time.Second,
	// See README.md for why 100.
	ProbeEvery: 100,
}

// Scenarios returns the open-loop and the closed-loop scenario of cfg.
func (cfg Config) Scenarios() []*Scenario {
	clients := cfg.Clients
	if clients == 0 {
		clients = 3 * cfg.Servers
	}
	base := Scenario{
		Servers:  cfg.Servers,
		Mean:     cfg.Mean,
		Sigma:    cfg.Sigma,
		QueuePer: 10,
		Phase:    cfg.Phase,
		Seed:     cfg.Seed,
	}
	open, closed := base, base
	open.Name, open.Open, open.Load = "open", true, cfg.Load
	closed.Name, closed.Clients, closed.Backoff = "closed", clients, cfg.Mean
	return []*Scenario{&open, &closed}
}

// Result is one row of the table.
type Result struct {
	Scenario   *Scenario
	Controller string
	Desc       string
	Kind       Kind

	Goodput      float64    // completed calls / what the capacity could complete, over the run
	PhaseGoodput [3]float64 // the same per phase
	P50, P99     time.Duration
	PhaseP99     [3]time.Duration

	Settle, Follow, Recover Transit
	Steady                  [3][2]int // min and max settled limit over the second half of each phase
	SteadyInForce           [3][2]int // the same for the limit in force, probes included

	Refused, Failed int
	Trace           *Trace
}

// Transit is how long a limit took to enter the target band for the
// current capacity and stay there until the phase ended.
type Transit struct {
	OK     bool
	Rounds float64
	After  time.Duration
}

func (t Transit) String() string {
	if !t.OK {
		return "never"
	}
	return fmt.Sprintf("%.0f r / %.2fs", t.Rounds, t.After.Seconds())
}

// band is the target range of limits for c servers: from 0.8c (the ±20%
// tolerance under the least limit that keeps every server busy) to 2.2c (the
// bound issue 4's end-to-end test sets, where queueing adds about 1.2 mean
// service times to every call).
func band(c int) (lo, hi float64) { return 0.8 * float64(c), 2.2 * float64(c) }

// Run simulates every controller on every scenario of cfg. t hosts the
// synctest bubbles of the controllers that read the wall clock.
func Run(t *testing.T, cfg Config) []*Result {
	var out []*Result
	for _, sc := range cfg.Scenarios() {
		for _, sp := range specs(cfg) {
			var tr *Trace
			if sp.bubble {
				synctest.Test(t, func(*testing.T) { tr = Simulate(sc, sp.make(sc)) })
			} else {
				tr = Simulate(sc, sp.make(sc))
			}
			out = append(out, analyse(sc, sp, tr))
		}
	}
	return out
}

func analyse(sc *Scenario, sp spec, tr *Trace) *Result {
	r := &Result{Scenario: sc, Controller: sp.name, Desc: sp.desc, Kind: sp.kind, Trace: tr, Refused: tr.Refused, Failed: tr.Failed}
	var done, possible float64
	for p := range 3 {
		c := sc.serversAt(time.Duration(p) * sc.Phase)
		could := sc.capacity(c) * sc.Phase.Seconds()
		r.PhaseGoodput[p] = float64(tr.Completed[p]) / could
		done += float64(tr.Completed[p])
		possible += could
		end := len(tr.Latencies)
		if p < 2 {
			end = tr.LatAt[p+1]
		}
		r.PhaseP99[p] = percentile(sortedCopy(tr.Latencies[tr.LatAt[p]:end]), 0.99)
	}
	r.Goodput = done / possible
	all := sortedCopy(tr.Latencies)
	r.P50, r.P99 = percentile(all, 0.5), percentile(all, 0.99)
	if tr.Limit[0].limit != unlimited {
		r.Settle, r.Follow, r.Recover = transit(sc, tr, 0), transit(sc, tr, 1), transit(sc, tr, 2)
		for p := range 3 {
			r.Steady[p] = steady(sc, tr, p)
			r.SteadyInForce[p] = steadyOf(sc, tr, p, func(pt point) int { return pt.limit })
		}
	}
	return r
}

// phasePoints returns the limit points of phase p: the first is the limit
// in force when the phase began, the last holds until it ends.
func phasePoints(tr *Trace, p int) []point {
	end := len(tr.Limit)
	if p < 2 {
		end = tr.PhaseAt[p+1]
	}
	return tr.Limit[tr.PhaseAt[p]:end]
}

// transit measures phase p from its start to the change that brought the
// limit into band for the phase's capacity for the last time; never if the
// phase ends out of band.
func transit(sc *Scenario, tr *Trace, p int) Transit {
	lo, hi := band(sc.serversAt(time.Duration(p) * sc.Phase))
	pts := phasePoints(tr, p)
	last := -1 // the last point out of band
	for i, pt := range pts {
		if l := float64(pt.settled); l < lo || l > hi {
			last = i
		}
	}
	switch last {
	case len(pts) - 1:
		return Transit{}
	case -1:
		return Transit{OK: true}
	}
	in := pts[last+1]
	return Transit{OK: true, Rounds: in.rounds - pts[0].rounds, After: in.t - pts[0].t}
}

// steady returns the least and greatest settled limit during the second
// half of phase p: the limit in force, but for a probe's.
func steady(sc *Scenario, tr *Trace, p int) [2]int {
	return steadyOf(sc, tr, p, func(pt point) int { return pt.settled })
}

// steadyOf returns the least and greatest of limit over the points in force
// during the second half of phase p.
func steadyOf(sc *Scenario, tr *Trace, p int, limit func(point) int) [2]int {
	mid := time.Duration(p)*sc.Phase + sc.Phase/2
	pts := phasePoints(tr, p)
	lo, hi := math.MaxInt, math.MinInt
	for i, pt := range pts {
		if i+1 < len(pts) && pts[i+1].t <= mid {
			continue // replaced before the second half began
		}
		lo, hi = min(lo, limit(pt)), max(hi, limit(pt))
	}
	return [2]int{lo, hi}
}

// WriteTable prints the comparison, the definitions it rests on, and the
// verdicts on egressd's targets.
func WriteTable(w io.Writer, cfg Config, results []*Result) {
	sc := results[0].Scenario
	fmt.Fprintf(w, "Dependency: c=%d servers (c/2 from %v to %v), lognormal service mean %v σ=%.2g, FIFO queue %d×c; seed %d; %v per phase.\n",
		sc.Servers, sc.Phase, 2*sc.Phase, sc.Mean, sc.Sigma, sc.QueuePer, cfg.Seed, sc.Phase)
	fmt.Fprintf(w, "open: Poisson arrivals at %.2g× full capacity (%.0f/s), refused arrivals lost. closed: %d clients back to back, %v mean backoff after a refusal.\n\n",
		sc.Load, sc.Load*sc.capacity(sc.Servers), results[len(results)-1].Scenario.Clients, results[len(results)-1].Scenario.Backoff)

	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "scenario\tcontroller\tgoodput\tfull/half/full\tp50\tp99\tp99 half\tsettle\tfollow drop\trecover\tlimit full\tlimit half\t")
	for _, r := range results {
		fmt.Fprintf(tw, "%s\t%s\t%.1f%%\t%.0f/%.0f/%.0f%%\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t\n",
			r.Scenario.Name, r.Controller, 100*r.Goodput,
			100*r.PhaseGoodput[0], 100*r.PhaseGoodput[1], 100*r.PhaseGoodput[2],
			ms(r.P50), ms(r.P99), ms(r.PhaseP99[1]),
			dash(r, r.Settle), dash(r, r.Follow), dash(r, r.Recover),
			limitRange(r, 0), limitRange(r, 1))
	}
	tw.Flush()

	lo, hi := band(sc.Servers)
	lo2, hi2 := band(sc.Servers / 2)
	fmt.Fprintf(w, `
goodput: calls completed / calls the capacity could complete (c or c/2 servers × time / mean service), whole run, then per phase
  (a phase can pass 100%%: calls in service when c drops to c/2 finish in the drop phase, and service times are random).
p50, p99: latency of completed calls (queue wait + service, what the caller holding the permit measures), whole run; p99 half: drop phase only.
round: one limit's worth of completed calls, for every controller (a completion counts 1/limit in force); "r / s" gives rounds and seconds.
band: limit in [0.8c, 2.2c] for the capacity in force: [%.0f, %.0f] at c=%d, [%.0f, %.0f] at c/2=%d. 0.8c is 20%% under the least limit that
  keeps every server busy; 2.2c is issue 4's end-to-end bound, where queueing adds about 1.2 mean service times.
settle / follow drop / recover: from the start / the drop / the recovery to the change that brought the limit into band for the
  last time in that phase (it then stays in band until the phase ends); never = out of band when the phase ended.
limit full / half: least-greatest settled limit over the second half of the first (c) and the drop (c/2) phase. The settled limit is
  the limit in force except during an egressd probe, which holds the limit in force at half of it on purpose; band, settle, follow
  and recover read the settled limit too. The verdicts give the limit in force, probes included, as well.
egressd probe: pkg/adaptive with the opt-in drain probes (Options.ProbeEvery); egressd is the specified loop, every default.
diag: pinned is not a peer: pkg/adaptive's round rule re-implemented with its defaults, judged against the true no-queue 10th
  percentile of service time, a baseline that cannot learn our own queue. It shows what the rule does when the baseline is right.
ref rows are bounds, not peers: oracle holds the limit at exactly the servers in force; no limit shows the dependency's own queue.
`, lo, hi, sc.Servers, lo2, hi2, sc.Servers/2)

	fmt.Fprintln(w, "\nTargets (issue 4), for each egressd row, and the end-to-end test's steady band [c, 2.2c]:")
	for _, v := range Verdicts(results) {
		fmt.Fprintln(w, "  "+v)
	}
}

// Verdicts judges each egressd row against issue 4's three targets, and its
// steady limit against the end-to-end test's [c, 2.2c], per scenario. Peers
// are the rows of Kind Peer: an egressd row is not the other's peer.
func Verdicts(results []*Result) []string {
	var out []string
	for i := 0; i < len(results); {
		j := i
		for j < len(results) && results[j].Scenario == results[i].Scenario {
			j++
		}
		group := results[i:j]
		i = j
		for _, e := range group {
			if e.Kind == Egressd {
				out = append(out, verdicts(e, group)...)
			}
		}
	}
	return out
}

func verdicts(e *Result, group []*Result) []string {
	name := e.Scenario.Name + ", " + e.Controller
	out := []string{
		fmt.Sprintf("%s: goodput ≥ 95%% of capacity: %s (%.1f%%; phases %.1f/%.1f/%.1f%%)",
			name, met(e.Goodput >= 0.95), 100*e.Goodput, 100*e.PhaseGoodput[0], 100*e.PhaseGoodput[1], 100*e.PhaseGoodput[2]),
		fmt.Sprintf("%s: follows the drop within 10 rounds: %s (%s)",
			name, met(e.Follow.OK && e.Follow.Rounds <= 10), e.Follow),
	}

	// Equal goodput: a peer within one percentage point of egressd's, or
	// above it. A peer that buys its p99 with lost calls is not compared.
	var best, closest *Result
	for _, r := range group {
		if r.Kind != Peer {
			continue
		}
		if closest == nil || r.Goodput > closest.Goodput {
			closest = r
		}
		if r.Goodput < e.Goodput-0.01 {
			continue
		}
		if best == nil || r.P99 < best.P99 {
			best = r
		}
	}
	if best == nil {
		out = append(out, fmt.Sprintf("%s: p99 no worse than the best peer at equal goodput: met only vacuously: no peer comes within 1 point\n"+
			"    of its %.1f%% goodput; the closest, %s at %.1f%%, has p99 %s against its %s",
			name, 100*e.Goodput, closest.Controller, 100*closest.Goodput, ms(closest.P99), ms(e.P99)))
	} else {
		out = append(out, fmt.Sprintf("%s: p99 no worse than the best peer at equal goodput: %s (%s at %.1f%%; best peer %s %s at %.1f%%)",
			name, met(e.P99 <= best.P99), ms(e.P99), 100*e.Goodput, best.Controller, ms(best.P99), 100*best.Goodput))
	}

	// The end-to-end test's band, on the steady ranges of the table.
	c := e.Scenario.Servers
	in := func(r [2]int, c int) bool { return r[0] >= c && float64(r[1]) <= 2.2*float64(c) }
	ok := in(e.Steady[0], c) && in(e.Steady[1], c/2)
	line := fmt.Sprintf("%s: steady limit within [c, 2.2c]: %s (%s at c=%d, %s at c/2=%d",
		name, met(ok), span(e.Steady[0]), c, span(e.Steady[1]), c/2)
	if e.SteadyInForce != e.Steady {
		line += fmt.Sprintf("; in force, probes included: %s and %s", span(e.SteadyInForce[0]), span(e.SteadyInForce[1]))
	}
	return append(out, line+")")
}

func met(ok bool) string {
	if ok {
		return "MET"
	}
	return "MISSED"
}

func ms(d time.Duration) string {
	return fmt.Sprintf("%.1fms", float64(d)/float64(time.Millisecond))
}

func dash(r *Result, t Transit) string {
	if r.Trace.Limit[0].limit == unlimited {
		return "-"
	}
	return t.String()
}

func limitRange(r *Result, p int) string {
	if r.Trace.Limit[0].limit == unlimited {
		return "-"
	}
	return span(r.Steady[p])
}

func span(s [2]int) string {
	if s[0] == s[1] {
		return fmt.Sprint(s[0])
	}
	return fmt.Sprintf("%d-%d", s[0], s[1])
}

// Table is WriteTable into a string.
func Table(cfg Config, results []*Result) string {
	var b strings.Builder
	WriteTable(&b, cfg, results)
	return b.String()
}
