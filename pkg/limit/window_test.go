package limit

import (
	"math/rand/v2"
	"testing"
	"time"
)

func TestWindow(t *testing.T) {
	s := steps(time.Second) // one segment of an 8s window in 8
	tests := []struct {
		name     string
		limit    int
		length   time.Duration
		segments int
		takes    []take
	}{{
		name:  "full at once: wait for the whole window",
		limit: 4, length: 8 * time.Second, segments: 8,
		takes: []take{
			{s[0], 0}, {s[0], 0}, {s[0], 0}, {s[0], 0},
			{s[0], 8 * time.Second},
			{s[0].Add(500 * time.Millisecond), 7500 * time.Millisecond},
			{s[7].Add(999_999_999), 1},
			{s[8], 0}, // segment 0 has left
		},
	}, {
		name:  "the oldest counted segment sets the wait",
		limit: 4, length: 8 * time.Second, segments: 8,
		takes: []take{
			{s[0], 0}, {s[3], 0}, {s[5], 0}, {s[5], 0},
			{s[6], 2 * time.Second}, // segment 0 leaves at 8s
			{s[8], 0},               // it has: 3 counted, room for one
			{s[8], 3 * time.Second}, // segment 3 leaves at 11s
		},
	}, {
		// A fixed window would take 4 at 7.9s and 4 more at 8s.
		name:  "a quota cannot be spent twice across a boundary",
		limit: 4, length: 8 * time.Second, segments: 8,
		takes: []take{
			{s[7].Add(900 * time.Millisecond), 0},
			{s[7].Add(900 * time.Millisecond), 0},
			{s[7].Add(900 * time.Millisecond), 0},
			{s[7].Add(900 * time.Millisecond), 0},
			{s[8], 7 * time.Second},
			{s[9], 6 * time.Second},
		},
	}, {
		name:  "segments that do not divide the window round down, as in the kernel",
		limit: 1, length: 10 * time.Second, segments: 3, // 3,333,333,333ns each
		takes: []take{
			{s[0], 0},
			{s[0], 9_999_999_999},
			{s[0].Add(9_999_999_999), 0},
		},
	}, {
		name:  "one segment is a fixed window",
		limit: 2, length: time.Second, segments: 1,
		takes: []take{
			{s[0].Add(900 * time.Millisecond), 0},
			{s[0].Add(900 * time.Millisecond), 0},
			{s[0].Add(900 * time.Millisecond), 100 * time.Millisecond},
			{s[1], 0},
		},
	}, {
		name:  "time never goes backwards: a stale instant cannot reset a newer slot",
		limit: 2, length: 2 * time.Second, segments: 2,
		takes: []take{
			{s[2].Add(500 * time.Millisecond), 0}, // segment 2, slot 0
			// Segment 0 also maps to slot 0; taken as 2.5s, it counts
			// in segment 2 rather than wiping it.
			{s[0].Add(500 * time.Millisecond), 0},
			{s[2].Add(500 * time.Millisecond), 1500 * time.Millisecond},
		},
	}, {
		name:  "an idle spell longer than the window forgets everything",
		limit: 1, length: 2 * time.Second, segments: 2,
		takes: []take{
			{s[0], 0},
			{s[0].Add(time.Hour), 0},
			{s[0].Add(time.Hour), 2 * time.Second},
		},
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := newWindow(t0, tt.limit, tt.length, tt.segments)
			for i, tk := range tt.takes {
				if got := w.take(tk.at); got != tk.wait {
					t.Fatalf("take %d at t0%+v: wait %v; want %v", i, tk.at.Sub(t0), got, tk.wait)
				}
			}
		})
	}
}

// TestWindowBound checks the promise on random traffic: no more than limit
// permits in any span shorter than the window's segments reach, and a wait is
// never too short.
func TestWindowBound(t *testing.T) {
	for seed := range uint64(20) {
		r := rand.New(rand.NewPCG(seed, 2))
		limit, segments := 1+r.IntN(10), 1+r.IntN(MaxSegments)
		length := time.Duration(segments) * time.Duration(1+r.IntN(100)) * time.Millisecond
		w := newWindow(t0, limit, length, segments)
		seg := length / time.Duration(segments)
		var admitted []time.Duration
		at := time.Duration(0)
		for range 2000 {
			at += time.Duration(r.Int64N(int64(2 * length / time.Duration(limit))))
			wait := w.take(t0.Add(at))
			if wait == 0 {
				admitted = append(admitted, at)
				continue
			}
			probe := w
			if early := probe.take(t0.Add(at + wait - 1)); early == 0 {
				t.Fatalf("seed %d: wait %v at %v, but admitted 1ns before it was up", seed, wait, at)
			}
			if got := probe.take(t0.Add(at + wait)); got != 0 {
				t.Fatalf("seed %d: wait %v at %v, then refused again (%v)", seed, wait, at, got)
			}
		}
		// Permits count until their segment leaves, so any span of
		// (segments-1) whole segments plus the part of one holds at most
		// limit: take the strictest, the segment count times the length
		// minus one segment.
		span := time.Duration(segments-1) * seg
		for i := range admitted {
			j := i
			for j < len(admitted) && admitted[j]-admitted[i] <= span {
				j++
			}
			if j-i > limit {
				t.Fatalf("seed %d: %d permits within %v; limit %d per %v in %d segments", seed, j-i, span, limit, length, segments)
			}
		}
	}
}

func TestWindowRefund(t *testing.T) {
	w := newWindow(t0, 1, 8*time.Second, 8)
	w.take(t0)
	seg := w.taken
	w.refund(seg)
	if got := w.take(t0); got != 0 {
		t.Fatalf("after a refund: wait %v; want 0", got)
	}
	// A segment that has left its slot is not refunded into the new one.
	w.take(t0.Add(8 * time.Second))
	w.refund(seg)
	if got := w.take(t0.Add(8 * time.Second)); got == 0 {
		t.Fatal("a stale refund freed a permit in a newer segment")
	}
}
