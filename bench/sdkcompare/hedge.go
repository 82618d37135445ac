package main

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/failsafe-go/failsafe-go"
	"github.com/failsafe-go/failsafe-go/hedgepolicy"

	"github.com/egressd/egressd/pkg/sdk"
)

// The target: against a loopback dependency with a slow tail -
// 5% of calls take 20× the median - hedging at the 95th percentile of
// recent latencies at least halves the p99 of a call, for at most 10% more
// requests; and beside failsafe-go's hedge policy (the same percentile, on
// the same dependency, in the same run) gives an equal or better p99 for no
// more extra requests. "Equal" allows for noise: a p99 within 10% of
// failsafe-go's, and extra requests within one percentage point of its.
// At 24,000 calls the difference between two shares of hedged calls near
// 5% has a standard deviation of 0.2 points, so a point is mostly not
// noise: it also lets through what egressd's lower delay costs. Stopping
// below the gap under a slower mode hedges the stragglers above the fast
// calls too, where failsafe-go's exact quantile sits at the edge of the
// slow mode and often hedges only part of it.

const (
	hedgeMedian   = time.Millisecond
	hedgeSlowMult = 20
	hedgeSlowFrac = 0.05
	hedgeWorkers  = 4
)

// tailServer is the dependency: each request takes the median, or one in
// twenty 20× it, and ends early when the client cancels it. It counts the
// requests to /0, /1, ... apart - one path per hedger - so that a cancelled
// copy arriving late is counted for the hedger that sent it.
type tailServer struct {
	url      string
	requests []atomic.Int64
}

func newTailServer(paths int) (*tailServer, func(), error) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, nil, err
	}
	s := &tailServer{url: "http://" + lis.Addr().String() + "/", requests: make([]atomic.Int64, paths)}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if i, err := strconv.Atoi(strings.TrimPrefix(r.URL.Path, "/")); err == nil && i >= 0 && i < paths {
			s.requests[i].Add(1)
		}
		d := hedgeMedian
		if rand.Float64() < hedgeSlowFrac {
			d *= hedgeSlowMult
		}
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case <-t.C:
			io.WriteString(w, "ok")
		case <-r.Context().Done():
		}
	})}
	go srv.Serve(lis)
	return s, func() { srv.Close() }, nil
}

// A hedger is one way to make a call: fn is the call itself, on ctx.
type hedger struct {
	name string
	call func(fn func(ctx context.Context) (int, error)) (int, error)
}

func noHedging() hedger {
	return hedger{"no hedging", func(fn func(context.Context) (int, error)) (int, error) {
		return fn(context.Background())
	}}
}

func egressdHedge() hedger {
	p := &sdk.Policy{MaxAttempts: 2, Hedge: sdk.NewHedge(sdk.HedgeOptions{Percentile: 0.95, MinDelay: hedgeMedian / 2})}
	return hedger{"egressd sdk.RunHedged p95", func(fn func(context.Context) (int, error)) (int, error) {
		return sdk.RunHedged(context.Background(), p, fn)
	}}
}

func failsafeHedge() hedger {
	e := failsafe.With[int](hedgepolicy.NewWithDelayQuantile[int](0.95, 1000, 100))
	return hedger{"failsafe-go hedgepolicy p95", func(fn func(context.Context) (int, error)) (int, error) {
		return e.GetWithExecution(func(exec failsafe.Execution[int]) (int, error) { return fn(exec.Context()) })
	}}
}

// get is the call: a GET whose body is read and closed inside the attempt.
func get(client *http.Client, url string) func(ctx context.Context) (int, error) {
	return func(ctx context.Context) (int, error) {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return 0, err
		}
		resp, err := client.Do(req)
		if err != nil {
			return 0, err
		}
		defer resp.Body.Close()
		if _, err := io.Copy(io.Discard, resp.Body); err != nil {
			return 0, err
		}
		return resp.StatusCode, nil
	}
}

// hedgeStats is what one hedger did over the calls measured.
type hedgeStats struct {
	latencies []time.Duration
	calls     int64
	requests  int64
	failed    int64
}

func (s *hedgeStats) quantile(q float64) time.Duration {
	l := slices.Clone(s.latencies)
	slices.Sort(l)
	return l[min(int(q*float64(len(l))), len(l)-1)]
}

func (s *hedgeStats) extra() float64 { return float64(s.requests)/float64(s.calls) - 1 }

// runCalls makes calls calls through h from hedgeWorkers goroutines and
// adds them to st.
func runCalls(h hedger, fn func(context.Context) (int, error), calls int, st *hedgeStats) {
	var mu sync.Mutex
	var next atomic.Int64
	var wg sync.WaitGroup
	for range hedgeWorkers {
		wg.Go(func() {
			for next.Add(1) <= int64(calls) {
				start := time.Now()
				code, err := h.call(fn)
				took := time.Since(start)
				mu.Lock()
				st.latencies = append(st.latencies, took)
				if err != nil || code != http.StatusOK {
					st.failed++
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	st.calls += int64(calls)
}

// compareHedging warms each hedger up (so that both learn their delay),
// then makes calls calls through each, in rounds that alternate between
// them so that the machine's load falls on all alike. Hedger i's measured
// calls go to the server's path /i, its warm-up to a path not counted.
func compareHedging(calls, rounds int) ([]hedger, []*hedgeStats, error) {
	hs := []hedger{noHedging(), egressdHedge(), failsafeHedge()}
	srv, stop, err := newTailServer(len(hs))
	if err != nil {
		return nil, nil, err
	}
	defer stop()
	transport := &http.Transport{MaxIdleConnsPerHost: 64}
	defer transport.CloseIdleConnections()
	client := &http.Client{Transport: transport}
	stats := make([]*hedgeStats, len(hs))
	for i, h := range hs {
		stats[i] = &hedgeStats{}
		runCalls(h, get(client, srv.url+"warm-up"), 300, &hedgeStats{})
	}
	for range rounds {
		for i, h := range hs {
			runCalls(h, get(client, srv.url+strconv.Itoa(i)), calls/rounds, stats[i])
		}
	}
	// Cancelled copies are counted when they arrive, which may be after
	// their call returned: wait for the server to go quiet.
	total := func() (n int64) {
		for i := range srv.requests {
			n += srv.requests[i].Load()
		}
		return n
	}
	for last := int64(-1); last != total(); time.Sleep(5 * time.Millisecond) {
		last = total()
	}
	for i := range hs {
		stats[i].requests = srv.requests[i].Load()
	}
	return hs, stats, nil
}

// printHedging prints the comparison and reports whether the target was met.
func printHedging(calls, rounds int) bool {
	hs, stats, err := compareHedging(calls, rounds)
	if err != nil {
		fmt.Println("hedging comparison:", err)
		return false
	}
	fmt.Printf("hedging, loopback dependency: median %v, %.0f%% of calls %d× it; %d calls each, %d at a time\n",
		hedgeMedian, hedgeSlowFrac*100, hedgeSlowMult, calls, hedgeWorkers)
	fmt.Printf("%-28s %9s %9s %9s %8s %7s\n", "", "p50", "p99", "p99.9", "extra", "failed")
	for i, h := range hs {
		s := stats[i]
		fmt.Printf("%-28s %9s %9s %9s %7.1f%% %7d\n", h.name, round(s.quantile(0.5)), round(s.quantile(0.99)), round(s.quantile(0.999)), 100*s.extra(), s.failed)
	}
	none, ours, theirs := stats[0], stats[1], stats[2]
	halved := ours.quantile(0.99) <= none.quantile(0.99)/2
	cheap := ours.extra() <= 0.10
	vsP99 := float64(ours.quantile(0.99)) <= 1.1*float64(theirs.quantile(0.99))
	vsExtra := ours.extra() <= theirs.extra()+0.01
	ok := ours.failed == 0 && halved && cheap && vsP99 && vsExtra
	fmt.Printf("p99 %.2f× no hedging (target ≤ 0.5), %.1f%% extra requests (target ≤ 10%%): %s\n",
		float64(ours.quantile(0.99))/float64(none.quantile(0.99)), 100*ours.extra(), verdictWord(halved && cheap))
	fmt.Printf("p99 %.2f× failsafe-go's (target ≤ 1.1), extra requests %+.1f points (target ≤ +1): %s\n",
		float64(ours.quantile(0.99))/float64(theirs.quantile(0.99)), 100*(ours.extra()-theirs.extra()), verdictWord(vsP99 && vsExtra))
	return ok
}

func round(d time.Duration) time.Duration { return d.Round(10 * time.Microsecond) }

func verdictWord(ok bool) string {
	if ok {
		return "met"
	}
	return "MISSED"
}
