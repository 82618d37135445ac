package adaptive_test

import (
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/egressd/egressd/pkg/adaptive"
)

// TestBaselineAccuracy compares the histogram's 10th percentile with the exact
// one (nearest rank over the sorted calls) on seeded random data. The package
// promises 2%; the bucket layout bounds the error at 1/64 (1.5625%), and this
// holds it to that.
func TestBaselineAccuracy(t *testing.T) {
	const seeds = 20
	distributions := []struct {
		name string
		draw func(r *rand.Rand) time.Duration
	}{
		{"lognormal 5ms σ=1", func(r *rand.Rand) time.Duration {
			return time.Duration(5e6 * math.Exp(r.NormFloat64()))
		}},
		{"lognormal 200µs σ=2", func(r *rand.Rand) time.Duration {
			return time.Duration(2e5 * math.Exp(2*r.NormFloat64()))
		}},
		{"uniform 1ms–100ms", func(r *rand.Rand) time.Duration {
			return time.Millisecond + time.Duration(r.Int64N(int64(99*time.Millisecond)))
		}},
		{"uniform 20µs–200µs", func(r *rand.Rand) time.Duration {
			return 20*time.Microsecond + time.Duration(r.Int64N(int64(180*time.Microsecond)))
		}},
		// The 10th percentile sits in the fast mode.
		{"bimodal 20% 1ms, 80% 40ms", func(r *rand.Rand) time.Duration {
			return bimodal(r, 0.2, time.Millisecond, 40*time.Millisecond)
		}},
		// The 10th percentile sits in the slow mode's left tail.
		{"bimodal 5% 1ms, 95% 40ms", func(r *rand.Rand) time.Duration {
			return bimodal(r, 0.05, time.Millisecond, 40*time.Millisecond)
		}},
	}
	for _, d := range distributions {
		t.Run(d.name, func(t *testing.T) {
			var worst float64
			for _, n := range []int{10, 100, 1_000, 10_000, 100_000} {
				for seed := range uint64(seeds) {
					r := rand.New(rand.NewPCG(seed, uint64(n)))
					calls := make([]time.Duration, n)
					for i := range calls {
						calls[i] = d.draw(r)
					}
					got := baselineOf(t, calls)
					want := exactP10(calls)
					e := math.Abs(float64(got-want)) / float64(want)
					worst = max(worst, e)
					if e > 1.0/64 {
						t.Errorf("n=%d seed=%d: baseline %v, exact %v: error %.3f%%", n, seed, got, want, 100*e)
					}
				}
			}
			t.Logf("worst relative error over %d data sets: %.3f%%", 5*seeds, 100*worst)
		})
	}
}

// baselineOf makes calls one round, spread over 4m50s so that they cross
// every slot of the window and none ages out, and returns the baseline the
// round was judged against.
func baselineOf(t *testing.T, calls []time.Duration) time.Duration {
	t.Helper()
	n := len(calls)
	c, err := adaptive.New(&adaptive.Options{Minimum: 1, Initial: n, Maximum: n})
	if err != nil {
		t.Fatal(err)
	}
	spread := 4*time.Minute + 50*time.Second
	for i, d := range calls {
		c.Sample(t0.Add(spread*time.Duration(i)/time.Duration(n)), d)
	}
	b, ok := c.Baseline()
	if !ok {
		t.Fatalf("no baseline after %d calls", n)
	}
	return b
}

// exactP10 is the ⌈n/10⌉-th fastest call.
func exactP10(calls []time.Duration) time.Duration {
	sorted := slices.Clone(calls)
	slices.Sort(sorted)
	return sorted[(len(sorted)+9)/10-1]
}

// bimodal draws from two normal modes with a 10% spread, p of the calls from
// the fast one.
func bimodal(r *rand.Rand, p float64, fast, slow time.Duration) time.Duration {
	mode := slow
	if r.Float64() < p {
		mode = fast
	}
	return time.Duration(float64(mode) * (1 + 0.1*r.NormFloat64()))
}

// lognormal returns n seeded latencies around 5ms.
func lognormal(n int, seed uint64) []time.Duration {
	r := rand.New(rand.NewPCG(seed, 0))
	out := make([]time.Duration, n)
	for i := range out {
		out[i] = time.Duration(5e6 * math.Exp(r.NormFloat64()))
	}
	return out
}
