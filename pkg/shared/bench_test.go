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
				lat := make([][]time.Duration, clients)
				var wg sync.WaitGroup
				b.ResetTimer()
				start := time.Now()
				for c := range clients {
					n := b.N / clients
					if c < b.N%clients {
						n++
					}
					lat[c] = make([]time.Duration, 0, n)
					wg.Go(func() {
						for range n {
							t0 := time.Now()
							lease, err := l.Acquire(context.Background())
							lat[c] = append(lat[c], time.Since(t0))
							if err != nil {
								b.Error(err)
								return
							}
							lease.Release()
						}
					})
				}
				wg.Wait()
				elapsed := time.Since(start)
				b.StopTimer()
				all := slices.Concat(lat...)
				slices.Sort(all)
				if len(all) == 0 {
					return
				}
				b.ReportMetric(float64(len(all))/elapsed.Seconds(), "admissions/s")
				b.ReportMetric(float64(all[len(all)/2].Microseconds()), "p50-µs")
				b.ReportMetric(float64(all[len(all)*99/100].Microseconds()), "p99-µs")
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
			lat := make([][]time.Duration, clients)
			granted := make([]int, clients)
			var wg sync.WaitGroup
			b.ResetTimer()
			start := time.Now()
			for c := range clients {
				n := b.N / clients
				if c < b.N%clients {
					n++
				}
				lat[c] = make([]time.Duration, 0, n)
				wg.Go(func() {
					for range n {
						t0 := time.Now()
						got, _, err := g.Claim(context.Background(), batch)
						lat[c] = append(lat[c], time.Since(t0))
						if err != nil {
							b.Error(err)
							return
						}
						granted[c] += got
					}
				})
			}
			wg.Wait()
			elapsed := time.Since(start)
			b.StopTimer()
			all := slices.Concat(lat...)
			slices.Sort(all)
			if len(all) == 0 {
				return
			}
			total := 0
			for _, n := range granted {
				total += n
			}
			b.ReportMetric(float64(total)/elapsed.Seconds(), "permits/s")
			b.ReportMetric(float64(all[len(all)/2].Microseconds()), "p50-µs")
			b.ReportMetric(float64(all[len(all)*99/100].Microseconds()), "p99-µs")
		})
	}
}
