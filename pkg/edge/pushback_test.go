package edge

import (
	"math"
	"testing"
	"time"
)

func TestPushback(t *testing.T) {
	parsed := []struct {
		in   string
		want time.Duration
		ok   bool
	}{
		{"250", 250 * time.Millisecond, true},
		{" 0 ", 0, true}, // retry now
		{"9300000000000000", math.MaxInt64 / time.Millisecond * time.Millisecond, true},
		{"-1", 0, false}, // do not retry
		{"soon", 0, false},
		{"", 0, false},
	}
	for _, tt := range parsed {
		if got, ok := ParsePushback(tt.in); got != tt.want || ok != tt.ok {
			t.Errorf("ParsePushback(%q) = %v, %v; want %v, %v", tt.in, got, ok, tt.want, tt.ok)
		}
	}
	// Rounded up: a client waiting as long as it is told is not early.
	for d, want := range map[time.Duration]string{1500*time.Microsecond + 1: "2", time.Millisecond: "1", 0: "0", -time.Second: "0"} {
		if got := FormatPushback(d); got != want {
			t.Errorf("FormatPushback(%v) = %q, want %q", d, got, want)
		}
	}
}
