package unitcheck

import (
	"net/netip"
	"path/filepath"
	"testing"

	"github.com/egressd/egressd/pkg/policy"
)

// examplePolicy is what `make install` puts at /etc/egressd/policy.yaml
// when there is none.
var examplePolicy = filepath.Join("..", "..", "examples", "policy.yaml")

// loopback are the destinations the example may limit: it must change
// nothing for a host's real traffic.
var loopback = []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8"), netip.MustParsePrefix("::1/128")}

func TestExamplePolicy(t *testing.T) {
	p, err := policy.Load(examplePolicy)
	if err != nil {
		t.Fatalf("the example policy does not load:\n%v", err)
	}
	if len(p.Rules) == 0 {
		t.Fatal("the example policy has no rules to show")
	}
	for _, r := range p.Rules {
		t.Run(r.Name, func(t *testing.T) {
			prefix, ok := r.Destination.Prefix()
			if !ok || !within(prefix, loopback) {
				t.Errorf("destination %s is not loopback: the example must be safe to install on any host", r.Destination)
			}
			if !r.Scope.HostWide() {
				t.Errorf("scope %+v names a unit or cgroup a fresh host may not have", r.Scope)
			}
		})
	}
}

// within reports whether p lies inside one of the prefixes.
func within(p netip.Prefix, in []netip.Prefix) bool {
	for _, q := range in {
		if q.Bits() <= p.Bits() && q.Contains(p.Addr()) {
			return true
		}
	}
	return false
}

// The example shows every shape of limit and a shadow rule.
func TestExamplePolicyShowsEachShape(t *testing.T) {
	p, err := policy.Load(examplePolicy)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, r := range p.Rules {
		switch r.Limit.(type) {
		case policy.Concurrency:
			seen["concurrency"] = true
		case policy.PerSecond:
			seen["perSecond"] = true
		case policy.PerWindow:
			seen["perWindow"] = true
		case policy.Adaptive:
			seen["adaptive"] = true
		}
		seen["shadow"] = seen["shadow"] || r.Shadow
	}
	for _, want := range []string{"concurrency", "perSecond", "perWindow", "adaptive", "shadow"} {
		if !seen[want] {
			t.Errorf("the example policy has no %s rule", want)
		}
	}
}
