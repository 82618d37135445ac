package policy

import (
	"net/netip"
	"reflect"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/egressd/egressd/pkg/kernelrule"
)

func TestLoaderRuleShapes(t *testing.T) {
	scope := kernelrule.Scope{CgroupID: 42, Level: 2}
	dests := []netip.Prefix{netip.MustParsePrefix("10.20.0.0/16")}
	tests := []struct {
		name string
		rule Rule
		want kernelrule.Rule
	}{
		{
			name: "concurrency",
			rule: Rule{Name: "a", Destination: mustDest(t, "10.20.0.0/16"), Port: 443, Limit: Concurrency(50)},
			want: kernelrule.Rule{Name: "a", Scope: scope, Dests: dests, Port: 443, Shape: kernelrule.ShapeConcurrency, Limit: 50},
		},
		{
			name: "per second",
			rule: Rule{Name: "a", Destination: mustDest(t, "10.20.0.0/16"), Limit: PerSecond{Permits: 10, Burst: 20}, Shadow: true},
			want: kernelrule.Rule{Name: "a", Scope: scope, Dests: dests, Shape: kernelrule.ShapePerSecond, Limit: 10, Burst: 20, Shadow: true},
		},
		{
			name: "per window",
			rule: Rule{Name: "a", Destination: mustDest(t, "10.20.0.0/16"), Limit: PerWindow{Permits: 1000, Window: time.Minute}, Errno: "ECONNREFUSED"},
			want: kernelrule.Rule{Name: "a", Scope: scope, Dests: dests, Shape: kernelrule.ShapePerWindow, Limit: 1000, Window: time.Minute, Errno: syscall.ECONNREFUSED},
		},
		{
			name: "adaptive starts at its default initial limit, on request latency by default",
			rule: Rule{Name: "a", Destination: mustDest(t, "10.20.0.0/16"), Limit: Adaptive{}},
			want: kernelrule.Rule{Name: "a", Scope: scope, Dests: dests, Shape: kernelrule.ShapeConcurrency, Limit: 20, Samples: true, Requests: true},
		},
		{
			name: "adaptive on request latency tracks requests",
			rule: Rule{Name: "a", Destination: mustDest(t, "10.20.0.0/16"), Limit: Adaptive{Initial: 7, Samples: SamplesRequest}},
			want: kernelrule.Rule{Name: "a", Scope: scope, Dests: dests, Shape: kernelrule.ShapeConcurrency, Limit: 7, Samples: true, Requests: true},
		},
		{
			name: "adaptive on connect latency does not",
			rule: Rule{Name: "a", Destination: mustDest(t, "10.20.0.0/16"), Limit: Adaptive{Samples: SamplesConnect}},
			want: kernelrule.Rule{Name: "a", Scope: scope, Dests: dests, Shape: kernelrule.ShapeConcurrency, Limit: 20, Samples: true},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// A prefix destination ignores whatever addresses it is given.
			for _, addrs := range [][]netip.Addr{nil, {netip.MustParseAddr("192.0.2.1"), netip.MustParseAddr("2001:db8::1")}} {
				got := tt.rule.LoaderRule(scope, addrs)
				if !reflect.DeepEqual(got, tt.want) {
					t.Errorf("LoaderRule(%v)\n got %+v\nwant %+v", addrs, got, tt.want)
				}
				if err := got.Validate(); err != nil {
					t.Errorf("loader refuses the rule: %v", err)
				}
			}
		})
	}
}

// TestLoaderRulePrefixSpelling checks that a prefix destination reaches the
// kernel as written: the loader, not the policy, maps IPv4 to v4-mapped.
func TestLoaderRulePrefixSpelling(t *testing.T) {
	for _, d := range []string{"10.0.0.1", "::ffff:10.0.0.0/104", "2001:db8::/32", "0.0.0.0/0"} {
		r := Rule{Name: "a", Destination: mustDest(t, d), Limit: Concurrency(1)}
		kr := r.LoaderRule(kernelrule.Scope{}, nil)
		want, _ := r.Destination.Prefix()
		if !reflect.DeepEqual(kr.Dests, []netip.Prefix{want}) {
			t.Errorf("%s: Dests = %v, want [%v]", d, kr.Dests, want)
		}
		if err := kr.Validate(); err != nil {
			t.Errorf("%s: loader refuses the rule: %v", d, err)
		}
	}
}

func TestLoaderRuleHostName(t *testing.T) {
	// many is more addresses than a rule holds, in no particular order.
	var many, firstMany []string
	for i := range kernelrule.MaxDests + 44 {
		many = append(many, netip.AddrFrom4([4]byte{10, 0, byte(i >> 8), byte(i)}).String())
	}
	firstMany = make([]string, kernelrule.MaxDests)
	for i := range firstMany {
		firstMany[i] = many[i] + "/32"
	}
	many = append(many, "2001:db8::1") // sorts after every IPv4 address
	slices.Reverse(many)
	tests := []struct {
		name  string
		addrs []netip.Addr
		want  []string // Dests; none means the rule is not installable
	}{
		{name: "unresolved"},
		{name: "no valid address", addrs: []netip.Addr{{}, {}}},
		{
			name:  "one address",
			addrs: addrs(t, "192.0.2.25"),
			want:  []string{"192.0.2.25/32"},
		},
		{
			name:  "every address in one rule, sorted",
			addrs: addrs(t, "2001:db8::2", "192.0.2.26", "2001:db8::1", "192.0.2.25"),
			want:  []string{"192.0.2.25/32", "192.0.2.26/32", "2001:db8::1/128", "2001:db8::2/128"},
		},
		{
			name:  "duplicates, v4-mapped spellings and zones count once",
			addrs: append(addrs(t, "2001:db8::1", "192.0.2.25", "::ffff:192.0.2.25", "2001:db8::1", "fe80::1%eth0", "fe80::1%eth1", "fe80::1"), netip.Addr{}),
			want:  []string{"192.0.2.25/32", "2001:db8::1/128", "fe80::1/128"},
		},
		{
			name:  "only a v4-mapped address",
			addrs: addrs(t, "::ffff:192.0.2.25"),
			want:  []string{"192.0.2.25/32"},
		},
		{
			name:  "more than MaxDests keeps the first MaxDests in order",
			addrs: addrs(t, many...),
			want:  firstMany,
		},
	}
	scope := kernelrule.Scope{CgroupID: 42, Level: 2}
	r := Rule{Name: "email", Destination: mustDest(t, "smtp.example.com"), Port: 25, Limit: Concurrency(50), Errno: "EAGAIN"}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := r.LoaderRule(scope, tt.addrs)
			var dests []string
			for _, d := range got.Dests {
				dests = append(dests, d.String())
			}
			if !slices.Equal(dests, tt.want) {
				t.Errorf("Dests\n got %v\nwant %v", dests, tt.want)
			}
			// Everything but Dests is the rule's, whatever the name
			// resolved to: one rule, one budget.
			want := kernelrule.Rule{Name: "email", Scope: scope, Dests: got.Dests, Port: 25, Shape: kernelrule.ShapeConcurrency, Limit: 50, Errno: syscall.EAGAIN}
			if !reflect.DeepEqual(got, want) {
				t.Errorf("LoaderRule\n got %+v\nwant %+v", got, want)
			}
			err := got.Validate()
			switch {
			case len(got.Dests) > 0 && err != nil:
				t.Errorf("loader refuses the rule: %v", err)
			case len(got.Dests) == 0 && err == nil:
				t.Errorf("loader accepts a rule with no destinations; the daemon relies on it refusing")
			}
			// The same answer in another order is the same rule, so a
			// re-resolve that changes nothing changes nothing.
			reversed := slices.Clone(tt.addrs)
			slices.Reverse(reversed)
			if again := r.LoaderRule(scope, reversed); !reflect.DeepEqual(again, got) {
				t.Errorf("addresses in reverse give\n %+v\nnot %+v", again, got)
			}
		})
	}
}

// TestLoaderRuleLongName checks that a host name rule may use the whole
// name length, as every rule may.
func TestLoaderRuleLongName(t *testing.T) {
	r := Rule{Name: strings.Repeat("x", kernelrule.MaxNameLen), Destination: mustDest(t, "smtp.example.com"), Limit: Concurrency(1)}
	if err := (&Policy{Rules: []Rule{r}}).Validate(); err != nil {
		t.Fatalf("policy refuses a 63-byte name: %v", err)
	}
	kr := r.LoaderRule(kernelrule.Scope{}, addrs(t, "2001:db8:ffff:ffff:ffff:ffff:ffff:ffff", "255.255.255.255"))
	if kr.Name != r.Name {
		t.Errorf("Name = %q, want %q", kr.Name, r.Name)
	}
	if err := kr.Validate(); err != nil {
		t.Errorf("loader refuses the rule: %v", err)
	}
}

func addrs(t *testing.T, ss ...string) []netip.Addr {
	t.Helper()
	out := make([]netip.Addr, len(ss))
	for i, s := range ss {
		a, err := netip.ParseAddr(s)
		if err != nil {
			t.Fatal(err)
		}
		out[i] = a
	}
	return out
}

// TestErrnosMatchLoader holds the errno names a policy accepts to the
// errnos the kernel side accepts, so neither list drifts alone.
func TestErrnosMatchLoader(t *testing.T) {
	named := map[syscall.Errno]bool{}
	for _, e := range errnos {
		named[e] = true
	}
	for e := syscall.Errno(1); e < 256; e++ {
		r := kernelrule.Rule{Name: "a", Dests: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}, Limit: 1, Errno: e}
		if loaderOK := r.Validate() == nil; loaderOK != named[e] {
			t.Errorf("errno %d (%v): loader accepts it %v, policy names it %v", int(e), e, loaderOK, named[e])
		}
	}
}

// LoaderRule is called for every rule at start and on each reload: for a
// prefix it allocates the one-element destination list and nothing else.
func TestLoaderRuleAllocations(t *testing.T) {
	dest, err := ParseDestination("10.0.0.0/8")
	if err != nil {
		t.Fatal(err)
	}
	for _, limit := range []Limit{Concurrency(5), PerSecond{Permits: 5}, PerWindow{Permits: 5, Window: time.Second}, Adaptive{}} {
		r := Rule{Name: "a", Destination: dest, Port: 443, Limit: limit}
		if n := testing.AllocsPerRun(100, func() { _ = r.LoaderRule(kernelrule.Scope{}, nil) }); n != 1 {
			t.Errorf("%T: %v allocations, want 1", limit, n)
		}
	}
}
