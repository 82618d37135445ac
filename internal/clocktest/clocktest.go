// Package clocktest is how egressd's tests deal with time.
//
// The module has no clock interface. Arithmetic on time takes the instant
// as an argument (now time.Time), as golang.org/x/time/rate does, and is
// table-tested at fixed instants; everything else reads the real clock:
// time.Now, time.Since, timers and context deadlines. A test of timing
// behaviour runs inside a testing/synctest bubble, where that real clock
// is fake: it moves only when every goroutine in the bubble is blocked,
// and [Advance] moves it on by a given amount. A test that talks to a
// real peer - Redis, a TCP server, the kernel - cannot run in a bubble;
// it waits for what it expects with [Eventually], never for a fixed time.
package clocktest

import (
	"context"
	"testing"
	"testing/synctest"
	"time"
)

// Advance moves the fake clock of the calling goroutine's synctest bubble
// on by d, firing the timers it passes, and returns once every goroutine
// those wake has run until it blocks again. It panics outside a bubble
// (synctest.Wait does, before anything else), so it can never sleep in
// real time.
func Advance(d time.Duration) {
	synctest.Wait()
	time.Sleep(d) // fake time: returns once the bubble's clock has moved d
	synctest.Wait()
}

// bubbleStart is where a synctest bubble's clock starts, as
// testing/synctest documents: midnight UTC on 2000-01-01.
var bubbleStart = time.Date(2000, time.January, 1, 0, 0, 0, 0, time.UTC)

// Latency is the work of a simulated dependency - a handler, a
// RoundTripper, a callback - that takes d: it returns nil after d of the
// bubble's fake time, or ctx's error as soon as ctx ends. It is for
// goroutines other than the test's, which Advance is not (synctest.Wait
// must not run on two at once). It panics unless the clock reads within a
// year of a bubble's start, so that it never waits in real time.
func Latency(ctx context.Context, d time.Duration) error {
	if now := time.Now(); now.Before(bubbleStart) || !now.Before(bubbleStart.AddDate(1, 0, 0)) {
		panic("clocktest.Latency outside a synctest bubble")
	}
	select {
	case <-time.After(d): // collected once unreachable, fired or not (Go 1.23)
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Within is how long Eventually waits before it fails the test: far longer
// than any condition of a healthy test takes on a loaded machine.
const Within = 20 * time.Second

// Eventually waits until cond holds, checking it at once and then at short
// intervals, and fails the test with what it waited for if it does not
// hold within [Within]. It is for a real peer (Redis, a TCP server, a
// process) whose progress no synctest bubble can see; a test on the fake
// clock uses synctest.Wait instead. cond runs on the calling goroutine.
func Eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(Within)
	for wait := 50 * time.Microsecond; !cond(); wait = min(2*wait, 10*time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("still waiting after %v for %s", Within, what)
		}
		time.Sleep(wait)
	}
}
