package policy

import "testing"

func TestAdaptiveProbes(t *testing.T) {
	p, err := Parse([]byte("rules:\n  - name: a\n    destination: 10.0.0.1\n    adaptive: {probeEvery: 100, probeFactor: 0.4}\n"))
	if err != nil {
		t.Fatal(err)
	}
	a := p.Rules[0].Limit.(Adaptive)
	if o := a.Options(); o.ProbeEvery != 100 || o.ProbeFactor != 0.4 {
		t.Fatalf("options %+v", o)
	}
	text, err := Format(p)
	if err != nil {
		t.Fatal(err)
	}
	if back, err := Parse(text); err != nil || back.Rules[0] != p.Rules[0] {
		t.Fatalf("round trip: %v\n%s", err, text)
	}
	bad := []string{
		"adaptive: {probeEvery: 0}", // leave it out for the default (off)
		"adaptive: {probeEvery: 10, probeFactor: 1.5}",
	}
	for _, b := range bad {
		if _, err := Parse([]byte("rules:\n  - name: a\n    destination: 10.0.0.1\n    " + b + "\n")); err == nil {
			t.Errorf("%s: accepted", b)
		}
	}
}
