package limit_test

import (
	"context"
	"testing"
	"time"

	"github.com/egressd/egressd/pkg/adaptive"
	"github.com/egressd/egressd/pkg/limit"
)

// Limiters that never refuse in a benchmark's run, so that every iteration
// measures the admitting path: the bucket holds a billion permits, the
// window 2⁶², the bulkheads more than there are goroutines.
func admitting(tb testing.TB) []struct {
	name string
	l    *limit.Local
} {
	return []struct {
		name string
		l    *limit.Local
	}{
		{"PerSecond", limit.PerSecond(limit.MaxRate)},
		{"PerWindow", mustNew(tb, limit.Options{PerWindow: &limit.PerWindowOptions{Permits: 1 << 62, Window: time.Second}})},
		{"Concurrency", limit.Concurrency(1 << 20)},
		{"Adaptive", limit.Adaptive(200)},
	}
}

// BenchmarkAcquireRelease is one goroutine taking and returning permits on
// the real clock. Target: 0 allocs/op for every shape.
func BenchmarkAcquireRelease(b *testing.B) {
	for _, bm := range admitting(b) {
		b.Run(bm.name, func(b *testing.B) {
			acquireRelease(b, bm.l)
		})
	}
}

// acquireRelease is one goroutine taking and returning permits of l.
func acquireRelease(b *testing.B, l *limit.Local) {
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		lease, err := l.Acquire(ctx)
		if err != nil {
			b.Fatal(err)
		}
		lease.Release()
	}
}

// BenchmarkAcquireReleaseParallel is GOMAXPROCS goroutines sharing one
// limiter: the bulkheads are lock-free without a queue; the rate shapes and
// the adaptive controller's sample take a mutex.
func BenchmarkAcquireReleaseParallel(b *testing.B) {
	for _, bm := range admitting(b) {
		b.Run(bm.name, func(b *testing.B) {
			ctx := context.Background()
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					lease, err := bm.l.Acquire(ctx)
					if err != nil {
						b.Fatal(err)
					}
					lease.Release()
				}
			})
		})
	}
}

// BenchmarkQueueUncontended is a limiter with a queue that never has to use
// it: the price of the lock that a queue makes the bulkheads take.
func BenchmarkQueueUncontended(b *testing.B) {
	for _, bm := range []struct {
		name string
		opts limit.Options
	}{
		{"PerSecond", limit.Options{PerSecond: &limit.PerSecondOptions{Permits: limit.MaxRate}, QueueLimit: 10}},
		{"Concurrency", limit.Options{Concurrency: 1 << 20, QueueLimit: 10}},
	} {
		b.Run(bm.name, func(b *testing.B) {
			acquireRelease(b, mustNew(b, bm.opts))
		})
	}
}

// BenchmarkRefused is the refusing path. A bulkhead's refusal is shared and
// costs nothing to make; a rate refusal carries its own RetryAfter, so it is
// one allocation.
func BenchmarkRefused(b *testing.B) {
	for _, bm := range []struct {
		name string
		l    func() *limit.Local
	}{
		{"PerSecond", func() *limit.Local { return limit.PerSecond(1) }}, // about one admitted a second
		{"PerWindow", func() *limit.Local { return limit.PerWindow(1, time.Hour) }},
		{"Concurrency", func() *limit.Local { return limit.Concurrency(1) }},
		{"Adaptive", func() *limit.Local { return limit.Adaptive(1) }},
	} {
		b.Run(bm.name, func(b *testing.B) {
			l := bm.l()
			ctx := context.Background()
			if _, err := l.Acquire(ctx); err != nil {
				b.Fatal(err)
			}
			b.ReportAllocs()
			for b.Loop() {
				_, _ = l.Acquire(ctx)
			}
		})
	}
}

// nop is an Observer that does nothing, so that BenchmarkObserved measures
// what the limiter pays to call one.
type nop struct{}

func (nop) OnLease(limit.Outcome) {}
func (nop) OnWait(time.Duration)  {}
func (nop) OnLimit(int)           {}

// BenchmarkObserved is BenchmarkAcquireRelease with an observer, with and
// without a queue.
func BenchmarkObserved(b *testing.B) {
	for _, bm := range []struct {
		name string
		opts limit.Options
	}{
		{"Concurrency", limit.Options{Concurrency: 1 << 20, Observer: nop{}}},
		{"Adaptive", limit.Options{Adaptive: &adaptive.Options{Maximum: 200}, Observer: nop{}}},
		{"ConcurrencyQueue", limit.Options{Concurrency: 1 << 20, QueueLimit: 10, Observer: nop{}}},
	} {
		b.Run(bm.name, func(b *testing.B) {
			acquireRelease(b, mustNew(b, bm.opts))
		})
	}
}
