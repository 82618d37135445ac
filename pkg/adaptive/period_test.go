package adaptive

import (
	"slices"
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

// A probe begins in its window, within ± spread of its start, and holds on
// at most until the window's last probes have begun and as long again:
// 3 × spread from its start. Rounds of 4s make the period five minutes,
// and schedule draws the next probe up to 1.5 periods after one ends; a
// rule that began a probe five minutes after the last ended began it
// before its window, and held it until that window's end, up to 4m36s.
func TestProbeBeginsInItsWindow(t *testing.T) {
	const round = 4 * time.Second
	o := (&Options{}).withDefaults()
	judge := 10 * time.Millisecond
	var offsets []time.Duration
	for seed := uint64(1); seed <= 200; seed++ {
		p := newProber(seed)
		p.round = round
		per := p.period(judge, &o)
		end := time.Unix(1_700_000_000, int64(seed)*7_777_777_777)
		p.end = end
		p.schedule(end, judge, &o)
		now := end
		for !p.due(now, 40, &o) {
			now = now.Add(round)
		}
		off := now.Sub(p.window)
		p.begin(now, 40, judge, &o)
		if hold := p.wait.Sub(now); off < -spread(per) || off > spread(per)+round || hold > 3*spread(per) {
			t.Errorf("seed %d: begun %v after the last probe ended, %v from its window's start; holds %v", seed, now.Sub(end), off, hold)
		}
		offsets = append(offsets, off)
	}
	if lo, hi := slices.Min(offsets), slices.Max(offsets); lo > -spread(probeAge)*9/10 || hi < spread(probeAge)*9/10 {
		t.Errorf("offsets from the windows' starts span only %v..%v; want ± %v", lo, hi, spread(probeAge))
	}
}
