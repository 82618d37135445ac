package sdk

import (
	"context"
	"strings"
	"testing"
)

func TestStopReasonNamesCoverEveryReason(t *testing.T) {
	if len(stopReasonNames) != int(stopReasonLen) {
		t.Fatalf("len(stopReasonNames) = %d, want %d", len(stopReasonNames), stopReasonLen)
	}
	seen := map[string]bool{}
	for r := StopReason(0); r < stopReasonLen; r++ {
		name := r.String()
		if name == "" || strings.HasPrefix(name, "StopReason(") || seen[name] {
			t.Errorf("StopReason(%d) has name %q: empty, missing or shared", r, name)
		}
		seen[name] = true
	}
	if got := stopReasonLen.String(); !strings.HasPrefix(got, "StopReason(") {
		t.Errorf("out-of-range reason prints %q", got)
	}
}

func TestBreakerStateNamesCoverEveryState(t *testing.T) {
	if len(breakerStateNames) != int(breakerStateLen) {
		t.Fatalf("len(breakerStateNames) = %d, want %d", len(breakerStateNames), breakerStateLen)
	}
	for s := BreakerState(0); s < breakerStateLen; s++ {
		if name := s.String(); name == "" || strings.HasPrefix(name, "BreakerState(") {
			t.Errorf("BreakerState(%d) has no name", s)
		}
	}
}

func TestCriticality(t *testing.T) {
	if got := CriticalityFrom(context.Background()); got != Critical {
		t.Errorf("CriticalityFrom(Background) = %v, want Critical", got)
	}
	var zero Criticality
	if zero != Critical {
		t.Errorf("zero Criticality = %v, want Critical", zero)
	}
	for _, c := range []Criticality{Sheddable, SheddablePlus, Critical, CriticalPlus} {
		if got := CriticalityFrom(WithCriticality(context.Background(), c)); got != c {
			t.Errorf("round trip of %v = %v", c, got)
		}
		if strings.HasPrefix(c.String(), "Criticality(") {
			t.Errorf("%d has no name", c)
		}
	}
	if !(Sheddable < SheddablePlus && SheddablePlus < Critical && Critical < CriticalPlus) {
		t.Error("criticality levels are out of order")
	}
}
