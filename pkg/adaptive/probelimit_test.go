package adaptive

import "testing"

func TestProbeLimit(t *testing.T) {
	tests := []struct {
		name  string
		opts  Options
		limit int
		want  int
	}{
		{name: "half, exact", limit: 20, want: 10},
		{name: "half, rounded up", limit: 21, want: 11},
		{name: "at the floor", limit: 4, want: 4},
		{name: "never below Minimum", limit: 6, want: 4},
		{name: "Maximum", limit: 200, want: 100},
		{name: "⌈100 × 0.07⌉ is 7, though 100 × 0.07 is 7.000000000000001", opts: Options{ProbeFactor: 0.07, Minimum: 1}, limit: 100, want: 7},
		{name: "⌈90 × 0.7⌉ is 63; 90 × 0.7 is 62.99999999999999", opts: Options{ProbeFactor: 0.7}, limit: 90, want: 63},
		{name: "⌈11 × 0.1⌉ is 2", opts: Options{ProbeFactor: 0.1, Minimum: 1}, limit: 11, want: 2},
		{name: "Minimum 1, limit 1", opts: Options{Minimum: 1}, limit: 1, want: 1},
		{name: "never above the limit", opts: Options{ProbeFactor: 0.999, Minimum: 1}, limit: 7, want: 7},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o := tt.opts.withDefaults()
			if got := o.probeLimit(tt.limit); got != tt.want {
				t.Errorf("probeLimit(%d) = %d; want %d", tt.limit, got, tt.want)
			}
		})
	}
}
