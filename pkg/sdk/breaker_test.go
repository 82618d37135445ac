package sdk

import (
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/egressd/egressd/pkg/verdict"
)

var (
	ok        = verdict.New(verdict.OK)
	transient = verdict.New(verdict.Transient)
	throttled = verdict.New(verdict.Throttled)
	permanent = verdict.New(verdict.Permanent)
	refused   = verdict.Refused(50 * time.Millisecond)
)

// t0 is the fixed instant the pure tests start at.
var t0 = time.Date(2026, time.January, 1, 0, 0, 0, 0, time.UTC)

// at returns the fixed instant t0 + d.
func at(d time.Duration) time.Time { return t0.Add(d) }

// call is Allow then Record at instant now; it reports whether Allow let
// the attempt through.
func call(b *Breaker, now time.Time, v verdict.Verdict) bool {
	p, allowed := b.Allow(now)
	if allowed {
		b.Record(now, p, v)
	}
	return allowed
}

func TestBreakerOpensOnlyOnTransient(t *testing.T) {
	tests := []struct {
		name      string
		outcomes  []verdict.Verdict
		wantState BreakerState
	}{
		{"three transients open", []verdict.Verdict{transient, transient, transient}, BreakerOpen},
		{"two transients do not", []verdict.Verdict{transient, transient}, BreakerClosed},
		{"ok resets the count", []verdict.Verdict{transient, transient, ok, transient, transient}, BreakerClosed},
		{"refusals are no evidence", []verdict.Verdict{refused, refused, refused, refused, refused, refused}, BreakerClosed},
		{"server throttling is no evidence", []verdict.Verdict{throttled, throttled, throttled, throttled}, BreakerClosed},
		{"permanent is no evidence", []verdict.Verdict{permanent, permanent, permanent, permanent}, BreakerClosed},
		{"non-evidence does not reset the count", []verdict.Verdict{transient, refused, transient, permanent, throttled, transient}, BreakerOpen},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := NewBreaker(BreakerOptions{FailureThreshold: 3, OpenFor: 5 * time.Second})
			for _, v := range tt.outcomes {
				call(b, t0, v)
			}
			if got := b.State(t0); got != tt.wantState {
				t.Errorf("State = %v, want %v", got, tt.wantState)
			}
		})
	}
}

func TestBreakerHalfOpen(t *testing.T) {
	tests := []struct {
		name string
		// probe is the verdict the first half-open probe comes to.
		probe verdict.Verdict
		// afterProbe is the state right after it.
		afterProbe BreakerState
		// nextAllowed says whether an attempt right after the probe gets in.
		nextAllowed bool
	}{
		{"probe ok closes", ok, BreakerClosed, true},
		{"probe transient re-opens", transient, BreakerOpen, false},
		{"probe refused by a limiter returns its slot", refused, BreakerHalfOpen, true},
		{"probe throttled by the server returns its slot", throttled, BreakerHalfOpen, true},
		{"probe permanent returns its slot", permanent, BreakerHalfOpen, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := NewBreaker(BreakerOptions{FailureThreshold: 1, OpenFor: 5 * time.Second})
			call(b, at(0), transient)
			if call(b, at(4999*time.Millisecond), ok) {
				t.Fatal("open breaker let an attempt through before OpenFor passed")
			}
			p, allowed := b.Allow(at(5 * time.Second))
			if !allowed || !p.Probe() {
				t.Fatalf("Allow after OpenFor = %+v, %v; want a probe", p, allowed)
			}
			if _, again := b.Allow(at(5 * time.Second)); again {
				t.Fatal("half-open breaker let a second probe through with the first in flight")
			}
			b.Record(at(5*time.Second), p, tt.probe)
			if got := b.State(at(5 * time.Second)); got != tt.afterProbe {
				t.Errorf("State after probe = %v, want %v", got, tt.afterProbe)
			}
			if got := call(b, at(5*time.Second), ok); got != tt.nextAllowed {
				t.Errorf("next attempt allowed = %v, want %v", got, tt.nextAllowed)
			}
		})
	}
}

func TestBreakerIgnoresStaleProbes(t *testing.T) {
	b := NewBreaker(BreakerOptions{FailureThreshold: 1, OpenFor: time.Second, HalfOpenProbes: 2})
	call(b, at(0), transient)
	p1, _ := b.Allow(at(time.Second))
	p2, _ := b.Allow(at(time.Second))
	b.Record(at(time.Second), p1, transient) // re-opens
	b.Record(at(time.Second), p2, ok)        // from the previous half-open period
	if got := b.State(at(time.Second)); got != BreakerOpen {
		t.Fatalf("a stale probe's OK changed the state to %v", got)
	}
	// The stale probe must not have freed a slot in the next period either.
	q1, ok1 := b.Allow(at(2 * time.Second))
	_, ok2 := b.Allow(at(2 * time.Second))
	_, ok3 := b.Allow(at(2 * time.Second))
	if !ok1 || !ok2 || ok3 || !q1.Probe() {
		t.Fatalf("half-open admitted %v %v %v, want exactly two probes", ok1, ok2, ok3)
	}
}

func TestBreakerReportsTransitions(t *testing.T) {
	var got []string
	b := NewBreaker(BreakerOptions{
		FailureThreshold: 1,
		OpenFor:          time.Second,
		OnStateChange:    func(from, to BreakerState) { got = append(got, from.String()+"->"+to.String()) },
	})
	call(b, at(0), transient)
	call(b, at(time.Second), refused)
	call(b, at(time.Second), ok)
	want := []string{"closed->open", "open->half-open", "half-open->closed"}
	if !slices.Equal(got, want) {
		t.Fatalf("transitions = %v, want %v", got, want)
	}
}

func TestBreakerDefaults(t *testing.T) {
	b := NewBreaker(BreakerOptions{})
	for range 4 {
		call(b, at(0), transient)
	}
	if got := b.State(at(0)); got != BreakerClosed {
		t.Fatalf("State after 4 transients = %v, want closed", got)
	}
	call(b, at(0), transient)
	if got := b.State(at(4999 * time.Millisecond)); got != BreakerOpen {
		t.Fatalf("State 4.999s after the fifth = %v, want open", got)
	}
	if got := b.State(at(5 * time.Second)); got != BreakerHalfOpen {
		t.Fatalf("State 5s after the fifth = %v, want half-open", got)
	}
}

// TestBreakerOpensUnderConcurrentCalls: Allow in the closed state and a
// Record with nothing to change take no lock, so a breaker that opens while
// other goroutines call through it must still be seen open by each of
// them once it has opened. The race detector checks the publication.
func TestBreakerOpensUnderConcurrentCalls(t *testing.T) {
	b := NewBreaker(BreakerOptions{FailureThreshold: 3, OpenFor: time.Hour})
	opened := make(chan struct{})
	errs := make(chan string, 8)
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for {
				select {
				case <-opened:
					if call(b, t0, throttled) {
						errs <- "an attempt was allowed after the breaker opened"
					}
					return
				default:
					call(b, t0, throttled)
				}
			}
		})
	}
	for i := range 3 {
		if !call(b, t0, transient) {
			// Not Fatal: the callers must still be told to stop.
			t.Errorf("the breaker opened at transient %d, before its threshold", i+1)
			break
		}
	}
	close(opened)
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
}
