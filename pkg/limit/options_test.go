package limit_test

import (
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/egressd/egressd/pkg/adaptive"
	"github.com/egressd/egressd/pkg/limit"
)

func TestValidate(t *testing.T) {
	tests := []struct {
		name string
		opts *limit.Options
		want []string
	}{
		{name: "per second", opts: &limit.Options{PerSecond: &limit.PerSecondOptions{Permits: 100}}},
		{name: "per second at the bounds", opts: &limit.Options{PerSecond: &limit.PerSecondOptions{Permits: limit.MaxRate, Burst: 1}}},
		{name: "per window", opts: &limit.Options{PerWindow: &limit.PerWindowOptions{Permits: 1000, Window: time.Minute}}},
		{name: "per window, shortest segments", opts: &limit.Options{PerWindow: &limit.PerWindowOptions{Permits: 1, Window: 32 * time.Millisecond, Segments: 32}}},
		{name: "concurrency", opts: &limit.Options{Concurrency: 20}},
		{name: "adaptive: its presence turns it on", opts: &limit.Options{Adaptive: &adaptive.Options{}}},
		{name: "a queue, newest first", opts: &limit.Options{Concurrency: 1, QueueLimit: 10, QueueOrder: limit.NewestFirst}},
		{name: "nil", opts: nil, want: []string{
			"no shape: set one of PerSecond, PerWindow, Concurrency or Adaptive",
		}},
		{name: "no shape", opts: &limit.Options{Name: "api", QueueLimit: 3}, want: []string{
			"no shape: set one of PerSecond, PerWindow, Concurrency or Adaptive",
		}},
		{name: "two shapes", opts: &limit.Options{PerSecond: &limit.PerSecondOptions{Permits: 100}, Concurrency: 20}, want: []string{
			"PerSecond and Concurrency are set: set exactly one shape",
		}},
		{
			name: "every problem at once",
			opts: &limit.Options{
				PerSecond:   &limit.PerSecondOptions{Permits: 0, Burst: -1},
				PerWindow:   &limit.PerWindowOptions{Permits: -5, Window: 0, Segments: 33},
				Concurrency: -1,
				Adaptive:    &adaptive.Options{Maximum: 10, Multiple: 0.5},
				QueueLimit:  -1,
				QueueOrder:  7,
			},
			want: []string{
				"PerSecond, PerWindow, Concurrency and Adaptive are set: set exactly one shape",
				"PerSecond.Permits 0 must lie between 1 and 1000000000",
				"PerSecond.Burst -1 must lie between 1 and 1000000000 (0 means Permits)",
				"PerWindow.Permits -5 must be at least 1",
				"PerWindow.Segments 33 must lie between 1 and 32 (0 means 8)",
				"PerWindow.Window 0s must be positive",
				"Concurrency -1 must be at least 1",
				"Adaptive.Initial 20 (default) must lie between Minimum 4 (default) and Maximum 10",
				"Adaptive.Multiple 0.5 must be a finite number above 1",
				"QueueLimit -1 must not be negative",
				"QueueOrder 7 is neither OldestFirst nor NewestFirst",
			},
		},
		{name: "rate above one per nanosecond", opts: &limit.Options{PerSecond: &limit.PerSecondOptions{Permits: limit.MaxRate + 1, Burst: limit.MaxRate + 1}}, want: []string{
			"PerSecond.Permits 1000000001 must lie between 1 and 1000000000",
			"PerSecond.Burst 1000000001 must lie between 1 and 1000000000 (0 means Permits)",
		}},
		{name: "segments shorter than the kernel keeps", opts: &limit.Options{PerWindow: &limit.PerWindowOptions{Permits: 1, Window: 7 * time.Millisecond}}, want: []string{
			"PerWindow.Window 7ms in 8 segments makes segments shorter than 1ms",
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.opts.Validate()
			var got []string
			if oe, ok := limit.AsOptionsError(err); ok {
				got = oe.Problems
			}
			if !slices.Equal(got, tt.want) || (err != nil) != (tt.want != nil) {
				t.Fatalf("Validate() = %v\nproblems %q\nwant      %q", err, got, tt.want)
			}
		})
	}
}

func TestOptionsError(t *testing.T) {
	_, err := limit.New(limit.Options{Concurrency: 1, PerWindow: &limit.PerWindowOptions{Permits: 1, Window: time.Second}})
	if !errors.Is(err, limit.ErrInvalidOptions) {
		t.Fatalf("New: %v; want ErrInvalidOptions", err)
	}
	want := "invalid limiter options: PerWindow and Concurrency are set: set exactly one shape"
	if err.Error() != want {
		t.Fatalf("Error() = %q; want %q", err, want)
	}
}

func TestConveniences(t *testing.T) {
	tests := []struct {
		name      string
		l         *limit.Local
		wantName  string
		wantLimit int
	}{
		{"PerSecond", limit.PerSecond(100), "perSecond", 100},
		{"PerWindow", limit.PerWindow(1000, time.Minute), "perWindow", 1000},
		{"Concurrency", limit.Concurrency(20), "concurrency", 20},
		{"Adaptive starts at adaptive's Initial", limit.Adaptive(200), "adaptive", adaptive.DefaultInitial},
		{"Adaptive below the default Initial starts at its maximum", limit.Adaptive(10), "adaptive", 10},
		{"Adaptive below the default Minimum", limit.Adaptive(2), "adaptive", 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if tt.l.Name() != tt.wantName || tt.l.Limit() != tt.wantLimit {
				t.Fatalf("name %q, limit %d; want %q, %d", tt.l.Name(), tt.l.Limit(), tt.wantName, tt.wantLimit)
			}
		})
	}
}

func TestConveniencesPanicOnBadArguments(t *testing.T) {
	for name, f := range map[string]func(){
		"PerSecond(0)":         func() { limit.PerSecond(0) },
		"PerWindow(1, 0)":      func() { limit.PerWindow(1, 0) },
		"Concurrency(-1)":      func() { limit.Concurrency(-1) },
		"Concurrency(0)":       func() { limit.Concurrency(0) },
		"Adaptive(0)":          func() { limit.Adaptive(0) },
		"PerSecond(MaxRate+1)": func() { limit.PerSecond(limit.MaxRate + 1) },
	} {
		t.Run(name, func(t *testing.T) {
			defer func() {
				err, _ := recover().(error)
				if !errors.Is(err, limit.ErrInvalidOptions) {
					t.Fatalf("panicked with %v; want an invalid-options error", err)
				}
			}()
			f()
		})
	}
}

func TestNames(t *testing.T) {
	for o := limit.Outcome(0); o.Valid(); o++ {
		if s := o.String(); s == "" || strings.HasPrefix(s, "Outcome(") {
			t.Errorf("Outcome(%d) has no name", o)
		}
	}
	if got := limit.Outcome(2).String(); got != "Outcome(2)" || limit.Outcome(2).Valid() {
		t.Errorf("the outcome past the last is %q, valid %t", got, limit.Outcome(2).Valid())
	}
	if limit.Acquired.String() != "acquired" || limit.Denied.String() != "denied" {
		t.Errorf("outcome label values changed: %q, %q", limit.Acquired, limit.Denied)
	}
	if got := limit.QueueOrder(2).String(); got != "QueueOrder(2)" {
		t.Errorf("QueueOrder(2) prints %q", got)
	}
	if limit.OldestFirst.String() != "oldest first" || limit.NewestFirst.String() != "newest first" {
		t.Error("queue orders have lost their names")
	}
}
