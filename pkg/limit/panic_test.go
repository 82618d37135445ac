package limit_test

import (
	"context"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/egressd/egressd/pkg/adaptive"
	"github.com/egressd/egressd/pkg/limit"
)

// panicky is an Observer with a bug: once armed, the method named in panics.
type panicky struct {
	in    string // "OnLease", "OnWait" or "OnLimit"
	armed atomic.Bool
}

func (o *panicky) bug(method string) {
	if o.in == method && o.armed.Load() {
		panic("observer bug in " + method)
	}
}

func (o *panicky) OnLease(limit.Outcome) { o.bug("OnLease") }
func (o *panicky) OnWait(time.Duration)  { o.bug("OnWait") }
func (o *panicky) OnLimit(int)           { o.bug("OnLimit") }

// panics runs f and reports whether it panicked, as net/http's per-request
// recover would let a server carry on.
func panics(f func()) (panicked bool) {
	defer func() { panicked = recover() != nil }()
	f()
	return false
}

// An observer that panics as a permit is handed over gives the permit back:
// the caller never gets the lease, so nobody else would, and before, each
// such panic shrank the bulkhead for good.
func TestObserverPanicGivesPermitBack(t *testing.T) {
	tests := []struct {
		name  string
		in    string
		queue int
	}{
		{"no queue", "OnLease", 0},
		{"queue", "OnLease", 1},
		{"queue, OnWait", "OnWait", 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			obs := &panicky{in: tt.in}
			l := mustNew(t, limit.Options{Concurrency: 1, QueueLimit: tt.queue, Observer: obs})
			obs.armed.Store(true)
			if !panics(func() { _, _ = l.Acquire(context.Background()) }) {
				t.Fatal("the observer's panic did not reach Acquire's caller")
			}
			obs.armed.Store(false)
			wantPermitBack(t, l)
		})
	}
}

// A rate permit too: its token (or its count in the window) goes back, so
// that the next caller, on a clock that has not moved, is admitted.
func TestObserverPanicGivesRatePermitBack(t *testing.T) {
	tests := []struct {
		name string
		opts limit.Options
	}{
		{"per second", limit.Options{PerSecond: &limit.PerSecondOptions{Permits: 1, Burst: 1}}},
		{"per second, queue", limit.Options{PerSecond: &limit.PerSecondOptions{Permits: 1, Burst: 1}, QueueLimit: 1}},
		{"per window", limit.Options{PerWindow: &limit.PerWindowOptions{Permits: 1, Window: time.Hour}}},
		{"per window, queue", limit.Options{PerWindow: &limit.PerWindowOptions{Permits: 1, Window: time.Hour}, QueueLimit: 1}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				obs := &panicky{in: "OnLease"}
				opts := tt.opts
				opts.Observer = obs
				l := mustNew(t, opts)
				obs.armed.Store(true)
				if !panics(func() { _, _ = l.Acquire(context.Background()) }) {
					t.Fatal("the observer's panic did not reach Acquire's caller")
				}
				obs.armed.Store(false)
				ctx, cancel := context.WithCancel(context.Background())
				cancel() // a queue must not wait: the permit is free now or never
				if _, err := l.Acquire(ctx); err != nil {
					t.Fatalf("Acquire after the panic = %v; want the permit back", err)
				}
			})
		})
	}
}

// The same for a caller served from the queue once a lease comes back.
func TestObserverPanicAfterWaitGivesPermitBack(t *testing.T) {
	synctest.Test(t, testObserverPanicAfterWaitGivesPermitBack)
}

func testObserverPanicAfterWaitGivesPermitBack(t *testing.T) {
	obs := &panicky{in: "OnLease"}
	l := mustNew(t, limit.Options{Concurrency: 1, QueueLimit: 1, Observer: obs})
	held, err := l.Acquire(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan bool)
	go func() { done <- panics(func() { _, _ = l.Acquire(context.Background()) }) }()
	synctest.Wait() // queued
	obs.armed.Store(true)
	held.Release() // serves the waiter, whose observer panics
	if !<-done {
		t.Fatal("the observer's panic did not reach the waiter")
	}
	obs.armed.Store(false)
	wantPermitBack(t, l)
}

// wantPermitBack checks that l, a bulkhead of one whose only lease's
// Acquire panicked, has its permit back.
func wantPermitBack(t *testing.T, l *limit.Local) {
	t.Helper()
	if l.InFlight() != 0 {
		t.Fatalf("%d in flight after the only lease's Acquire panicked", l.InFlight())
	}
	lease, err := l.Acquire(context.Background())
	if err != nil {
		t.Fatalf("Acquire after the panic = %v; want the permit back", err)
	}
	lease.Release()
}

// An OnChange or OnLimit that panics in the Release that moved the limit
// still frees that Release's permit: the lease is spent by then, so there is
// nothing left to release it with.
func TestLimitChangePanicFreesPermit(t *testing.T) {
	adaptiveOpts := func(onChange func(int, int)) *adaptive.Options {
		return &adaptive.Options{Minimum: 1, Initial: 1, Maximum: 5,
			ProbeEvery: adaptive.NoProbes, Baseline: time.Hour, OnChange: onChange}
	}
	tests := []struct {
		name string
		opts func(obs *panicky) limit.Options
	}{
		{"OnChange", func(obs *panicky) limit.Options {
			return limit.Options{Adaptive: adaptiveOpts(func(int, int) { obs.bug("OnLimit") })}
		}},
		{"OnChange, queue", func(obs *panicky) limit.Options {
			return limit.Options{Adaptive: adaptiveOpts(func(int, int) { obs.bug("OnLimit") }), QueueLimit: 1}
		}},
		{"OnLimit", func(obs *panicky) limit.Options {
			return limit.Options{Adaptive: adaptiveOpts(nil), Observer: obs}
		}},
		{"OnLimit, queue", func(obs *panicky) limit.Options {
			return limit.Options{Adaptive: adaptiveOpts(nil), Observer: obs, QueueLimit: 1}
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			obs := &panicky{in: "OnLimit"}
			l := mustNew(t, tt.opts(obs))
			lease, err := l.Acquire(context.Background()) // the last permit: the round was constrained
			if err != nil {
				t.Fatal(err)
			}
			obs.armed.Store(true)
			if !panics(lease.Release) { // a fast round of one at a limit of 1: it grows
				t.Fatal("the limit did not move, or its callback's panic did not reach Release")
			}
			obs.armed.Store(false)
			if l.InFlight() != 0 || l.Limit() != 2 {
				t.Fatalf("%d in flight at a limit of %d after the only lease's Release panicked; want 0 at 2",
					l.InFlight(), l.Limit())
			}
		})
	}
}
