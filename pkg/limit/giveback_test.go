package limit

import (
	"context"
	"testing"
	"testing/synctest"
	"time"

	"github.com/egressd/egressd/internal/clocktest"
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
			synctest.Test(t, func(t *testing.T) {
				tt.opts.QueueLimit = 2
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
				clocktest.Advance(8 * time.Second)
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
		})
	}
}

// TestQueueNoBarging: a newcomer arriving when a token is due but the
// wake-up that serves the queue has not run yet does not take the token
// from the waiter in front of it. No fake clock can hold back a timer
// that is due, so the test stops the wake-up and runs it by hand, late.
func TestQueueNoBarging(t *testing.T) { synctest.Test(t, testQueueNoBarging) }

func testQueueNoBarging(t *testing.T) {
	l, err := New(Options{PerSecond: &PerSecondOptions{Permits: 1}, QueueLimit: 1})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := l.Acquire(ctx); err != nil {
		t.Fatal(err)
	}
	first, late := make(chan error, 1), make(chan error, 1)
	go func() { _, err := l.Acquire(ctx); first <- err }()
	synctest.Wait() // queued, with a wake-up armed for when the token is due
	l.mu.Lock()
	stopped, gen := l.timer.t.Stop(), l.timer.gen
	l.mu.Unlock()
	if !stopped {
		t.Fatal("no wake-up was pending for the waiter")
	}
	clocktest.Advance(time.Second) // the token is due; the wake-up has not run
	go func() { _, err := l.Acquire(ctx); late <- err }()
	// The newcomer serves the waiter in front of it, then waits itself.
	if err := <-first; err != nil {
		t.Fatalf("waiter: %v; want it served by the newcomer's arrival", err)
	}
	synctest.Wait()
	select {
	case err := <-late:
		t.Fatalf("the newcomer took a permit (%v); want it queued behind the waiter", err)
	default:
	}
	if l.Queued() != 1 {
		t.Fatalf("%d queued; want the newcomer", l.Queued())
	}
	l.fire(gen) // the late wake-up: it serves nobody yet, and arms the next
	clocktest.Advance(time.Second)
	if err := <-late; err != nil {
		t.Fatalf("newcomer: %v", err)
	}
}
