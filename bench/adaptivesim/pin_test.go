package main

import (
	"fmt"
	"testing"
	"time"
)

// TestFairnessNeedsAgreeingBaselines backs pkg/adaptive's probeMemory and
// firstEstimate: ten hosts running the round rule on the true no-queue
// baseline share the dependency fairly; their shares stay fair while their
// baselines agree within a few percent, and do not when they are ±20%
// apart. The spread is laid evenly over the hosts, from −spread to +spread.
func TestFairnessNeedsAgreeingBaselines(t *testing.T) {
	cfg := DefaultConfig
	sc := cfg.ManyScenarios()[1] // closed loop: every host can take more than its share
	jainAt := func(spread float64) float64 {
		tr := Simulate(sc, func(h int) Controller {
			p := newPinned(sc).(*pinnedRule)
			p.baseline = time.Duration(float64(p.baseline) * (1 + spread*(2*float64(h)/float64(sc.hosts()-1)-1)))
			return p
		})
		r := analyse(sc, spec{name: fmt.Sprintf("pinned ±%.0f%%", 100*spread)}, tr)
		t.Logf("baselines ±%.0f%%: Jain's index %.3f/%.3f/%.3f", 100*spread, r.Jain[0], r.Jain[1], r.Jain[2])
		return min(r.Jain[0], r.Jain[2])
	}
	if j := jainAt(0); j < 0.98 {
		t.Errorf("equal baselines: Jain's index %.3f; want at least 0.98", j)
	}
	if j := jainAt(0.03); j < 0.9 {
		t.Errorf("baselines ±3%%: Jain's index %.3f; want at least 0.9", j)
	}
	if j := jainAt(0.1); j >= 0.9 {
		t.Errorf("baselines ±10%%: Jain's index %.3f; want below 0.9", j)
	}
	if j := jainAt(0.2); j >= 0.9 {
		t.Errorf("baselines ±20%%: Jain's index %.3f; want below 0.9: the test no longer shows why baselines must agree", j)
	}
}
