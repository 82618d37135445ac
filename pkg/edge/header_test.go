package edge

import (
	"context"
	"math"
	"testing"
	"time"
)

func TestParseCriticality(t *testing.T) {
	tests := []struct {
		in   string
		want Criticality
		ok   bool
	}{
		{"Sheddable", Sheddable, true},
		{" sheddableplus ", SheddablePlus, true},
		{"CRITICALPLUS", CriticalPlus, true},
		{"Critical", Critical, true},
		{"urgent", Critical, false},
		{"", Critical, false},
	}
	for _, tt := range tests {
		if got, ok := ParseCriticality(tt.in); got != tt.want || ok != tt.ok {
			t.Errorf("ParseCriticality(%q) = %v, %v; want %v, %v", tt.in, got, ok, tt.want, tt.ok)
		}
	}
}

// The names are CriticalityHeader's values (docs/serving.md): they must
// not change.
func TestCriticalityNames(t *testing.T) {
	tests := []struct {
		c    Criticality
		want string
	}{
		{Sheddable, "Sheddable"},
		{SheddablePlus, "SheddablePlus"},
		{Critical, "Critical"},
		{CriticalPlus, "CriticalPlus"},
		{Sheddable - 1, "Criticality(-3)"},
		{CriticalPlus + 1, "Criticality(2)"},
	}
	for _, tt := range tests {
		if got := tt.c.String(); got != tt.want {
			t.Errorf("Criticality(%d).String() = %q, want %q", tt.c, got, tt.want)
		}
	}
}

func TestTimeoutHeader(t *testing.T) {
	tests := []struct {
		in   string
		want time.Duration
		ok   bool
	}{
		{"1500", 1500 * time.Millisecond, true},
		{" 0 ", 0, true},
		{"9300000000000000", math.MaxInt64, true},
		{"99999999999999999999", 0, false}, // beyond 64 bits: malformed, as pkg/serve's tests hold
		{"-5", 0, false},
		{"1.5", 0, false},
		{"10ms", 0, false},
	}
	for _, tt := range tests {
		if got, ok := ParseTimeout(tt.in); got != tt.want || ok != tt.ok {
			t.Errorf("ParseTimeout(%q) = %v, %v; want %v, %v", tt.in, got, ok, tt.want, tt.ok)
		}
	}
	for d, want := range map[time.Duration]string{1999 * time.Microsecond: "1", 0: "0", -time.Second: "0", time.Hour: "3600000"} {
		if got := FormatTimeout(d); got != want {
			t.Errorf("FormatTimeout(%v) = %q, want %q", d, got, want)
		}
	}
}

func TestCriticalityInContext(t *testing.T) {
	ctx := context.Background()
	if c, ok := LookupCriticality(ctx); ok || c != Critical || CriticalityFrom(ctx) != Critical {
		t.Errorf("an unlabelled context: %v, %v, %v", c, ok, CriticalityFrom(ctx))
	}
	ctx = WithCriticality(ctx, Sheddable)
	if c, ok := LookupCriticality(ctx); !ok || c != Sheddable || CriticalityFrom(ctx) != Sheddable {
		t.Errorf("a Sheddable context: %v, %v, %v", c, ok, CriticalityFrom(ctx))
	}
}
