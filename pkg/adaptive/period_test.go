package adaptive

import (
	"testing"
	"time"
)

func TestPeriod(t *testing.T) {
	tests := []struct {
		name     string
		opts     Options
		round    time.Duration // as rounds have lately taken; 0 before one was timed
		baseline time.Duration
		want     time.Duration
	}{
		{name: "100 rounds of 10ms, rounded up to 2^30ns", round: 10 * time.Millisecond, want: 1 << 30},
		{name: "before a round was timed: Multiple × baseline", baseline: 10 * time.Millisecond, want: 1 << 31},
		{name: "at least 2ns", opts: Options{ProbeEvery: 1}, round: 1, want: 2},
		{name: "100 rounds of 4s: capped at five minutes", round: 4 * time.Second, want: probeAge},
		{name: "a billion rounds of 10s, past 2^63ns: capped, not 0", opts: Options{ProbeEvery: 1_000_000_000}, round: 10 * time.Second, want: probeAge},
		{name: "2^62 rounds, past 2^64ns", opts: Options{ProbeEvery: 1 << 62}, round: time.Millisecond, want: probeAge},
		{name: "Multiple × baseline past 2^63ns", opts: Options{Multiple: 1e300}, baseline: 10 * time.Millisecond, want: probeAge},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o := tt.opts.withDefaults()
			p := &prober{round: tt.round}
			if got := p.period(tt.baseline, &o); got != tt.want {
				t.Errorf("period = %v; want %v", got, tt.want)
			}
		})
	}
}
