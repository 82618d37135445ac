package shared

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"
)

// BenchmarkAdmission measures admission decisions against a local Redis:
// decisions per second and p50/p99 latency, per shape, with one client and
// with 8 at once. Budgets are large, so most decisions admit.
func BenchmarkAdmission(b *testing.B) {
	s := startRedis(b)
	shapes := []struct {
		name string
		opts Options
	}{
		{"fixedWindow", Options{FixedWindow: &FixedWindowOptions{Permits: 1 << 30, Window: time.Minute}}},
		{"slidingWindow", Options{SlidingWindow: &SlidingWindowOptions{Permits: 1 << 30, Window: time.Minute, Segments: 60}}},
		{"tokenBucket", Options{TokenBucket: &TokenBucketOptions{TokenLimit: 1 << 30, TokensPerPeriod: 1 << 20, ReplenishmentPeriod: time.Millisecond}}},
		{"concurrency", Options{Concurrency: &ConcurrencyOptions{Permits: 1 << 20}}},
	}
	for _, sh := range shapes {
		for _, clients := range []int{1, 8} {
			b.Run(sh.name+"/clients="+string(rune('0'+clients)), func(b *testing.B) {
				opts := sh.opts
				opts.Key = b.Name()
				l := newLimiter(b, s, opts)
				n, lat, elapsed := concurrently(b, clients, func() (int, error) {
					lease, err := l.Acquire(context.Background())
					lease.Release()
					return 1, err
				})
				b.ReportMetric(float64(n)/elapsed.Seconds(), "admissions/s")
				reportLatency(b, lat)
			})
		}
	}
}

// BenchmarkGrantsClaim measures the daemon's path to a shared rate: Claim
// takes a batch of permits in one script, which the kernel then spends one
// connection each. Permits granted per second and p50/p99 latency per
// claim, batches of 10, with one client and with 8.
func BenchmarkGrantsClaim(b *testing.B) {
	const batch = 10
	s := startRedis(b)
	for _, clients := range []int{1, 8} {
		b.Run("tokenBucket/batch=10/clients="+string(rune('0'+clients)), func(b *testing.B) {
			g, err := NewGrants(s.Client(b), GrantsOptions{Key: b.Name(), TokenBucket: &TokenBucketOptions{TokenLimit: 1 << 30, TokensPerPeriod: 1 << 20, ReplenishmentPeriod: time.Millisecond}})
			if err != nil {
				b.Fatal(err)
			}
			n, lat, elapsed := concurrently(b, clients, func() (int, error) {
				c, err := g.Claim(context.Background(), batch)
				return c.Got, err
			})
			b.ReportMetric(float64(n)/elapsed.Seconds(), "permits/s")
			reportLatency(b, lat)
		})
	}
}

// concurrently runs op b.N times over clients goroutines and returns the
// sum of what op counted, each call's latency and the time it all took.
func concurrently(b *testing.B, clients int, op func() (int, error)) (n int, lat []time.Duration, elapsed time.Duration) {
	lats := make([][]time.Duration, clients)
	counts := make([]int, clients)
	var wg sync.WaitGroup
	b.ResetTimer()
	start := time.Now()
	for c := range clients {
		calls := b.N / clients
		if c < b.N%clients {
			calls++
		}
		lats[c] = make([]time.Duration, 0, calls)
		wg.Go(func() {
			for range calls {
				t0 := time.Now()
				got, err := op()
				lats[c] = append(lats[c], time.Since(t0))
				if err != nil {
					b.Error(err)
					return
				}
				counts[c] += got
			}
		})
	}
	wg.Wait()
	elapsed = time.Since(start)
	b.StopTimer()
	for _, k := range counts {
		n += k
	}
	return n, slices.Concat(lats...), elapsed
}

// reportLatency reports the p50 and p99 of lat.
func reportLatency(b *testing.B, lat []time.Duration) {
	if len(lat) == 0 {
		return
	}
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds()), "p50-µs")
	b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds()), "p99-µs")
}
