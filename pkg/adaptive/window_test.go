package adaptive

import (
	"testing"
	"time"
)

// A window holds a slot for each ten seconds in which it was called, and
// gives a slot back when it leaves the five minutes: a Controller called
// now and then holds a few slots, not thirty.
func TestWindowHoldsSlotsOnlyForCalls(t *testing.T) {
	held := func(w *window) (n int) {
		for _, s := range w.slot {
			if s != nil {
				n++
			}
		}
		return n
	}
	t0 := time.Unix(1_000_000, 0)
	var w window
	steps := []struct {
		at    time.Duration // since t0
		calls int           // recorded at that instant
		slots int           // held after them
		n     uint64        // calls in the window
	}{
		{0, 3, 1, 3},
		{5 * time.Second, 1, 1, 4},
		{time.Minute, 1, 2, 5},
		{2 * time.Minute, 1, 3, 6},
		// t0's slot leaves once its five minutes have passed.
		{5*time.Minute + 10*time.Second, 1, 3, 3},
		{11 * time.Minute, 1, 1, 1}, // a long idle spell empties it
	}
	for _, s := range steps {
		for range s.calls {
			w.record(t0.Add(s.at), time.Millisecond)
		}
		if got := held(&w); got != s.slots || w.n != s.n {
			t.Errorf("at +%v: %d slots holding %d calls, want %d slots holding %d", s.at, got, w.n, s.slots, s.n)
		}
	}
}
