package policy

import (
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"
)

// TestValidate covers rules built in code, as the CLI builds them: the same
// checks as Parse, without positions, and with the zero value of every
// defaulted field meaning its default.
func TestValidate(t *testing.T) {
	tests := []struct {
		name  string
		rules []Rule
		want  []Problem
	}{
		{name: "no rules"},
		{
			name: "defaults",
			rules: []Rule{
				{Name: "a", Destination: mustDest(t, "10.0.0.1"), Limit: PerSecond{Permits: 1}},
				{Name: "b", Destination: mustDest(t, "10.0.0.2"), Limit: PerWindow{Permits: 1, Window: 8 * time.Millisecond}},
				{Name: "c", Destination: mustDest(t, "10.0.0.3"), Limit: Adaptive{}},
			},
		},
		{
			name:  "zero rule",
			rules: []Rule{{}},
			want: []Problem{
				{Rule: "#1", Msg: "name is missing"},
				{Rule: "#1", Msg: "destination is missing"},
				{Rule: "#1", Msg: "no limit: give one of concurrency, perSecond, perWindow or adaptive"},
			},
		},
		{
			name: "what only code can get wrong",
			rules: []Rule{
				{Name: "a", Destination: mustDest(t, "10.0.0.1"), Limit: Adaptive{Samples: "packets"}},
				{Name: "b", Destination: mustDest(t, "10.0.0.2"), Limit: PerWindow{Permits: 1, Window: time.Second, Segments: -1}},
				{Name: "c", Destination: mustDest(t, "10.0.0.3"), Limit: Adaptive{Minimum: -1, Multiple: -2}},
				{Name: "d\xff", Destination: mustDest(t, "10.0.0.4"), Limit: Concurrency(1)},
			},
			want: []Problem{
				{Rule: "a", Msg: `adaptive.samples "packets" is not connect or request`},
				{Rule: "b", Msg: "perWindow.segments -1 is outside 1..32"},
				{Rule: "c", Msg: "adaptive: Minimum -1 must be at least 1"},
				{Rule: "c", Msg: "adaptive: Multiple -2 must be a finite number above 1"},
				{Rule: "d\xff", Msg: "name is not valid UTF-8"},
			},
		},
		{
			name: "across rules",
			rules: []Rule{
				{Name: "a", Destination: mustDest(t, "10.0.0.1"), Limit: Concurrency(1)},
				{Name: "a", Destination: mustDest(t, "10.0.0.2"), Limit: Concurrency(1)},
				{Name: "b", Destination: mustDest(t, "10.0.0.1"), Limit: PerSecond{Permits: 1}},
			},
			want: []Problem{
				{Rule: "a", Msg: "name a is already used by rule #1"},
				{Rule: "b", Msg: "same scope, destination and port as rule a; the kernel takes one rule for the same traffic"},
			},
		},
		{
			name: "each rule's problems together",
			rules: []Rule{
				{Name: "a", Destination: mustDest(t, "10.0.0.1"), Limit: Concurrency(1)},
				{Name: "a", Destination: mustDest(t, "10.0.0.1"), Limit: Concurrency(0)},
				{Name: "b", Limit: Concurrency(1)},
			},
			want: []Problem{
				{Rule: "a", Msg: "concurrency must be at least 1"},
				{Rule: "a", Msg: "name a is already used by rule #1"},
				{Rule: "a", Msg: "same scope, destination and port as rule a; the kernel takes one rule for the same traffic"},
				{Rule: "b", Msg: "destination is missing"},
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := (&Policy{Rules: tt.rules}).Validate()
			e, _ := errors.AsType[*Error](err)
			var got []Problem
			if e != nil {
				got = e.Problems
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("problems\n got %s\nwant %s", dump(got), dump(tt.want))
			}
			// What a large policy's parse asks instead, over the CPUs.
			if clean(tt.rules) != (len(tt.want) == 0) {
				t.Errorf("clean says %v with %d problems", clean(tt.rules), len(tt.want))
			}
		})
	}
}

// Names beginning KubePrefix are the daemon's to give: Validate, which
// checks the rules it makes with the rest, takes them; a file and flags,
// which a person writes, cannot.
func TestKubePrefix(t *testing.T) {
	r := Rule{Name: KubePrefix + "shop/db/web-1", Destination: mustDest(t, "10.0.0.1"), Limit: Concurrency(1)}
	if err := (&Policy{Rules: []Rule{r}}).Validate(); err != nil {
		t.Errorf("Validate: %v", err)
	}
	if clean([]Rule{r}) {
		t.Error("clean, the parse of a large file, takes a name beginning " + KubePrefix)
	}
	_, err := FromFlags(r.Name, map[string]any{"dest": "10.0.0.1", "concurrency": 1})
	if want := "rule k8s:shop/db/web-1: names beginning k8s: are the rules egressd makes for Kubernetes EgressLimits"; err == nil || err.Error() != want {
		t.Errorf("FromFlags: %v, want %s", err, want)
	}
}

func TestParseDestination(t *testing.T) {
	tests := []struct {
		in         string
		wantPrefix string
		wantHost   string
		wantString string
	}{
		{in: "10.20.0.0/16", wantPrefix: "10.20.0.0/16", wantString: "10.20.0.0/16"},
		{in: "10.0.0.1", wantPrefix: "10.0.0.1/32", wantString: "10.0.0.1"},
		{in: "10.0.0.1/32", wantPrefix: "10.0.0.1/32", wantString: "10.0.0.1"},
		{in: "2001:db8::/32", wantPrefix: "2001:db8::/32", wantString: "2001:db8::/32"},
		{in: "2001:DB8:0::1", wantPrefix: "2001:db8::1/128", wantString: "2001:db8::1"},
		{in: "::ffff:10.0.0.1", wantPrefix: "::ffff:10.0.0.1/128", wantString: "::ffff:10.0.0.1"},
		{in: "0.0.0.0/0", wantPrefix: "0.0.0.0/0", wantString: "0.0.0.0/0"},
		{in: "smtp.example.com", wantHost: "smtp.example.com", wantString: "smtp.example.com"},
		{in: "Redis_Primary.svc.", wantHost: "Redis_Primary.svc.", wantString: "Redis_Primary.svc."},
		{in: "localhost", wantHost: "localhost", wantString: "localhost"},
		{in: "3com.example", wantHost: "3com.example", wantString: "3com.example"},
	}
	if s := (Destination{}).String(); s != "" {
		t.Errorf("zero Destination String() = %q, want empty", s)
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			d, err := ParseDestination(tt.in)
			if err != nil {
				t.Fatal(err)
			}
			p, _ := d.Prefix()
			h, _ := d.Host()
			if (p.IsValid() && p.String() != tt.wantPrefix) || h != tt.wantHost || d.String() != tt.wantString {
				t.Errorf("ParseDestination(%q) = prefix %v, host %q, string %q; want %q, %q, %q", tt.in, p, h, d, tt.wantPrefix, tt.wantHost, tt.wantString)
			}
		})
	}
}

func TestParseDestinationRefuses(t *testing.T) {
	// Where net/netip gives the reason, only the part before it is ours
	// to pin down.
	tests := []struct{ in, wantPrefix string }{
		{"10.0.0.0/33", `destination "10.0.0.0/33" is not a valid CIDR: prefix length out of range`},
		{"10.0.0.1/16", "destination 10.0.0.1/16 has bits set past /16; write 10.0.0.0/16"},
		{"10.0.0", `destination "10.0.0" is not a valid IP address: `},
		{"10.0.0.1.", `destination "10.0.0.1." is not a valid IP address: `},
		{"999", `destination "999" is not a valid IP address: `},
		{"[::1]", `destination "[::1]" is not a valid IP address: `},
		{"fe80::1%eth0", "destination fe80::1%eth0 has a zone; rules match addresses without one"},
		{"smtp.example.com:25", `destination "smtp.example.com:25" has a port; write destination: smtp.example.com and port: 25`},
		{"[2001:db8::1]:443", `destination "[2001:db8::1]:443" has a port; write destination: 2001:db8::1 and port: 443`},
		{"-bad.example", `destination "-bad.example" is not an IP address, CIDR or host name`},
		{"a..b", `destination "a..b" is not an IP address, CIDR or host name`},
		{"ünï.example", `destination "ünï.example" is not an IP address, CIDR or host name`},
		{"", `destination "" is not an IP address, CIDR or host name`},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			d, err := ParseDestination(tt.in)
			if err == nil || !strings.HasPrefix(err.Error(), tt.wantPrefix) || d != (Destination{}) {
				t.Errorf("ParseDestination(%q) = %v, %v; want error %q", tt.in, d, err, tt.wantPrefix)
			}
		})
	}
}

// TestScopeHostWide pins down which scope is the whole host, since the
// daemon resolves every other one to a cgroup.
func TestScopeHostWide(t *testing.T) {
	for s, want := range map[Scope]bool{
		{}:                   true,
		{Unit: "a.service"}:  false,
		{Cgroup: "/a.slice"}: false,
	} {
		if got := s.HostWide(); got != want {
			t.Errorf("%+v.HostWide() = %v, want %v", s, got, want)
		}
	}
}

// TestAdaptiveOptions checks that a rule hands its options to the
// controller unchanged, zeros and all, so the controller's defaults apply.
func TestAdaptiveOptions(t *testing.T) {
	a := Adaptive{Minimum: 1, Maximum: 2, Initial: 0, Multiple: 3, DecreaseFactor: 0.5, Samples: SamplesRequest}
	o := a.Options()
	if o.Minimum != 1 || o.Maximum != 2 || o.Initial != 0 || o.Multiple != 3 || o.DecreaseFactor != 0.5 || o.OnChange != nil {
		t.Errorf("Options() = %+v", o)
	}
}
