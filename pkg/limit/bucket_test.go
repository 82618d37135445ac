package limit

import (
	"math/rand/v2"
	"testing"
	"time"
)

// t0 is the fixed instant every step table starts from; t1…t9 follow it at
// the table's own step.
var t0 = time.Date(2025, time.January, 1, 0, 0, 0, 0, time.UTC)

// steps returns t0…t9 spaced d apart.
func steps(d time.Duration) (t [10]time.Time) {
	for i := range t {
		t[i] = t0.Add(time.Duration(i) * d)
	}
	return t
}

// take is one call at an instant and the wait it must return: 0 admits.
type take struct {
	at   time.Time
	wait time.Duration
}

func TestTokenBucket(t *testing.T) {
	d := steps(100 * time.Millisecond) // one token at 10/s
	s := steps(time.Second)
	tests := []struct {
		name         string
		rate, burst  int
		takes        []take
		tokensAfter  int64 // billionths, after the last take
		checkBalance bool
	}{{
		name: "burst 1 at 10/s: one per 100ms",
		rate: 10, burst: 1,
		takes: []take{
			{d[0], 0},
			{d[0], 100 * time.Millisecond},
			{d[0].Add(40 * time.Millisecond), 60 * time.Millisecond},
			{d[1], 0},
			{d[1], 100 * time.Millisecond},
			{d[3], 0}, // two tokens' worth of time, but the bucket holds one
			{d[3], 100 * time.Millisecond},
		},
	}, {
		name: "burst defaults to a second's worth, spent at once",
		rate: 3, burst: 3,
		takes: []take{
			{s[0], 0}, {s[0], 0}, {s[0], 0},
			{s[0], 333_333_334}, // ⌈1e9 / 3⌉
		},
	}, {
		name: "fractional intervals are exact, never early",
		rate: 3, burst: 1,
		takes: []take{
			{s[0], 0},
			{s[0].Add(333_333_333), 1}, // 999,999,999 billionths: 1ns short
			{s[0].Add(333_333_334), 0}, // 1,000,000,002, capped at one permit
			{s[0].Add(666_666_667), 1}, // so the cap's 2 billionths are gone
			{s[0].Add(666_666_668), 0},
			{s[0].Add(666_666_668), 333_333_334},
		},
	}, {
		name: "a burst keeps the fractions",
		rate: 3, burst: 2,
		takes: []take{
			{s[0], 0}, {s[0], 0},
			{s[0].Add(333_333_334), 0}, // 1,000,000,002: 2 left over
			{s[0].Add(666_666_667), 0}, // 2 + 999,999,999
			{s[0].Add(666_666_667), 333_333_333},
		},
		tokensAfter: 1, checkBalance: true,
	}, {
		name: "time never goes backwards",
		rate: 10, burst: 2,
		takes: []take{
			{d[0], 0}, {d[0], 0},
			{d[5], 0}, // full again: 2 tokens, 1 left
			// A stale instant refills nothing and does not move the clock
			// back, so the next refill is counted from d[5], once.
			{d[2], 0},
			{d[2], 100 * time.Millisecond},
			{d[6], 0},
			{d[6], 100 * time.Millisecond},
		},
	}, {
		name: "an instant before the bucket was made refills nothing",
		rate: 1, burst: 1,
		takes: []take{
			{s[0].Add(-time.Hour), 0},
			{s[0].Add(-time.Hour), time.Second},
			{s[1], 0},
		},
	}, {
		name: "a bucket slower to fill than 100s fills all the way",
		rate: 1, burst: 1000,
		takes: append(n(1000, take{s[0], 0}),
			take{s[0], time.Second},
			take{s[0].Add(1000 * time.Second), 0},
		),
		tokensAfter: 999 * nsPerSec, checkBalance: true,
	}, {
		name: "the largest bucket after a century idle does not overflow",
		rate: MaxRate, burst: MaxRate,
		takes: []take{
			{s[0], 0},
			{s[0].Add(100 * 365 * 24 * time.Hour), 0},
			{s[0].Add(100*365*24*time.Hour + 1), 0},
		},
		tokensAfter: MaxRate*nsPerSec - nsPerSec, checkBalance: true,
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := newTokenBucket(t0, tt.rate, tt.burst)
			for i, tk := range tt.takes {
				if got := b.take(tk.at); got != tk.wait {
					t.Fatalf("take %d at t0%+v: wait %v; want %v", i, tk.at.Sub(t0), got, tk.wait)
				}
			}
			if tt.checkBalance && b.tokens != tt.tokensAfter {
				t.Fatalf("tokens %d; want %d", b.tokens, tt.tokensAfter)
			}
		})
	}
}

func n(count int, tk take) []take {
	out := make([]take, count)
	for i := range out {
		out[i] = tk
	}
	return out
}

// TestTokenBucketBound checks the promise itself on random traffic: in any
// interval [a, b] of a run, no more than burst + rate × (b - a) permits, and
// never a wait that admits early.
func TestTokenBucketBound(t *testing.T) {
	for seed := range uint64(20) {
		r := rand.New(rand.NewPCG(seed, 1))
		rate, burst := 1+r.IntN(50), 1+r.IntN(20)
		b := newTokenBucket(t0, rate, burst)
		var admitted []time.Duration
		at := time.Duration(0)
		for range 2000 {
			at += time.Duration(r.Int64N(int64(2 * time.Second / time.Duration(rate))))
			wait := b.take(t0.Add(at))
			if wait == 0 {
				admitted = append(admitted, at)
				continue
			}
			// One nanosecond before the wait is up is still too early.
			probe := b
			if early := probe.take(t0.Add(at + wait - 1)); wait > 1 && early == 0 {
				t.Fatalf("seed %d: wait %v at %v, but admitted 1ns before it was up", seed, wait, at)
			}
			if w := probe.take(t0.Add(at + wait)); w != 0 {
				t.Fatalf("seed %d: wait %v at %v, then refused again (%v)", seed, wait, at, w)
			}
		}
		for i := range admitted {
			for j := i; j < len(admitted); j++ {
				span := admitted[j] - admitted[i]
				most := int64(burst) + int64(span)*int64(rate)/nsPerSec
				if int64(j-i+1) > most {
					t.Fatalf("seed %d: %d permits in %v at %d/s, burst %d", seed, j-i+1, span, rate, burst)
				}
			}
		}
	}
}

func TestTokenBucketRefund(t *testing.T) {
	b := newTokenBucket(t0, 1, 2)
	b.take(t0)
	b.refund()
	b.refund() // never past the cap
	if b.tokens != 2*nsPerSec {
		t.Fatalf("tokens %d after refunds; want the cap %d", b.tokens, 2*nsPerSec)
	}
}
