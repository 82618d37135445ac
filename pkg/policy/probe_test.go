package policy

import (
	"strings"
	"testing"
	"time"

	"github.com/egressd/egressd/pkg/adaptive"
)

// TestAdaptiveFields: probeEvery 0 is the reference loop (adaptive's
// NoProbes), and is written back as 0; the guards are durations; every
// field round-trips through Format.
func TestAdaptiveFields(t *testing.T) {
	tests := []struct {
		yaml string
		want Adaptive
	}{
		{"{}", Adaptive{}},
		{"{probeEvery: 0}", Adaptive{ProbeEvery: adaptive.NoProbes}},
		{"{probeEvery: 50, probeFactor: 0.4}", Adaptive{ProbeEvery: 50, ProbeFactor: 0.4}},
		{"{maxHealthy: 250ms}", Adaptive{MaxHealthy: 250 * time.Millisecond}},
		{"{baseline: 5ms, samples: connect}", Adaptive{Baseline: 5 * time.Millisecond, Samples: SamplesConnect}},
	}
	for _, tt := range tests {
		t.Run(tt.yaml, func(t *testing.T) {
			p, err := Parse([]byte("rules:\n  - name: a\n    destination: 10.0.0.1\n    adaptive: " + tt.yaml + "\n"))
			if err != nil {
				t.Fatal(err)
			}
			if got := p.Rules[0].Limit.(Adaptive); got != tt.want {
				t.Fatalf("parsed %+v; want %+v", got, tt.want)
			}
			text, err := Format(p)
			if err != nil {
				t.Fatal(err)
			}
			if back, err := Parse(text); err != nil || back.Rules[0] != p.Rules[0] {
				t.Fatalf("round trip: %v\n%s", err, text)
			}
		})
	}
	bad := map[string]string{
		"adaptive: {probeEvery: -1}":                     "adaptive.probeEvery -1 must be at least 0 (0: no probes, the reference loop)",
		"adaptive: {probeEvery: 10, probeFactor: 1.5}":   "adaptive: ProbeFactor 1.5 must lie strictly between 0 and 1",
		"adaptive: {maxHealthy: 0s}":                     "adaptive.maxHealthy 0 is not allowed; leave it out for none",
		"adaptive: {baseline: -5ms}":                     "adaptive.baseline -5ms must be positive",
		"adaptive: {baseline: 5ms, probeEvery: 10}":      "adaptive: ProbeEvery 10 with a fixed Baseline: probes learn a baseline, and this one is given",
		"adaptive: {baseline: 5ms, maxHealthy: 5ms}":     "adaptive: MaxHealthy 5ms must be above Baseline 5ms: every normal call would decrease the limit",
		"adaptive: {maxHealthy: fast}":                   "adaptive.maxHealthy must be a duration such as 30s or 1m",
		"adaptive: {probeEvery: 0, probeFactor: 7}":      "",
		"adaptive: {baseline: 5ms, probeEvery: 0}":       "",
		"adaptive: {samples: connect, maxHealthy: 90ms}": "",
	}
	for b, want := range bad {
		_, err := Parse([]byte("rules:\n  - name: a\n    destination: 10.0.0.1\n    " + b + "\n"))
		switch {
		case want == "" && err != nil:
			t.Errorf("%s: %v; want accepted", b, err)
		case want != "" && (err == nil || !strings.Contains(err.Error(), want)):
			t.Errorf("%s: %v; want %q", b, err, want)
		}
	}
}
