package daemon

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/egressd/egressd/pkg/loader"
)

// seen is a rule as one read finds it: in the table with its class (and
// its shared budget's Redis out of reach or not), and in the kernel with
// its counts unless pending.
type seen struct {
	name        string
	class       class
	unreachable bool
	pending     bool
	admitted    uint64
	refused     uint64
	live        int64
}

// read runs one read of the tracker at now over rules, in their order.
func read(t *tracker, now time.Time, rules ...seen) {
	t.begin(now, len(rules))
	for i, r := range rules {
		t.classify(i, r.name, r.class, !r.pending, r.unreachable)
	}
	k := 0
	for _, r := range rules {
		if !r.pending {
			t.count(k, r.name, &loader.Stats{Admitted: r.admitted, Refused: r.refused, Live: r.live})
			k++
		}
	}
	t.end()
}

var (
	t0          = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	hostConc    = makeClass(0, 0, false, false)
	hostRate    = makeClass(2, 0, false, false)
	unitShadow  = makeClass(0, 1, false, true)
	sharedGroup = makeClass(3, 2, true, false)
)

// TestClassSums: the classes' sums count what their rules admitted and
// refused since the first read, and never go back while rules come, go,
// change class, are made again or wait in the table out of the kernel.
func TestClassSums(t *testing.T) {
	type sums struct{ admitted, refused uint64 }
	steps := []struct {
		what  string
		rules []seen
		want  map[class]sums
	}{
		{"first read: counts from here", []seen{
			{name: "a", class: hostConc, admitted: 100, refused: 7},
			{name: "b", class: hostConc, admitted: 50},
			{name: "c", class: hostRate, admitted: 9},
		}, map[class]sums{hostConc: {0, 0}, hostRate: {0, 0}}},
		{"counts grow", []seen{
			{name: "a", class: hostConc, admitted: 110, refused: 8},
			{name: "b", class: hostConc, admitted: 55},
			{name: "c", class: hostRate, admitted: 10},
		}, map[class]sums{hostConc: {15, 1}, hostRate: {1, 0}}},
		{"b removed: what it counted stays", []seen{
			{name: "a", class: hostConc, admitted: 111, refused: 8},
			{name: "c", class: hostRate, admitted: 10},
		}, map[class]sums{hostConc: {16, 1}, hostRate: {1, 0}}},
		{"d made since: all its counts are new", []seen{
			{name: "a", class: hostConc, admitted: 111, refused: 8},
			{name: "c", class: hostRate, admitted: 10},
			{name: "d", class: unitShadow, admitted: 4, refused: 2},
		}, map[class]sums{hostConc: {16, 1}, hostRate: {1, 0}, unitShadow: {4, 2}}},
		{"a becomes a rate: it takes only what comes after", []seen{
			{name: "a", class: hostRate, admitted: 120, refused: 8},
			{name: "c", class: hostRate, admitted: 10},
			{name: "d", class: unitShadow, admitted: 4, refused: 2},
		}, map[class]sums{hostRate: {10, 0}, unitShadow: {4, 2}}},
		{"a's class has no rule now, and still its counts", []seen{
			{name: "c", class: hostRate, admitted: 10},
			{name: "d", class: unitShadow, admitted: 4, refused: 2},
			{name: "a", class: hostRate, admitted: 121, refused: 8},
		}, map[class]sums{hostRate: {11, 0}, unitShadow: {4, 2}}},
		{"d made again: its counter goes back, the sum does not", []seen{
			{name: "a", class: hostRate, admitted: 121, refused: 8},
			{name: "c", class: hostRate, admitted: 10},
			{name: "d", class: unitShadow, admitted: 1},
		}, map[class]sums{hostRate: {11, 0}, unitShadow: {5, 2}}},
		{"c pending: out of the kernel, its counts stay", []seen{
			{name: "a", class: hostRate, admitted: 121, refused: 8},
			{name: "c", class: hostRate, pending: true},
			{name: "d", class: unitShadow, admitted: 1},
		}, map[class]sums{hostRate: {11, 0}, unitShadow: {5, 2}}},
		{"c installed again, its counter from 0", []seen{
			{name: "a", class: hostRate, admitted: 121, refused: 8},
			{name: "c", class: hostRate, admitted: 3},
			{name: "d", class: unitShadow, admitted: 1},
		}, map[class]sums{hostRate: {14, 0}, unitShadow: {5, 2}}},
	}
	tr := newTracker()
	prev := map[class]sums{}
	for i, s := range steps {
		read(tr, t0.Add(time.Duration(i)*time.Second), s.rules...)
		got := map[class]sums{}
		for c := range classes {
			if tot := tr.totals[c]; tot.installed+tot.pending > 0 {
				got[class(c)] = sums{tot.counts[countAdmitted], tot.counts[countRefused]}
			}
		}
		if fmt.Sprint(got) != fmt.Sprint(s.want) {
			t.Errorf("%s: sums %v, want %v", s.what, got, s.want)
		}
		for c, p := range prev {
			if g := tr.totals[c].counts; g[countAdmitted] < p.admitted || g[countRefused] < p.refused {
				t.Errorf("%s: class %d went back from %v to %d admitted, %d refused", s.what, c, p, g[countAdmitted], g[countRefused])
			}
		}
		for c := range classes {
			prev[class(c)] = sums{tr.totals[c].counts[countAdmitted], tr.totals[c].counts[countRefused]}
		}
	}
}

// TestClassTotalsGauges: live connections, rules by state, rules that
// drift and shared rules out of reach are the class's as this read found
// them.
func TestClassTotalsGauges(t *testing.T) {
	tr := newTracker()
	read(tr, t0,
		seen{name: "a", class: hostConc, live: 3},
		seen{name: "b", class: hostConc, live: 4},
		seen{name: "c", class: hostConc, pending: true},
		seen{name: "d", class: sharedGroup, live: 1},
	)
	tr.recorded(map[string]loader.Recount{"a": {Live: 5, Counted: 3}, "d": {Freed: 2, Remarked: 1}})
	read(tr, t0.Add(time.Second),
		seen{name: "a", class: hostConc, live: 3},
		seen{name: "b", class: hostConc, live: 4},
		seen{name: "c", class: hostConc, pending: true},
		seen{name: "d", class: sharedGroup, live: 1, unreachable: true},
	)
	want := map[class]classTotals{
		hostConc:    {live: 7, installed: 2, pending: 1, drifting: 1},
		sharedGroup: {live: 1, installed: 1, unreachable: 1, counts: counters{countReleasedFreed: 2, countRemarked: 1}},
	}
	for c, w := range want {
		if got := tr.totals[c]; got != w {
			t.Errorf("class %s %s: %+v, want %+v", c.shape(), c.scope(), got, w)
		}
	}
}

// TestRecountBeforeRead: what a recount finds of a rule no read has found
// yet is the rule's when a read finds it in the table, and let go when it
// does not.
func TestRecountBeforeRead(t *testing.T) {
	tr := newTracker()
	tr.recorded(map[string]loader.Recount{"a": {GivenBack: 2}, "gone": {GivenBack: 5}})
	read(tr, t0, seen{name: "a", class: hostConc, admitted: 10})
	if got := tr.totals[hostConc].counts[countReleasedDrift]; got != 2 {
		t.Errorf("released by drift %d, want the recount's 2", got)
	}
	if _, ok := tr.rules["gone"]; ok {
		t.Error("a rule the table does not have is still tracked")
	}
}

// TestClassNumbers: every class has a number of its own that gives its
// labels back.
func TestClassNumbers(t *testing.T) {
	seenNumbers := map[class]string{}
	for shape := range classShapes {
		for scope := range classScopes {
			for _, shared := range []bool{false, true} {
				for _, shadow := range []bool{false, true} {
					c := makeClass(shape, scope, shared, shadow)
					want := fmt.Sprint(classShapes[shape], classScopes[scope], shared, shadow)
					if got := fmt.Sprint(c.shape(), c.scope(), c.shared(), c.shadow()); got != want || int(c) >= classes {
						t.Errorf("class %d: %s, want %s", c, got, want)
					}
					if other, ok := seenNumbers[c]; ok {
						t.Errorf("%s and %s are both class %d", other, want, c)
					}
					seenNumbers[c] = want
				}
			}
		}
	}
}

// TestRefusingAtAnyPace: the average of a rule's refusals a second comes
// to about the rate it refuses at, whether reads come every second or
// every 30 s, and a rule that stops refusing falls back within a few
// busyWindows.
func TestRefusingAtAnyPace(t *testing.T) {
	const rate = 20.0 // refusals a second
	for _, every := range []time.Duration{time.Second, 15 * time.Second, 30 * time.Second} {
		tr := newTracker()
		var refused uint64
		now := t0
		for now.Sub(t0) < 5*busyWindow {
			read(tr, now, seen{name: "a", class: hostConc, refused: refused})
			now = now.Add(every)
			refused += uint64(rate * every.Seconds())
		}
		if got := tr.rules["a"].refusing; math.Abs(got-rate) > rate/20 {
			t.Errorf("reads every %v: %.2f refusals a second, want about %.0f", every, got, rate)
		}
		for end := now.Add(5 * busyWindow); now.Before(end); now = now.Add(every) {
			read(tr, now, seen{name: "a", class: hostConc, refused: refused})
		}
		if got := tr.rules["a"].refusing; got > rate/50 {
			t.Errorf("reads every %v: %.2f refusals a second five windows after the last, want about 0", every, got)
		}
	}
}

// TestChoose: which rules get series of their own, and why.
func TestChoose(t *testing.T) {
	idle := func(names ...string) []candidate {
		var out []candidate
		for _, n := range names {
			out = append(out, candidate{name: n})
		}
		return out
	}
	tests := []struct {
		name  string
		cands []candidate
		max   int
		want  string
		why   [whyLen]int
	}{
		{"no more than the bound: all", idle("c", "a", "b"), 3, "a b c", [whyLen]int{whyAll: 3}},
		{"none allowed", idle("a", "b"), 0, "", [whyLen]int{}},
		{"idle rules: by name", idle("d", "c", "b", "a"), 2, "a b", [whyLen]int{whyBusiest: 2}},
		{"named first, then trouble, then busiest", []candidate{
			{name: "a", refusing: 100},
			{name: "b", live: 50},
			{name: "z", named: true},
			{name: "y", trouble: true},
			{name: "c"},
		}, 3, "a y z", [whyLen]int{whyNamed: 1, whyTrouble: 1, whyBusiest: 1}},
		{"refusals before live connections", []candidate{
			{name: "a", live: 1000},
			{name: "b", refusing: 0.1},
			{name: "c"},
		}, 1, "b", [whyLen]int{whyBusiest: 1}},
		{"live connections break a tie of refusals", []candidate{
			{name: "a", live: 1},
			{name: "b", live: 9},
			{name: "c"},
		}, 1, "b", [whyLen]int{whyBusiest: 1}},
		{"one chosen last time keeps its place against less than twice as busy", []candidate{
			{name: "a", refusing: 3, chosen: true},
			{name: "b", refusing: 5},
			{name: "c"},
		}, 1, "a", [whyLen]int{whyBusiest: 1}},
		{"and loses it to more than twice as busy", []candidate{
			{name: "a", refusing: 3, chosen: true},
			{name: "b", refusing: 7},
			{name: "c"},
		}, 1, "b", [whyLen]int{whyBusiest: 1}},
		{"idle: the ones chosen last time stay", []candidate{
			{name: "a"},
			{name: "z", chosen: true},
			{name: "c"},
		}, 1, "z", [whyLen]int{whyBusiest: 1}},
		{"more named than the bound: the busiest of them", []candidate{
			{name: "a", named: true},
			{name: "b", named: true, live: 2},
			{name: "c", named: true, refusing: 1},
			{name: "d", refusing: 50},
		}, 2, "b c", [whyLen]int{whyNamed: 2}},
	}
	for _, tt := range tests {
		names, why := choose(slices.Values(tt.cands), len(tt.cands), tt.max)
		if got := strings.Join(names, " "); got != tt.want || why != tt.why {
			t.Errorf("%s: chose %q %v, want %q %v", tt.name, got, why, tt.want, tt.why)
		}
	}
}

// TestBest: best keeps the k best of any order, best first, as a sort of
// them all would.
func TestBest(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for _, tt := range []struct{ n, k int }{{0, 3}, {5, 0}, {5, 10}, {100, 1}, {1000, 17}, {1000, 1000}} {
		values := make([]int, tt.n)
		for i := range values {
			values[i] = r.IntN(50) // ties too
		}
		want := slices.Sorted(slices.Values(values))[:min(tt.k, tt.n)]
		got := best(slices.Values(values), tt.k, func(a, b int) bool { return a < b })
		if !slices.Equal(got, want) && !(len(got) == 0 && len(want) == 0) {
			t.Errorf("best %d of %d: %v, want %v", tt.k, tt.n, got, want)
		}
	}
}

// TestNamedPatterns: rules the policy names by name or pattern are named
// from the read after the patterns change.
func TestNamedPatterns(t *testing.T) {
	tr := newTracker()
	rules := []seen{{name: "pay-eu"}, {name: "pay-us"}, {name: "db"}, {name: "web"}}
	tests := []struct {
		patterns []string
		want     string
	}{
		{nil, ""},
		{[]string{"pay-*"}, "pay-eu pay-us"},
		{[]string{"db", "w?b"}, "db web"},
		{[]string{"[dp]*"}, "db pay-eu pay-us"},
	}
	for i, tt := range tests {
		tr.name(tt.patterns)
		read(tr, t0.Add(time.Duration(i)*time.Second), rules...)
		var named []string
		for _, r := range rules {
			if tr.rules[r.name].named {
				named = append(named, r.name)
			}
		}
		slices.Sort(named)
		if got := strings.Join(named, " "); got != tt.want || tr.named != len(named) {
			t.Errorf("%q: named %q (%d counted), want %q", tt.patterns, got, tr.named, tt.want)
		}
	}
}
