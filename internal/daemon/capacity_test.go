package daemon

import (
	"fmt"
	"strings"
	"testing"

	"github.com/egressd/egressd/pkg/loader"
	"github.com/egressd/egressd/pkg/policy"
)

func TestRuleSlots(t *testing.T) {
	tests := []struct {
		name     string
		flag     int
		policy   int
		rules    int
		want     int
		explicit bool
	}{
		{"the flag wins", 100, 200, 50, 100, true},
		{"then the policy", 0, 200, 50, 200, true},
		{"a small policy", 0, 0, 10, loader.DefaultMaxRules, false},
		{"a quarter more, in steps of 4096", 0, 0, 5000, 8192, false},
		{"100,000 rules", 0, 0, 100_000, 126976, false},
		{"up to the most a datapath holds", 0, 0, loader.MaxRules, loader.MaxRules, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := Config{MaxRules: tt.flag}
			n, explicit := c.ruleSlots(&policy.Policy{MaxRules: tt.policy}, tt.rules)
			if n != tt.want || explicit != tt.explicit {
				t.Errorf("ruleSlots = %d, %v; want %d, %v", n, explicit, tt.want, tt.explicit)
			}
		})
	}
}

// manyRules is a policy of n host-wide rules on distinct addresses.
func manyRules(n int, maxRules int) string {
	var b strings.Builder
	if maxRules > 0 {
		fmt.Fprintf(&b, "maxRules: %d\n", maxRules)
	}
	b.WriteString("rules:\n")
	for i := range n {
		fmt.Fprintf(&b, "  - {name: r%d, destination: 10.%d.%d.%d, port: 80, concurrency: 10}\n", i, i>>16&255, i>>8&255, i&255)
	}
	return b.String()
}

// A policy bigger than the tables grows them before its rules are
// written, and never shrink; an explicit maxRules sizes them.
func TestTablesFollowThePolicy(t *testing.T) {
	td := newTestDaemon(t)
	check := func(what string, size, rules int) {
		t.Helper()
		if n, got := td.fake.MaxRules(), td.fake.ruleCount(); n != size || got != rules {
			t.Fatalf("%s: tables of %d holding %d rules, want %d and %d", what, n, got, size, rules)
		}
	}
	td.apply(t, manyRules(5000, 0))
	check("5,000 rules", 8192, 5000)
	td.apply(t, manyRules(9000, 0))
	check("9,000 rules", 12288, 9000)
	td.apply(t, manyRules(10, 0))
	check("10 rules, the size from the policy", 12288, 10)
	td.apply(t, manyRules(10, 50_000))
	check("maxRules 50000", 50_000, 10)
	td.apply(t, manyRules(10, 100))
	check("maxRules 100", 100, 10)
}

// The datapath is opened at the size the policy wants, not resized after:
// with the size taken from the policy, an adopted datapath's larger tables
// stay.
func TestTablesMadeAtThePolicysSize(t *testing.T) {
	td := newTestDaemon(t)
	writeFile(t, td.cfg.PolicyFile, manyRules(5000, 0))
	td.start(t)
	if n := td.fake.MaxRules(); n != 8192 || len(td.fake.resizes) != 0 || !td.fake.growOnly {
		t.Fatalf("opened with tables of %d (grow only %v), then resized to %v; want 8192 at once", n, td.fake.growOnly, td.fake.resizes)
	}
}

// Host names that resolve to many addresses take the keys of many slots:
// 70 names of 256 addresses each, 17,920 keys, need more than the 4096
// slots a 70-rule policy would otherwise get; the tables grow to hold
// them.
func TestTablesHoldResolvedAddresses(t *testing.T) {
	td := newTestDaemon(t)
	var hosts, pol strings.Builder
	pol.WriteString("rules:\n")
	for i := range 70 {
		for j := range 256 {
			fmt.Fprintf(&hosts, "10.%d.%d.%d n%d.test\n", 100+i/256, i%256, j, i)
		}
		fmt.Fprintf(&pol, "  - {name: n%d, destination: n%d.test, port: 80, concurrency: 10}\n", i, i)
	}
	writeFile(t, td.hosts, hosts.String())
	td.apply(t, pol.String())
	keys := 0
	for i := range 70 {
		r, ok := td.fake.rule(fmt.Sprint("n", i))
		if !ok {
			t.Fatalf("rule n%d not in the kernel", i)
		}
		keys += len(r.Dests)
	}
	if n := td.fake.MaxRules(); n != 8192 || keys != 70*256 {
		t.Fatalf("tables of %d holding %d addresses; want 8192 and %d", n, keys, 70*256)
	}
}
