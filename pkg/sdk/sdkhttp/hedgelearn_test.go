package sdkhttp

import (
	"context"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/pkg/sdk"
)

// A dependency whose slowest 5% form a slow mode, the shape hedging is for,
// called through the defaults with a hedge that learns its delay at p95,
// beside the same calls unhedged: the delay in force stays below the slow
// mode, and the hedged p99 is far below the unhedged p99 of the same run.
// Workers in a closed loop call in bursts of fast calls between slow ones.
// A slow call takes slowFor. The delay settles at the edge of the fast
// calls, where the slow mode starts at slowFor; the hedged p99, about the
// delay and a fast call, is then far below half the unhedged, which is
// slowFor.
//
// It runs twice. In a bubble, on the fake clock, the run is exact. On
// loopback, on the real clock, it meets what a loaded machine does to the
// learning (hedges sent late or held back, slow first attempts seen in full
// because of it), which the fake clock cannot: run it with GOMAXPROCS=1 and
// beside a CPU hog too (docs/sdk.md gives the figures).
func TestHedgeLearnsTheEdgeOfASlowMode(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		testHedgeLearnsTheEdgeOfASlowMode(t, slowModeWorld{
			serve:     func(t *testing.T, h http.HandlerFunc) string { return serve(t, h).URL },
			transport: transport,
			fast:      func() time.Duration { return time.Duration(1+rand.IntN(5)) * time.Millisecond },
			latency:   clocktest.Latency,
			hedge:     newHedge,
		})
	})
}

func TestHedgeLearnsTheEdgeOfASlowModeOnLoopback(t *testing.T) {
	testHedgeLearnsTheEdgeOfASlowMode(t, slowModeWorld{
		serve: func(t *testing.T, h http.HandlerFunc) string {
			srv := httptest.NewServer(h)
			t.Cleanup(srv.Close)
			return srv.URL
		},
		transport: func(t *testing.T) *http.Transport {
			tr := http.DefaultTransport.(*http.Transport).Clone()
			t.Cleanup(tr.CloseIdleConnections)
			return tr
		},
		fast: func() time.Duration { return 0 },
		latency: func(ctx context.Context, d time.Duration) error {
			if d == 0 {
				return nil
			}
			select {
			case <-time.After(d):
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		},
		hedge: func(_ *testing.T, o sdk.HedgeOptions) *sdk.Hedge { return sdk.NewHedge(o) },
	})
}

// slowModeWorld is where testHedgeLearnsTheEdgeOfASlowMode runs: its
// server, its clients' transport, how long a fast call takes, the clock a
// call's latency passes on, and its hedges. On loopback a fast call
// answers at once: the network and the machine's load are all its
// latency. On the fake clock, where those take no time, it takes 1-5ms.
type slowModeWorld struct {
	serve     func(*testing.T, http.HandlerFunc) string // the server's URL
	transport func(*testing.T) *http.Transport
	fast      func() time.Duration
	latency   func(context.Context, time.Duration) error
	hedge     func(*testing.T, sdk.HedgeOptions) *sdk.Hedge
}

func testHedgeLearnsTheEdgeOfASlowMode(t *testing.T, w slowModeWorld) {
	const (
		slowShare = 0.05
		slowFor   = 600 * time.Millisecond
		settle    = 500  // hedged calls once a delay is learned, before measuring
		calls     = 3000 // hedged calls measured
		plain     = 500  // unhedged calls measured, 25 of them slow
		workers   = 8    // calling hedged; twice as many unhedged, which mostly wait
		maxRatio  = 0.5
	)
	url := w.serve(t, func(rw http.ResponseWriter, r *http.Request) {
		took := w.fast()
		if rand.Float64() < slowShare {
			took = slowFor
		}
		if w.latency(r.Context(), took) != nil {
			return // a hedge won
		}
		io.WriteString(rw, "ok")
	})
	client := func(p *sdk.Policy) *http.Client {
		base := w.transport(t)
		base.MaxIdleConnsPerHost = 4 * workers
		return build(t, NewStack(base).Retry(p))
	}
	hedged := Defaults()
	h := w.hedge(t, sdk.HedgeOptions{Percentile: 0.95})
	hedged.Hedge = h
	// The default ratio, and room for as many hedges at once as calls run:
	// the default's five spare tokens go in one stall of a loaded machine,
	// and the hedges then held back are those of the slow calls measured.
	hedged.Budget = sdk.NewRetryBudget(0.1, 20*workers)
	hc, pc := client(hedged), client(Defaults())

	// run makes calls through c from n goroutines until done says stop,
	// and returns their latencies and the highest delay in force after any
	// of them.
	run := func(c *http.Client, n int, done func(made int) bool) (lat []time.Duration, highest time.Duration) {
		var mu sync.Mutex
		var wg sync.WaitGroup
		for range n {
			wg.Go(func() {
				for {
					mu.Lock()
					stop := done(len(lat))
					mu.Unlock()
					if stop || t.Failed() {
						return
					}
					start := time.Now()
					resp, err := c.Get(url)
					if err != nil {
						t.Error(err)
						return
					}
					_, err = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					took := time.Since(start)
					if err != nil || resp.StatusCode != http.StatusOK {
						t.Errorf("GET: %d, %v", resp.StatusCode, err)
					}
					mu.Lock()
					lat, highest = append(lat, took), max(highest, h.Delay())
					mu.Unlock()
				}
			})
		}
		wg.Wait()
		return lat, highest
	}
	if run(hc, workers, func(made int) bool { return h.Delay() > 0 || made >= 20*settle }); h.Delay() == 0 {
		t.Fatalf("no delay learned from %d calls", 20*settle)
	}
	_, settled := run(hc, workers, func(made int) bool { return made >= settle })
	run(pc, 2*workers, func(made int) bool { return made >= 2*workers }) // its connections

	var plainLat, hedgedLat []time.Duration
	var most time.Duration
	var wg sync.WaitGroup
	wg.Go(func() { plainLat, _ = run(pc, 2*workers, func(made int) bool { return made >= plain }) })
	wg.Go(func() { hedgedLat, most = run(hc, workers, func(made int) bool { return made >= calls }) })
	wg.Wait()
	if t.Failed() {
		return
	}
	p99 := func(l []time.Duration) time.Duration {
		slices.Sort(l)
		return l[len(l)*99/100]
	}
	hp, pp, most := p99(hedgedLat), p99(plainLat), max(settled, most)
	ratio := float64(hp) / float64(pp)
	t.Logf("delay in force at most %v; p99 hedged %v, unhedged %v: %.3f", most, hp, pp, ratio)
	if most >= slowFor {
		t.Errorf("the delay in force reached %v, the slow mode at %v", most, slowFor)
	}
	if ratio > maxRatio {
		t.Errorf("hedged p99 %v is %.2f of the unhedged %v; want at most %v", hp, ratio, pp, maxRatio)
	}
}
