package tests

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"net"
	"regexp"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/egressd/egressd/internal/privtest"
	"github.com/egressd/egressd/pkg/control"
)

// capacityServer serves one request per connection with capacity workers;
// a request waits for a free worker, which takes a lognormal service time
// (median serviceTime, σ 0.5), so that workers do not finish in lock-step
// as they would with a fixed time. It counts
// the connections between accept and reply: each is held by its client
// throughout, so their number never exceeds what the client side holds.
type capacityServer struct {
	addr    string
	busy    atomic.Int64
	maxBusy atomic.Int64
}

func newCapacityServer(t *testing.T, ns *privtest.NetNS, listenAddr string, capacity int, serviceTime time.Duration) *capacityServer {
	t.Helper()
	var ln net.Listener
	if err := ns.Do(func() (err error) { ln, err = net.Listen("tcp4", listenAddr); return err }); err != nil {
		t.Fatal(err)
	}
	s := &capacityServer{addr: ln.Addr().String()}
	workers := make(chan struct{}, capacity)
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Go(func() {
				defer c.Close()
				n := s.busy.Add(1)
				for m := s.maxBusy.Load(); n > m && !s.maxBusy.CompareAndSwap(m, n); m = s.maxBusy.Load() {
				}
				buf := make([]byte, 1)
				c.SetDeadline(time.Now().Add(10 * time.Second))
				if _, err := c.Read(buf); err != nil {
					s.busy.Add(-1)
					return
				}
				workers <- struct{}{}
				time.Sleep(time.Duration(float64(serviceTime) * math.Exp(0.5*rand.NormFloat64())))
				<-workers
				s.busy.Add(-1)
				c.Write(buf)
			})
		}
	})
	return s
}

// TestAdaptiveLimitFindsCapacity pushes many clients at a server of fixed
// capacity in another network namespace: the adaptive rule's kernel limit
// leaves Initial, settles above the capacity (no goodput lost) without
// running away to Maximum, and the server never holds more connections
// than the limit allowed.
//
// The issue asks for a settled limit inside [c, 2.2c]. The loop as
// specified settles at 2–3.3c here (and, given minutes of overload, would
// climb on: its five-minute baseline learns the standing queue; see
// bench/adaptivesim). With drain probes (probeEvery) the baseline is
// learned from probe calls and the settled limit — read outside probes —
// lies inside [c, 2.2c].
//
// A few clients run alone first, below capacity, so the baseline is the
// dependency's unqueued latency: a loop that only ever saw queueing learns
// the queue as normal and climbs to its Maximum, as documented.
func TestAdaptiveLimitFindsCapacity(t *testing.T) {
	const capacity = 16
	tests := []struct {
		name    string
		options string
		upper   float64 // times capacity
	}{
		{"specified", "samples: request", 4},
		{"probes", "samples: request, probeEvery: 100", 2.2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			lo, hi := adaptiveRun(t, capacity, tt.options)
			if lo < capacity || float64(hi) > tt.upper*capacity {
				t.Errorf("settled limit %d..%d, want inside [%d, %.1f]", lo, hi, capacity, tt.upper*capacity)
			}
		})
	}
}

// adaptiveRun drives one adaptive rule against a server of the given
// capacity and returns the range of its settled limit over the last three
// seconds.
func adaptiveRun(t *testing.T, capacity int, options string) (lo, hi uint32) {
	e := newEnv(t)
	const clients = 96
	ns := privtest.NewNetNS(t)
	privtest.VethToHost(t, "10.210.0.1/24", ns, "10.210.0.2/24")
	srv := newCapacityServer(t, ns, "10.210.0.2:0", capacity, 10*time.Millisecond)

	e.writePolicy(t, "rules:\n  - name: dep\n    destination: 10.210.0.2\n    adaptive: {"+options+"}\n")
	d := e.start(t)

	const warmup = 2 * time.Second
	steady := privtest.Spawn(t, e.cg, "requester", srv.addr, fmt.Sprint(capacity/2), "9s")
	time.Sleep(warmup)
	clientsDone := make(chan string, 1)
	client := privtest.Spawn(t, e.cg, "requester", srv.addr, fmt.Sprint(clients), "7s")
	go func() { clientsDone <- client.Line(t) }()

	// Watch the limit while the clients push; the settled limit is the
	// one a probe, if any, goes back to.
	cl := &control.Client{Socket: e.socket}
	var settled []uint32
	maxLimit := uint32(0)
	for start := time.Now(); time.Since(start) < 7*time.Second; time.Sleep(50 * time.Millisecond) {
		l, err := cl.Limit(context.Background(), "dep")
		if err != nil {
			t.Fatal(err)
		}
		settled = append(settled, l.SettledLimit)
		maxLimit = max(maxLimit, l.Limit)
	}
	summary := <-clientsDone
	client.Wait(t)
	summary += "; warm-up clients " + steady.Line(t)
	steady.Wait(t)

	settled = settled[len(settled)*4/7:]
	lo, hi = settled[0], settled[0]
	for _, l := range settled {
		lo, hi = min(lo, l), max(hi, l)
	}
	final, err := cl.Limit(context.Background(), "dep")
	if err != nil {
		t.Fatal(err)
	}
	// Every limit the daemon pushed is in its debug log; polling alone
	// could miss a peak between two polls.
	for _, m := range regexp.MustCompile(`msg="adaptive limit" rule=dep limit=(\d+)`).FindAllStringSubmatch(d.log.String(), -1) {
		n, _ := strconv.Atoi(m[1])
		maxLimit = max(maxLimit, uint32(n))
	}
	t.Logf("capacity %d, %d clients: %s; settled limit %d..%d (max in force %d); server held at most %d; baseline %.1fms",
		capacity, clients, summary, lo, hi, maxLimit, srv.maxBusy.Load(), final.BaselineSeconds*1000)
	if srv.maxBusy.Load() > int64(maxLimit) {
		t.Errorf("server held %d connections at once; the limit never went above %d", srv.maxBusy.Load(), maxLimit)
	}
	if final.BaselineSeconds == 0 || final.Refused == 0 {
		t.Errorf("the loop did not run against the limit: %+v", final)
	}
	return lo, hi
}
