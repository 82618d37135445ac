package policy

import (
	"maps"
	"reflect"
	"slices"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/egressd/egressd/internal/docstest"
	"github.com/egressd/egressd/pkg/adaptive"
	"github.com/egressd/egressd/pkg/kernelrule"
)

func TestFormat(t *testing.T) {
	p, err := Parse([]byte(example))
	if err != nil {
		t.Fatal(err)
	}
	got, err := Format(p)
	if err != nil {
		t.Fatal(err)
	}
	// The example as written, less its comment, and with the window
	// spelt as Go spells durations.
	const want = `rules:
  - name: payments
    destination: 10.20.0.0/16
    port: 443
    unit: payments.service
    concurrency: 50
  - name: email
    destination: smtp.example.com
    port: 25
    perSecond: {permits: 10, burst: 20}
  - name: search
    destination: 127.0.0.1
    port: 9200
    perWindow: {permits: 1000, window: 1m0s, segments: 8}
  - name: api
    destination: 2001:db8::/32
    adaptive: {minimum: 4, maximum: 200}
    shadow: true
`
	if string(got) != want {
		t.Errorf("Format\n got:\n%s\nwant:\n%s", got, want)
	}
}

// everyField is a valid policy that sets every field and shape.
func everyField(t *testing.T) []Rule {
	return []Rule{
		{Name: "a", Destination: mustDest(t, "10.0.0.0/8"), Port: 1, Scope: Scope{Unit: "a@1.service"}, Limit: Concurrency(1), Shadow: true, Errno: "EAGAIN"},
		{Name: "b", Destination: mustDest(t, "db.internal."), Scope: Scope{Cgroup: "/x.slice/y"}, Limit: PerSecond{Permits: 3, Burst: 4}, Protocols: kernelrule.ProtoTCP | kernelrule.ProtoUDP, UDPIdle: 45 * time.Second},
		{Name: "i", Destination: mustDest(t, "10.9.0.4"), Port: 443, Limit: Concurrency(7), Protocols: kernelrule.ProtoUDP},
		{Name: "c", Destination: mustDest(t, "::1"), Limit: PerWindow{Permits: 9, Window: 1500 * time.Microsecond, Segments: 1}},
		{Name: "d", Destination: mustDest(t, "::ffff:10.1.2.3"), Limit: Adaptive{Minimum: 1, Maximum: 3, Initial: 2, Multiple: 1.0000001, DecreaseFactor: 1e-9, ProbeEvery: 50, ProbeFactor: 0.4, MaxHealthy: 300 * time.Millisecond, Samples: SamplesRequest}},
		{Name: "e", Destination: mustDest(t, "0.0.0.0/0"), Limit: Adaptive{Multiple: 2, ProbeEvery: adaptive.NoProbes, Samples: SamplesConnect}},
		{Name: "h", Destination: mustDest(t, "10.9.0.3"), Limit: Adaptive{Baseline: 4 * time.Millisecond, MaxHealthy: 40 * time.Millisecond}},
		{Name: "f", Destination: mustDest(t, "10.9.0.1"), Limit: PerWindow{Permits: 9, Window: time.Second}, Shared: Shared{Redis: "redis://r:6379", Key: "k:{f}", FailureMode: FailureAllow}},
		{Name: "g", Destination: mustDest(t, "10.9.0.2"), Limit: Concurrency(5), Shared: Shared{Redis: "redis+sentinel://s:26379?master_name=m", Key: "g",
			Durability: DurabilityPersistent, Lease: 45 * time.Second, Replicas: 2}},
	}
}

// TestDocsNameEveryField: docs/policy.md mentions every field a policy
// can have, as Format writes them.
func TestDocsNameEveryField(t *testing.T) {
	data, err := Format(&Policy{Rules: everyField(t), MaxRules: 10_000, MetricsRules: []string{"a"}})
	if err != nil {
		t.Fatal(err)
	}
	var doc yaml.Node
	if err := yaml.Unmarshal(data, &doc); err != nil {
		t.Fatal(err)
	}
	keys := map[string]bool{}
	var walk func(n *yaml.Node)
	walk = func(n *yaml.Node) {
		for i, c := range n.Content {
			if n.Kind == yaml.MappingNode && i%2 == 0 {
				keys[c.Value] = true
			}
			walk(c)
		}
	}
	walk(&doc)
	if len(keys) < 25 {
		t.Fatalf("only %d fields found in\n%s", len(keys), data)
	}
	docstest.Mentions(t, "../../docs/policy.md", slices.Sorted(maps.Keys(keys))...)
}

func TestFormatRoundTrip(t *testing.T) {
	tests := []struct {
		name     string
		rules    []Rule
		maxRules int
		metrics  []string
	}{
		{name: "empty"},
		{name: "every shape and field", rules: everyField(t)},
		{name: "maxRules", rules: everyField(t), maxRules: 100},
		{name: "metrics.rules", rules: everyField(t), metrics: []string{"a", "pay-*", "[bc]?", "*"}},
		{
			// Strings YAML would read as something else unless quoted.
			name: "strings that look like other things",
			rules: []Rule{
				{Name: "123", Destination: mustDest(t, "10.0.0.1"), Limit: Concurrency(1)},
				{Name: "true", Destination: mustDest(t, "10.0.0.2"), Limit: Concurrency(1)},
				{Name: "null", Destination: mustDest(t, "10.0.0.3"), Limit: Concurrency(1)},
				{Name: "-x:y&z*!|>'\"%@`", Destination: mustDest(t, "10.0.0.4"), Limit: Concurrency(1)},
				{Name: "ünïcødé", Destination: mustDest(t, "10.0.0.5"), Limit: Concurrency(1)},
				{Name: "f", Destination: mustDest(t, "10.0.0.6"), Scope: Scope{Cgroup: "/a: b/#c/ d"}, Limit: Concurrency(1)},
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := &Policy{Rules: tt.rules, MaxRules: tt.maxRules, MetricsRules: tt.metrics}
			if err := p.Validate(); err != nil {
				t.Fatalf("test policy is invalid: %v", err)
			}
			data, err := Format(p)
			if err != nil {
				t.Fatal(err)
			}
			got, err := Parse(data)
			if err != nil {
				t.Fatalf("Parse(Format(p)): %v\n%s", err, data)
			}
			if !reflect.DeepEqual(got, p) {
				t.Errorf("Parse(Format(p))\n got %+v\nwant %+v\n%s", got, p, data)
			}
		})
	}
}
