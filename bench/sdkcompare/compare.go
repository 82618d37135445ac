// Command sdkcompare measures egressd's SDK against the libraries it is
// compared with, side by side in one run, and prints the ratios. It is its
// own module so that x/time and failsafe-go never enter egressd's go.mod.
//
//	cd bench/sdkcompare && go run .            # the tables and the ratios
//	cd bench/sdkcompare && go test -bench . -benchmem
//
// The targets:
//
//   - limit.PerSecond's Acquire takes at most 1.0× the time of
//     rate.Limiter.Allow, both admitting (this file);
//   - sdk.Run on the success path allocates nothing and takes at most 0.5×
//     the time of failsafe-go's retry policy executor on the same callback
//     (run.go);
//   - hedging at p95 at least halves the p99 of calls to a dependency with
//     a slow tail for at most 10% more requests, and does as well as
//     failsafe-go's hedge policy for no more (hedge.go).
//
// The process exits 1 if a target is missed.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"slices"
	"testing"

	"golang.org/x/time/rate"

	"github.com/egressd/egressd/pkg/limit"
)

// Both limiters are as large as limit allows - a billion a second, a
// billion of burst - so that neither refuses in a run and every iteration
// measures the admitting path.
func newLimit() *limit.Local      { return limit.PerSecond(limit.MaxRate) }
func newRate() *rate.Limiter      { return rate.NewLimiter(rate.Limit(limit.MaxRate), limit.MaxRate) }
func refusingLimit() *limit.Local { return limit.PerSecond(1) }
func refusingRate() *rate.Limiter { return rate.NewLimiter(1, 1) }
func background() context.Context { return context.Background() }

// A pair is the same work done by each library: ours (egressd) and theirs.
type pair struct {
	name         string
	ours, theirs func(b *testing.B)
	// target, if set, is the largest ratio ours/theirs allowed; a pair
	// without one is shown for information.
	target float64
	// zeroAllocs, if set, also asks ours to allocate nothing.
	zeroAllocs bool
}

// A table is a set of pairs printed together, with the target they check.
type table struct {
	title, ours, theirs string
	pairs               []pair
	target              string // how the target reads, for the verdict line
}

var limiterTable = table{
	title:  "limit.PerSecond vs",
	ours:   "limit",
	theirs: "x/time/rate",
	pairs:  limiterPairs,
	target: "admitting, ≤ 1.0× rate.Limiter.Allow",
}

var limiterPairs = []pair{
	// The limiter reads the monotonic clock alone (time.Since), which costs
	// half of the time.Now that Allow reads.
	{name: "admitting", ours: limitAcquire(newLimit), theirs: rateAllow(newRate), target: 1.0},
	{name: "refusing", ours: limitAcquire(refusingLimit), theirs: rateAllow(refusingRate)},
	{name: "admitting, parallel", ours: limitAcquireParallel(newLimit), theirs: rateAllowParallel(newRate)},
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

func main() {
	rounds := flag.Int("rounds", 5, "runs of each benchmark, interleaved; the median is reported")
	hedgeCalls := flag.Int("hedge-calls", 24000, "calls through each hedger")
	hedgingOnly := flag.Bool("hedging-only", false, "print the hedging comparison alone")
	flag.Parse()
	testing.Init()

	met := true
	for i, t := range []table{limiterTable, runTable} {
		if *hedgingOnly {
			break
		}
		if i > 0 {
			fmt.Println()
		}
		met = t.print(*rounds) && met
	}
	fmt.Println()
	met = printHedging(*hedgeCalls, 4) && met
	if !met {
		os.Exit(1)
	}
}

// print runs each pair rounds times, interleaved, prints the medians side by
// side with their ratio and the most allocs/op any round saw, and reports
// whether the table's target was met.
func (t table) print(rounds int) (met bool) {
	w := len(t.title)
	for _, p := range t.pairs {
		w = max(w, len(p.name))
	}
	fmt.Printf("%-*s %16s %16s %8s\n", w, t.title, t.ours, t.theirs, "ratio")
	met = true
	for _, p := range t.pairs {
		var on, tn []float64
		var oa, ta []int64
		for range rounds {
			o, th := testing.Benchmark(p.ours), testing.Benchmark(p.theirs)
			on, tn = append(on, nsPerOp(o)), append(tn, nsPerOp(th))
			oa, ta = append(oa, o.AllocsPerOp()), append(ta, th.AllocsPerOp())
		}
		om, tm := median(on), median(tn)
		ratio := om / tm
		mark := ""
		if p.target > 0 {
			ok := ratio <= p.target && (!p.zeroAllocs || slices.Max(oa) == 0)
			met = met && ok
			mark = " ✓"
			if !ok {
				mark = " ✗"
			}
		}
		fmt.Printf("%-*s %9.2f ns/op %9.2f ns/op %7.2fx%s\n", w, p.name, om, tm, ratio, mark)
		fmt.Printf("%-*s %9d allocs %9d allocs\n", w, "", slices.Max(oa), slices.Max(ta))
	}
	verdict := "met"
	if !met {
		verdict = "MISSED"
	}
	fmt.Printf("target (%s): %s\n", t.target, verdict)
	return met
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
