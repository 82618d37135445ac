package shared

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/egressd/egressd/internal/redistest"
)

// Many holders on one budget, as a fleet of daemons would be: 1,000
// holders, each its own Slots or Grants, calling one local Redis from 16
// goroutines, in turns. One op is a whole experiment of many calls per
// holder, so that fairness is judged over enough of them. Reported: calls
// per second, the Redis server's CPU per second of wall time (INFO cpu),
// Jain's fairness index over what the equally busy holders ended up with,
// and the most the holders held (slots) or were granted beyond the
// bucket's allowance (rates) — the overshoot.

const holders = 1000

// redisCPU is the server's user+system CPU time so far.
func redisCPU(b *testing.B, s *redistest.Server) time.Duration {
	info, err := s.Do("INFO", "cpu")
	if err != nil {
		b.Fatal(err)
	}
	var total float64
	for _, l := range strings.Split(info.(string), "\r\n") {
		for _, k := range []string{"used_cpu_sys:", "used_cpu_user:"} {
			if v, ok := strings.CutPrefix(l, k); ok {
				x, err := strconv.ParseFloat(v, 64)
				if err != nil {
					b.Fatal(err)
				}
				total += x
			}
		}
	}
	return time.Duration(total * float64(time.Second))
}

// jain is Jain's fairness index of xs: 1 when all are equal, 1/n when one
// has everything.
func jain(xs []float64) float64 {
	var sum, sq float64
	for _, x := range xs {
		sum += x
		sq += x * x
	}
	if sq == 0 {
		return 1
	}
	return sum * sum / (float64(len(xs)) * sq)
}

// roundRobin calls op(i) for holders i = 0..holders-1 in turns from 16
// goroutines, rounds times each, and returns the time it took.
func roundRobin(b *testing.B, rounds int, op func(i int) error) time.Duration {
	var next atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for range 16 {
		wg.Go(func() {
			for {
				n := next.Add(1) - 1
				if n >= int64(rounds*holders) {
					return
				}
				if err := op(int(n % holders)); err != nil {
					b.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	return time.Since(start)
}

// BenchmarkHoldersSlots: 1,000 holders of a concurrency budget of 2,000,
// each demanding 5 (so each one's fair share is 2), renewing 20 times each
// in turns. As
// a daemon does, a holder wants no more than the fair share Redis last
// told it: the first to come took more, and give it back.
func BenchmarkHoldersSlots(b *testing.B) {
	for range b.N {
		holdersSlots(b, 20)
	}
}

func holdersSlots(b *testing.B, rounds int) {
	s := redistest.Start(b)
	c := s.Client(b)
	const budget, want = 2000, 5
	slots := make([]*Slots, holders)
	for i := range slots {
		slots[i] = newSlots(b, c, SlotsOptions{Key: "holders", Permits: budget, Holder: fmt.Sprintf("host-%04d:pool", i), LeaseDuration: time.Minute})
	}
	held := make([]atomic.Int64, holders)
	fair := make([]atomic.Int64, holders)
	for i := range fair {
		fair[i].Store(want)
	}
	var over atomic.Int64
	resize := func(i int) error {
		r, err := slots[i].Resize(context.Background(), SlotsRequest{Want: int(min(want, fair[i].Load())), Demand: want})
		held[i].Store(int64(r.Held))
		fair[i].Store(int64(r.Fair))
		return err
	}
	// Every holder asks once before the clock runs, so that the demands
	// (and the fair shares) are all there.
	for i := range holders {
		if err := resize(i); err != nil {
			b.Fatal(err)
		}
	}
	stop := make(chan struct{})
	var watch sync.WaitGroup
	watch.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
			}
			if n, err := c.ZCard(context.Background(), "holders").Result(); err == nil && n-budget > over.Load() {
				over.Store(n - budget)
			}
			// Real Redis cannot be sampled on a fake clock: the sampler's period, on the real one.
			time.Sleep(time.Millisecond)
		}
	})
	cpu := redisCPU(b, s)
	elapsed := roundRobin(b, rounds, resize)
	close(stop)
	watch.Wait()
	cpuPerSec := float64(redisCPU(b, s)-cpu) / float64(elapsed)
	shares := make([]float64, holders)
	var total int64
	for i := range held {
		shares[i] = float64(held[i].Load())
		total += held[i].Load()
	}
	b.ReportMetric(float64(rounds*holders)/elapsed.Seconds(), "resizes/s")
	b.ReportMetric(cpuPerSec, "redis-cpu/s")
	b.ReportMetric(jain(shares), "jain")
	b.ReportMetric(float64(over.Load()), "overshoot")
	b.ReportMetric(float64(total), "held")
}

// BenchmarkHoldersGrants: 1,000 holders claiming batches of 10 from one
// token bucket of 20,000 a second (burst 20,000), in rounds of one claim
// each, until the bucket has granted 400 permits a holder: every holder is
// busier than its share, and a claim gets what the bucket has when it
// comes, so fairness is over the run. The run is a stretch of the
// budget, not a number of claims: past the burst the bucket has 2,000
// batches a second for all the claims, so the faster they come, the fewer
// get one, and the more a run of a fixed number of them is luck (100
// claims each: Jain 0.90 at 33,000 claims a second, 0.93-0.95 at
// 18,000-21,000). Overshoot is what the holders were granted beyond the
// bucket's allowance over the run (burst + rate × time), in batches.
func BenchmarkHoldersGrants(b *testing.B) {
	for range b.N {
		holdersGrants(b, 400)
	}
}

func holdersGrants(b *testing.B, each int) {
	s := redistest.Start(b)
	c := s.Client(b)
	const rate, batch = 20000, 10
	grants := make([]*Grants, holders)
	for i := range grants {
		g, err := NewGrants(c, GrantsOptions{Key: "holders-rate", TokenBucket: &TokenBucketOptions{TokenLimit: rate, TokensPerPeriod: rate / 100, ReplenishmentPeriod: 10 * time.Millisecond}})
		if err != nil {
			b.Fatal(err)
		}
		grants[i] = g
	}
	got := make([]atomic.Int64, holders)
	var granted atomic.Int64
	claim := func(i int) error {
		cl, err := grants[i].Claim(context.Background(), batch)
		got[i].Add(int64(cl.Got))
		granted.Add(int64(cl.Got))
		return err
	}
	cpu := redisCPU(b, s)
	start := time.Now()
	rounds := 0
	// Whole rounds, so that every holder made as many claims.
	for granted.Load() < int64(each*holders) && !b.Failed() {
		roundRobin(b, 10, claim)
		rounds += 10
	}
	elapsed := time.Since(start)
	cpuPerSec := float64(redisCPU(b, s)-cpu) / float64(elapsed)
	shares := make([]float64, holders)
	var total int64
	for i := range got {
		shares[i] = float64(got[i].Load())
		total += got[i].Load()
	}
	allowed := rate + rate*elapsed.Seconds()
	b.ReportMetric(float64(rounds*holders)/elapsed.Seconds(), "claims/s")
	b.ReportMetric(float64(rounds), "claims/holder")
	b.ReportMetric(float64(total)/elapsed.Seconds(), "permits/s")
	b.ReportMetric(cpuPerSec, "redis-cpu/s")
	b.ReportMetric(jain(shares), "jain")
	b.ReportMetric(max(0, (float64(total)-allowed)/batch), "overshoot-batches")
}
