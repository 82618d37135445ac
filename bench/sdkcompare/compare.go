// Command sdkcompare measures the SDK's in-process limiter against
// golang.org/x/time/rate, side by side in one run, and prints the ratio. It
// is its own module so that x/time never enters egressd's go.mod.
//
//	cd bench/sdkcompare && go run .            # the table and the ratio
//	cd bench/sdkcompare && go test -bench . -benchmem
//
// The target (issue 5): limit.PerSecond's Acquire takes at most 1.0× the
// time of rate.Limiter.Allow, both admitting.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"slices"
	"testing"
	"time"

	"golang.org/x/time/rate"

	"github.com/egressd/egressd/pkg/limit"
)

// Both limiters are as large as limit allows - a billion a second, a
// billion of burst - so that neither refuses in a run and every iteration
// measures the admitting path.
func newLimit() *limit.Local { return limit.PerSecond(limit.MaxRate) }
func newRate() *rate.Limiter { return rate.NewLimiter(rate.Limit(limit.MaxRate), limit.MaxRate) }
func newLimitWallClock() *limit.Local {
	l, err := limit.New(limit.Options{PerSecond: &limit.PerSecondOptions{Permits: limit.MaxRate}, Clock: wallClock{}})
	if err != nil {
		panic(err)
	}
	return l
}
func refusingLimit() *limit.Local { return limit.PerSecond(1) }
func refusingRate() *rate.Limiter { return rate.NewLimiter(1, 1) }
func background() context.Context { return context.Background() }

// A pair is the same work done by each library.
type pair struct {
	name        string
	limit, rate func(b *testing.B)
}

var pairs = []pair{
	{"admitting", limitAcquire(newLimit), rateAllow(newRate)},
	// The limiter reads the monotonic clock alone (time.Since), which costs
	// half of the time.Now that Allow reads; this row gives it time.Now
	// through an injected clock, to show what the rest of the path costs.
	{"admitting, time.Now", limitAcquire(newLimitWallClock), rateAllow(newRate)},
	{"refusing", limitAcquire(refusingLimit), rateAllow(refusingRate)},
	{"admitting, parallel", limitAcquireParallel(newLimit), rateAllowParallel(newRate)},
}

func limitAcquire(newL func() *limit.Local) func(b *testing.B) {
	return func(b *testing.B) {
		l, ctx := newL(), background()
		b.ReportAllocs()
		for b.Loop() {
			lease, _ := l.Acquire(ctx)
			lease.Release()
		}
	}
}

func rateAllow(newL func() *rate.Limiter) func(b *testing.B) {
	return func(b *testing.B) {
		l := newL()
		b.ReportAllocs()
		for b.Loop() {
			l.Allow()
		}
	}
}

func limitAcquireParallel(newL func() *limit.Local) func(b *testing.B) {
	return func(b *testing.B) {
		l, ctx := newL(), background()
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				lease, _ := l.Acquire(ctx)
				lease.Release()
			}
		})
	}
}

func rateAllowParallel(newL func() *rate.Limiter) func(b *testing.B) {
	return func(b *testing.B) {
		l := newL()
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				l.Allow()
			}
		})
	}
}

// wallClock is the real clock through limit.Clock: time.Now on every read.
type wallClock struct{}

func (wallClock) Now() time.Time { return time.Now() }

func (wallClock) AfterFunc(d time.Duration, f func()) limit.Timer { return time.AfterFunc(d, f) }

func main() {
	rounds := flag.Int("rounds", 5, "runs of each benchmark, interleaved; the median is reported")
	flag.Parse()
	testing.Init()

	fmt.Printf("%-22s %16s %16s %8s\n", "limit.PerSecond vs", "limit", "x/time/rate", "ratio")
	met := true
	for i, p := range pairs {
		var ln, rn []float64
		var la, ra int64
		for range *rounds {
			l, r := testing.Benchmark(p.limit), testing.Benchmark(p.rate)
			ln, rn = append(ln, nsPerOp(l)), append(rn, nsPerOp(r))
			la, ra = l.AllocsPerOp(), r.AllocsPerOp()
		}
		lm, rm := median(ln), median(rn)
		ratio := lm / rm
		fmt.Printf("%-22s %9.2f ns/op %9.2f ns/op %7.2fx\n", p.name, lm, rm, ratio)
		fmt.Printf("%-22s %9d allocs %9d allocs\n", "", la, ra)
		if i == 0 && ratio > 1.0 {
			met = false
		}
	}
	if met {
		fmt.Println("target (admitting, ≤ 1.0× rate.Limiter.Allow): met")
		return
	}
	fmt.Println("target (admitting, ≤ 1.0× rate.Limiter.Allow): MISSED")
	os.Exit(1)
}

func nsPerOp(r testing.BenchmarkResult) float64 {
	if r.N == 0 {
		return 0
	}
	return float64(r.T.Nanoseconds()) / float64(r.N)
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[len(s)/2]
}
