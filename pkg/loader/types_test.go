package loader

import (
	"errors"
	"net/netip"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestRuleValidate(t *testing.T) {
	dest := netip.MustParsePrefix("10.0.0.0/8")
	tests := []struct {
		name string
		rule Rule
		want []string // substrings, one per problem
	}{
		{"concurrency", Rule{Name: "a", Dests: []netip.Prefix{dest}, Limit: 1}, nil},
		{"per second", Rule{Name: "a", Dests: []netip.Prefix{dest}, Shape: ShapePerSecond, Limit: 10, Burst: 20}, nil},
		{"per window", Rule{Name: "a", Dests: []netip.Prefix{dest}, Shape: ShapePerWindow, Limit: 10, Window: time.Second}, nil},
		{"errno", Rule{Name: "a", Dests: []netip.Prefix{dest}, Limit: 1, Errno: syscall.ECONNREFUSED}, nil},
		{"concurrency of zero", Rule{Name: "a", Dests: []netip.Prefix{dest}}, nil},
		{"granted", Rule{Name: "a", Dests: []netip.Prefix{dest}, Shape: ShapeGranted, Granted: 12}, nil},
		{"granted with a limit", Rule{Name: "a", Dests: []netip.Prefix{dest}, Shape: ShapeGranted, Limit: 3, Window: time.Second}, []string{"no limit, burst, window"}},
		{"grant on a bucket", Rule{Name: "a", Dests: []netip.Prefix{dest}, Shape: ShapePerSecond, Limit: 3, Granted: 1}, []string{"only granted rules"}},
		{"everything wrong", Rule{Name: "has space", Shape: ShapePerWindow, Burst: 3, Window: time.Millisecond, Segments: 40, Errno: syscall.ENOENT},
			[]string{"spaces", "no destination", "limit", "burst", "segments 40", "shorter than", "errno"}},
		{"empty name", Rule{Dests: []netip.Prefix{dest}, Limit: 1}, []string{"name is empty"}},
		{"long name", Rule{Name: strings.Repeat("n", 64), Dests: []netip.Prefix{dest}, Limit: 1}, []string{"longer than 63"}},
		{"rate too high", Rule{Name: "a", Dests: []netip.Prefix{dest}, Shape: ShapePerSecond, Limit: MaxRate + 1}, []string{"rate"}},
		{"concurrency with window", Rule{Name: "a", Dests: []netip.Prefix{dest}, Limit: 1, Window: time.Second}, []string{"no burst, window"}},
		{"scope level", Rule{Name: "a", Dests: []netip.Prefix{dest}, Limit: 1, Scope: Scope{CgroupID: 7}}, []string{"scope level 0"}},
		{"unknown shape", Rule{Name: "a", Dests: []netip.Prefix{dest}, Limit: 1, Shape: 9}, []string{"unknown shape"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.rule.Validate()
			var re *RuleError
			if len(tt.want) == 0 && err != nil {
				t.Fatalf("Validate: %v", err)
			}
			if len(tt.want) > 0 && (!errors.As(err, &re) || !errors.Is(err, ErrInvalidRule)) {
				t.Fatalf("Validate: %v, want a *RuleError", err)
			}
			if re != nil && len(re.Problems) != len(tt.want) {
				t.Fatalf("problems %q, want %d matching %q", re.Problems, len(tt.want), tt.want)
			}
			for i, w := range tt.want {
				if !strings.Contains(re.Problems[i], w) {
					t.Errorf("problem %d %q does not mention %q", i, re.Problems[i], w)
				}
			}
		})
	}
}

func TestDefaults(t *testing.T) {
	r := Rule{Dests: []netip.Prefix{netip.MustParsePrefix("10.1.2.3/8")}, Shape: ShapePerSecond, Limit: 50}.WithDefaults()
	if r.Burst != 50 || r.Errno != syscall.EPERM || r.Dests[0] != netip.MustParsePrefix("10.0.0.0/8") {
		t.Fatalf("per second defaults: %+v", r)
	}
	w := Rule{Shape: ShapePerWindow, Limit: 5, Window: time.Second, Dests: []netip.Prefix{netip.MustParsePrefix("::/0")}}.WithDefaults()
	if w.Segments != DefaultSegments {
		t.Fatalf("per window defaults: %+v", w)
	}
	// A window its segments do not divide is kept in whole segments.
	if u := (Rule{Shape: ShapePerWindow, Limit: 5, Window: time.Minute, Segments: 7}).WithDefaults(); u.Window != 59999999997*time.Nanosecond {
		t.Fatalf("a minute in 7 segments: window %v, want 59.999999997s", u.Window)
	}
}

func TestIPv4MatchesMapped(t *testing.T) {
	a := Rule{Dests: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}}
	b := Rule{Dests: []netip.Prefix{netip.MustParsePrefix("::ffff:10.0.0.0/104")}}
	if ruleKeys(&a)[0] != ruleKeys(&b)[0] {
		t.Fatalf("keys differ: %+v %+v", ruleKeys(&a), ruleKeys(&b))
	}
}

func TestHistogramBounds(t *testing.T) {
	if UpperBound(0) != time.Microsecond || UpperBound(10) != 1024*time.Microsecond {
		t.Fatalf("bounds: %v %v", UpperBound(0), UpperBound(10))
	}
	if UpperBound(HistogramBuckets-1) < 100*time.Hour {
		t.Fatalf("last bucket is not unbounded: %v", UpperBound(HistogramBuckets-1))
	}
}
