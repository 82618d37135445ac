package main

import (
	"slices"
	"strings"
	"testing"
)

// The frontier's fixed limits queue more as k grows, so their p99 does not
// fall; a k meets every target only if it beats the peers' best p99 and
// goodput; and the printout names the sets as ranges.
func TestFrontier(t *testing.T) {
	cfg := shortConfig(7)
	single, _ := Run(t, cfg)
	frontier := Frontier(single)
	if len(frontier) != 2 {
		t.Fatalf("%d scenarios in the frontier, want open and closed c=20", len(frontier))
	}
	for _, f := range frontier {
		for i := 1; i < len(f.Rows); i++ {
			if f.Rows[i].P99 < f.Rows[i-1].P99 {
				t.Errorf("%s: p99 %v at %s below %v at %s: a fixed limit's queue grows with k", f.Scenario.Name,
					f.Rows[i].P99, f.Rows[i].Controller, f.Rows[i-1].P99, f.Rows[i-1].Controller)
			}
		}
		if f.Rows[0].P99 != group(single, f.Scenario, oracle).P99 {
			t.Errorf("%s: k = 1 is the oracle, yet p99 %v, the oracle's %v", f.Scenario.Name, f.Rows[0].P99, group(single, f.Scenario, oracle).P99)
		}
		for _, k := range f.Met {
			if !slices.Contains(f.BelowP99, k) || !slices.Contains(f.AboveGoodput, k) {
				t.Errorf("%s: k %.1f meets every target without beating the peers' best p99 (%v) and goodput (%v)", f.Scenario.Name, k, f.BelowP99, f.AboveGoodput)
			}
		}
	}
	if got := ks([]float64{1.0, 1.1, 1.2, 1.5, 2.0, 2.1}); got != "1.0–1.2, 1.5, 2.0–2.1" {
		t.Errorf("ks: %q", got)
	}
	var b strings.Builder
	WriteFrontier(&b, frontier)
	if !strings.Contains(b.String(), "every target met in every scenario at k: ") {
		t.Errorf("frontier printout lacks its conclusion:\n%s", b.String())
	}
}

func group(results []*Result, sc *Scenario, controller string) *Result {
	for _, r := range results {
		if r.Scenario == sc && r.Controller == controller {
			return r
		}
	}
	return nil
}
