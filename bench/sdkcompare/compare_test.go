package main

import (
	"context"
	"errors"
	"testing"

	"github.com/failsafe-go/failsafe-go"

	"github.com/egressd/egressd/pkg/sdk"
)

// BenchmarkPerSecond prints each limiter pair side by side:
//
//	go test -bench . -benchmem
func BenchmarkPerSecond(b *testing.B) {
	for _, p := range limiterPairs {
		b.Run(p.name+"/limit", p.ours)
		b.Run(p.name+"/x-time-rate", p.theirs)
	}
}

// BenchmarkRun prints each sdk.Run pair side by side:
//
//	go test -bench Run -benchmem
func BenchmarkRun(b *testing.B) {
	for _, p := range runPairs {
		b.Run(p.name+"/sdk", p.ours)
		b.Run(p.name+"/failsafe-go", p.theirs)
	}
}

var errFlaky = errors.New("flaky")

// TestFailsafeShapes checks that the failsafe-go executors the benchmarks
// time do what they stand in for: succeed on the success path, retry a
// failing callback up to three attempts, and (with a breaker) open after
// five consecutive failures - so the comparison is with working guards.
func TestFailsafeShapes(t *testing.T) {
	ctx := context.Background()
	for _, c := range []struct {
		name    string
		e       func() failsafe.Executor[int]
		breaker bool
	}{
		{"retry", failsafeRetry, false},
		{"retry+breaker", failsafeRetryBreaker, true},
		{"retry+budget+breaker", failsafeRetryBudgetBreaker, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			if v, err := c.e().WithContext(ctx).Get(failsafeWork(ctx)); err != nil || v != workValue {
				t.Fatalf("success path: got %d, %v", v, err)
			}
			// Retries: the first two attempts fail, the third succeeds. The
			// shaped policies back off 100ms then 200ms (±50%).
			calls := 0
			v, err := c.e().Get(func() (int, error) {
				if calls++; calls < 3 {
					return 0, errFlaky
				}
				return workValue, nil
			})
			if err != nil || v != workValue || calls != 3 {
				t.Fatalf("retries: got %d, %v after %d calls, want %d after 3", v, err, calls, workValue)
			}
			if !c.breaker {
				return
			}
			// The breaker: consecutive failures across calls open it. The
			// first call fails three attempts and the second fails two more;
			// then the breaker refuses without calling.
			e := c.e()
			calls = 0
			for range 2 {
				_, _ = e.Get(func() (int, error) { calls++; return 0, errFlaky })
			}
			if calls != 5 {
				t.Fatalf("breaker: %d calls reached the callback, want 5", calls)
			}
		})
	}
}

// TestRunShapes checks the SDK side of each pair: one successful attempt.
func TestRunShapes(t *testing.T) {
	for _, newPolicy := range []func() *sdk.Policy{sdk.Defaults, zeroPolicy} {
		r := sdk.Try(context.Background(), newPolicy(), work)
		if r.Err != nil || r.Value != workValue || len(r.Attempts) != 1 || r.Stop != sdk.StopSuccess {
			t.Fatalf("got %+v, want %d after one attempt", r, workValue)
		}
	}
}

// TestPairs runs every benchmark once, so a broken pair fails go test.
func TestPairs(t *testing.T) {
	if testing.Short() {
		t.Skip("runs benchmarks")
	}
	for _, tb := range []table{limiterTable, runTable} {
		for _, p := range tb.pairs {
			for _, f := range []func(*testing.B){p.ours, p.theirs} {
				if r := testing.Benchmark(f); r.N == 0 {
					t.Errorf("%s: %s: the benchmark failed", tb.title, p.name)
				}
			}
		}
	}
}

// TestHedgeComparison runs the hedging comparison small: every call
// succeeds, every hedger's requests are counted, and the unhedged one
// sends exactly one request per call.
func TestHedgeComparison(t *testing.T) {
	hs, stats, err := compareHedging(400, 2)
	if err != nil {
		t.Fatal(err)
	}
	for i, h := range hs {
		s := stats[i]
		if s.failed != 0 || s.calls != 400 || len(s.latencies) != 400 || s.requests < s.calls {
			t.Errorf("%s: %d failed, %d calls, %d latencies, %d requests", h.name, s.failed, s.calls, len(s.latencies), s.requests)
		}
	}
	if stats[0].requests != stats[0].calls {
		t.Errorf("no hedging sent %d requests for %d calls", stats[0].requests, stats[0].calls)
	}
}
