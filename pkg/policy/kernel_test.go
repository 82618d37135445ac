package policy

import (
	"maps"
	"net/netip"
	"reflect"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/egressd/egressd/pkg/loader"
)

func TestLoaderRulesShapes(t *testing.T) {
	scope := loader.Scope{CgroupID: 42, Level: 2}
	dest := netip.MustParsePrefix("10.20.0.0/16")
	tests := []struct {
		name string
		rule Rule
		want loader.Rule
	}{
		{
			name: "concurrency",
			rule: Rule{Name: "a", Destination: mustDest(t, "10.20.0.0/16"), Port: 443, Limit: Concurrency(50)},
			want: loader.Rule{Name: "a", Scope: scope, Dest: dest, Port: 443, Shape: loader.ShapeConcurrency, Limit: 50},
		},
		{
			name: "per second",
			rule: Rule{Name: "a", Destination: mustDest(t, "10.20.0.0/16"), Limit: PerSecond{Permits: 10, Burst: 20}, Shadow: true},
			want: loader.Rule{Name: "a", Scope: scope, Dest: dest, Shape: loader.ShapePerSecond, Limit: 10, Burst: 20, Shadow: true},
		},
		{
			name: "per window",
			rule: Rule{Name: "a", Destination: mustDest(t, "10.20.0.0/16"), Limit: PerWindow{Permits: 1000, Window: time.Minute}, Errno: "ECONNREFUSED"},
			want: loader.Rule{Name: "a", Scope: scope, Dest: dest, Shape: loader.ShapePerWindow, Limit: 1000, Window: time.Minute, Errno: syscall.ECONNREFUSED},
		},
		{
			name: "adaptive starts at its default initial limit",
			rule: Rule{Name: "a", Destination: mustDest(t, "10.20.0.0/16"), Limit: Adaptive{}},
			want: loader.Rule{Name: "a", Scope: scope, Dest: dest, Shape: loader.ShapeConcurrency, Limit: 20, Samples: true},
		},
		{
			name: "adaptive on request latency tracks requests",
			rule: Rule{Name: "a", Destination: mustDest(t, "10.20.0.0/16"), Limit: Adaptive{Initial: 7, Samples: loader.SampleRequest}},
			want: loader.Rule{Name: "a", Scope: scope, Dest: dest, Shape: loader.ShapeConcurrency, Limit: 7, Samples: true, Requests: true},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := tt.rule.LoaderRules(scope, []netip.Addr{netip.MustParseAddr("192.0.2.1")})
			if !reflect.DeepEqual(got, []loader.Rule{tt.want}) {
				t.Errorf("LoaderRules\n got %+v\nwant %+v", got, []loader.Rule{tt.want})
			}
			if err := got[0].Validate(); err != nil {
				t.Errorf("loader refuses the rule: %v", err)
			}
		})
	}
}

func TestLoaderRulesHostName(t *testing.T) {
	long := strings.Repeat("x", maxHostName)
	tests := []struct {
		name  string
		rule  string
		addrs []string
		want  map[string]string // kernel name → destination
	}{
		{name: "unresolved", rule: "email"},
		{
			name:  "one address",
			rule:  "email",
			addrs: []string{"192.0.2.25"},
			want:  map[string]string{"email#192.0.2.25": "192.0.2.25/32"},
		},
		{
			name:  "duplicates, v4-mapped and zones count once",
			rule:  "email",
			addrs: []string{"2001:db8::1", "192.0.2.25", "::ffff:192.0.2.25", "2001:db8::1", "fe80::1%eth0"},
			want: map[string]string{
				"email#192.0.2.25":  "192.0.2.25/32",
				"email#2001:db8::1": "2001:db8::1/128",
				"email#fe80::1":     "fe80::1/128",
			},
		},
		{
			name:  "longest name: IPv4 fits, a long IPv6 address is base64",
			rule:  long,
			addrs: []string{"255.255.255.255", "2001:db8:ffff:ffff:ffff:ffff:ffff:ffff", "2001:db8::1"},
			want: map[string]string{
				long + "#255.255.255.255":        "255.255.255.255/32",
				long + "#IAENuP_______________w": "2001:db8:ffff:ffff:ffff:ffff:ffff:ffff/128",
				long + "#2001:db8::1":            "2001:db8::1/128",
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := Rule{Name: tt.rule, Destination: mustDest(t, "smtp.example.com"), Port: 25, Limit: Concurrency(3)}
			var addrs []netip.Addr
			for _, a := range tt.addrs {
				addrs = append(addrs, netip.MustParseAddr(a))
			}
			got := map[string]string{}
			for _, kr := range r.LoaderRules(loader.Scope{}, addrs) {
				got[kr.Name] = kr.Dest.String()
				if err := kr.Validate(); err != nil {
					t.Errorf("loader refuses %s: %v", kr.Name, err)
				}
				if RuleName(kr.Name) != tt.rule {
					t.Errorf("RuleName(%q) = %q, want %q", kr.Name, RuleName(kr.Name), tt.rule)
				}
			}
			if !maps.Equal(got, tt.want) {
				t.Errorf("kernel rules\n got %v\nwant %v", got, tt.want)
			}
		})
	}
}

// TestErrnosMatchLoader holds the errno names a policy accepts to the
// errnos the kernel side accepts, so neither list drifts alone.
func TestErrnosMatchLoader(t *testing.T) {
	named := map[syscall.Errno]bool{}
	for _, e := range errnos {
		named[e] = true
	}
	for e := syscall.Errno(1); e < 256; e++ {
		r := loader.Rule{Name: "a", Dest: netip.MustParsePrefix("10.0.0.0/8"), Limit: 1, Errno: e}
		if loaderOK := r.Validate() == nil; loaderOK != named[e] {
			t.Errorf("errno %d (%v): loader accepts it %v, policy names it %v", int(e), e, loaderOK, named[e])
		}
	}
}

func TestRuleName(t *testing.T) {
	for kernel, want := range map[string]string{
		"payments":             "payments",
		"email#192.0.2.25":     "email",
		"api#2001:db8::1":      "api",
		"api#IAENuP__________": "api",
	} {
		if got := RuleName(kernel); got != want {
			t.Errorf("RuleName(%q) = %q, want %q", kernel, got, want)
		}
	}
}
