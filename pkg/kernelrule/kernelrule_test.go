package kernelrule

import (
	"errors"
	"net/netip"
	"strings"
	"testing"
	"time"
)

// The name tables cover every value up to the _LEN sentinels, which
// pkg/loader checks against the kernel's enums.
func TestNamesCoverEnums(t *testing.T) {
	if len(shapeNames) != int(ShapeLen) {
		t.Errorf("shapeNames has %d names, ShapeLen is %d", len(shapeNames), ShapeLen)
	}
	if len(sampleKindNames) != int(SampleKindLen) {
		t.Errorf("sampleKindNames has %d names, SampleKindLen is %d", len(sampleKindNames), SampleKindLen)
	}
	if got := ShapeLen.String(); got != "shape(4)" {
		t.Errorf("ShapeLen.String() = %q", got)
	}
}

func TestValidate(t *testing.T) {
	dest := []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}
	tests := []struct {
		name string
		rule Rule
		want []string // problems named, in order; none for a valid rule
	}{
		{"a concurrency rule", Rule{Name: "db", Dests: dest, Limit: 5}, nil},
		{"a window rule", Rule{Name: "w", Dests: dest, Shape: ShapePerWindow, Limit: 5, Window: time.Second}, nil},
		{"v4 and its mapped form are one destination",
			Rule{Name: "x", Dests: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("::ffff:10.0.0.0/104")}, Limit: 1},
			[]string{"destination ::ffff:10.0.0.0/104 given twice"}},
		{"everything wrong", Rule{Name: "a b", Shape: ShapePerSecond, Limit: MaxRate + 1, Window: time.Second, Scope: Scope{CgroupID: 9}},
			[]string{"spaces", "no destination", "scope level 0", "rate 1000001", "take no window"}},
		{"segments too short", Rule{Name: "w", Dests: dest, Shape: ShapePerWindow, Limit: 1, Window: 4 * time.Millisecond},
			[]string{"segments shorter than 1ms"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.rule.Validate()
			if len(tt.want) == 0 {
				if err != nil {
					t.Fatalf("Validate = %v, want nil", err)
				}
				return
			}
			var re *RuleError
			if !errors.As(err, &re) || !errors.Is(err, ErrInvalidRule) || len(re.Problems) != len(tt.want) {
				t.Fatalf("Validate = %v, want %d problems naming %q", err, len(tt.want), tt.want)
			}
			for i, w := range tt.want {
				if !strings.Contains(re.Problems[i], w) {
					t.Errorf("problem %d = %q, want it to name %q", i, re.Problems[i], w)
				}
			}
		})
	}
}

func TestWithDefaults(t *testing.T) {
	r := Rule{Dests: []netip.Prefix{netip.MustParsePrefix("10.1.2.3/8")}, Shape: ShapePerSecond, Limit: 50}.WithDefaults()
	if r.Dests[0] != netip.MustParsePrefix("10.0.0.0/8") || r.Burst != 50 || r.Errno == 0 {
		t.Errorf("WithDefaults = %+v: want the prefix masked, burst = limit, an errno", r)
	}
	if got := Mapped(netip.MustParsePrefix("10.0.0.0/8")); got != netip.MustParsePrefix("::ffff:10.0.0.0/104") {
		t.Errorf("Mapped(10.0.0.0/8) = %v", got)
	}
}

func TestSameLimit(t *testing.T) {
	base := Rule{Name: "db", Dests: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}, Shape: ShapePerWindow, Limit: 10, Burst: 10, Window: time.Second, Segments: 4}
	tests := []struct {
		name   string
		change func(*Rule)
		same   bool
	}{
		{"itself", func(*Rule) {}, true},
		{"another name, scope, destination, port, errno, flags", func(r *Rule) {
			r.Name, r.Scope, r.Dests, r.Port, r.Errno, r.Shadow, r.Samples, r.Requests = "web", Scope{CgroupID: 7}, nil, 80, 1, true, true, true
		}, true},
		{"shape", func(r *Rule) { r.Shape = ShapePerSecond }, false},
		{"limit", func(r *Rule) { r.Limit++ }, false},
		{"granted", func(r *Rule) { r.Granted = 5 }, false},
		{"burst", func(r *Rule) { r.Burst++ }, false},
		{"window", func(r *Rule) { r.Window *= 2 }, false},
		{"segments", func(r *Rule) { r.Segments = 8 }, false},
	}
	for _, tt := range tests {
		r := base
		tt.change(&r)
		if got := base.SameLimit(r); got != tt.same {
			t.Errorf("%s: SameLimit = %v, want %v", tt.name, got, tt.same)
		}
	}
}
