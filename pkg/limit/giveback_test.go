package limit

import (
	"testing"
	"time"
)

// TestGiveBack covers the race a test cannot time: a waiter granted a permit
// in the same instant its context ended. The permit must reach the next
// waiter, or come back, never leak.
func TestGiveBack(t *testing.T) {
	tests := []struct {
		name string
		opts Options
	}{
		{"concurrency", Options{Concurrency: 1}},
		{"per second", Options{PerSecond: &PerSecondOptions{Permits: 1}}},
		{"per window", Options{PerWindow: &PerWindowOptions{Permits: 1, Window: 8 * time.Second}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			clock := NewFakeClock(t0)
			tt.opts.Clock, tt.opts.QueueLimit = clock, 2
			l, err := New(tt.opts)
			if err != nil {
				t.Fatal(err)
			}
			l.mu.Lock()
			defer l.mu.Unlock()
			if ok, _ := l.take(0); !ok {
				t.Fatal("first take refused")
			}
			first, second := &waiter{ready: make(chan struct{})}, &waiter{ready: make(chan struct{})}
			l.queue.push(first)
			l.queue.push(second)
			// The permit comes back (a release, or time passing) and
			// goes to the first waiter.
			l.inFlight.Add(-int64(min(l.InFlight(), 1)))
			clock.Jump(8 * time.Second)
			l.dispatch(l.tick())
			if !first.done || second.done {
				t.Fatalf("first served %t, second %t; want only the first", first.done, second.done)
			}
			// Its context ended as it was served: the permit goes on.
			l.giveBack(first)
			if !second.done || second.err != nil || l.queue.len != 0 {
				t.Fatalf("second served %t (%v), %d queued; want it served", second.done, second.err, l.queue.len)
			}
			// And when nobody waits, it comes back to the limiter.
			l.giveBack(second)
			if ok, _ := l.take(l.tick()); !ok {
				t.Fatal("the permit given back with no one waiting is lost")
			}
		})
	}
}
