package tests

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"net"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/egressd/egressd/internal/privtest"
	"github.com/egressd/egressd/pkg/control"
)

// The adaptive loop end to end: a real TCP server of fixed capacity in a
// network namespace, closed-loop clients in the daemon's cgroup well above
// it, and an adaptive rule between them with nothing but its defaults.
//
// The server serves one request (a byte) per connection with capacity
// workers behind a FIFO queue; a worker takes a lognormal time (median
// 25ms, σ 0.5), so that workers do not finish in lock-step. Halfway
// through, its capacity halves. Its capacity, 12 workers (about 425
// requests a second), is what limits the clients, not the machine: this
// 2-core VM carries some 1,000 requests a second through a daemon, a
// veth and the test's own Go programs, and two thirds of that beside a
// CPU hog. What the test judges, it judges as the
// issue states it:
//
//   - the settled limit (outside drain probes; during one, the limit it
//     restores) has its median inside [c, 2.2c] over the second half of
//     each phase;
//   - after the halving, it is at most 2.2 × c/2 within 10 rounds, a round
//     being one limit's worth of completed requests at the limit in force;
//   - neither the server nor the clients ever see more connections at once
//     than the limit in force allowed. A connection holds a kernel slot from
//     its admission, inside connect(), until close(), and the server sees it
//     from accept to its reply, inside that; so at any instant the
//     connections open, from either side, number at most the limit in force
//     when the latest of them was admitted. The clients time connect() and
//     close(), the daemon logs every limit it pushes; a connection's limit is
//     the most the limit was while its connect() ran (±5ms for the log's
//     millisecond timestamps).

// adaptiveServer serves one request per connection with a capacity that
// can change, and records when each connection was accepted and when its
// worker finished, by the client's port.
type adaptiveServer struct {
	addr string
	sem  *fifoSem

	mu   sync.Mutex
	seen []serverConn
}

type serverConn struct {
	port         uint16
	accept, done time.Time
}

func newAdaptiveServer(t *testing.T, ns *privtest.NetNS, listenAddr string, capacity int, serviceTime time.Duration) *adaptiveServer {
	t.Helper()
	var ln net.Listener
	if err := ns.Do(func() (err error) { ln, err = net.Listen("tcp4", listenAddr); return err }); err != nil {
		t.Fatal(err)
	}
	s := &adaptiveServer{addr: ln.Addr().String(), sem: newFIFOSem(capacity)}
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			accept := time.Now()
			wg.Go(func() {
				defer c.Close()
				buf := make([]byte, 1)
				c.SetDeadline(time.Now().Add(10 * time.Second))
				if _, err := c.Read(buf); err != nil {
					return
				}
				s.sem.acquire()
				time.Sleep(time.Duration(float64(serviceTime) * math.Exp(0.5*rand.NormFloat64())))
				s.sem.release()
				// Recorded before the reply: the client closes after it.
				done := time.Now()
				s.mu.Lock()
				s.seen = append(s.seen, serverConn{uint16(c.RemoteAddr().(*net.TCPAddr).Port), accept, done})
				s.mu.Unlock()
				c.Write(buf)
			})
		}
	})
	return s
}

// fifoSem is a semaphore whose capacity can change, serving waiters in
// arrival order: the server's FIFO queue.
type fifoSem struct {
	mu      sync.Mutex
	cap     int
	busy    int
	waiting []chan struct{}
}

func newFIFOSem(n int) *fifoSem { return &fifoSem{cap: n} }

func (s *fifoSem) acquire() {
	s.mu.Lock()
	if s.busy < s.cap && len(s.waiting) == 0 {
		s.busy++
		s.mu.Unlock()
		return
	}
	ch := make(chan struct{})
	s.waiting = append(s.waiting, ch)
	s.mu.Unlock()
	<-ch
}

func (s *fifoSem) release() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.busy--
	s.wake()
}

func (s *fifoSem) setCap(n int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.cap = n
	s.wake()
}

func (s *fifoSem) wake() {
	for s.busy < s.cap && len(s.waiting) > 0 {
		close(s.waiting[0])
		s.waiting = s.waiting[1:]
		s.busy++
	}
}

// clientConn is one connection a client made, on the wall clock that the
// daemon's log uses.
type clientConn struct {
	port                     uint16
	called, returned, closed time.Time
}

// readClientConns reads the intervals privtest's requester wrote, moving
// them from CLOCK_MONOTONIC to the wall clock by offset (privtest.WallOffset).
func readClientConns(t *testing.T, path string, offset time.Duration) []clientConn {
	t.Helper()
	ivs, err := privtest.ReadIntervals(path)
	if err != nil {
		t.Fatal(err)
	}
	wall := func(mono int64) time.Time { return time.Unix(0, mono+int64(offset)) }
	out := make([]clientConn, len(ivs))
	for i, iv := range ivs {
		out[i] = clientConn{iv.Port, wall(iv.Called), wall(iv.From), wall(iv.To)}
	}
	return out
}

// step is a limit pushed to the kernel at t: in force, and settled.
type step struct {
	t              time.Time
	limit, settled int
}

// limitSteps reads the limits the daemon pushed for rule from its debug
// log, after the initial one.
func limitSteps(t *testing.T, log, rule string, initial int, from time.Time) []step {
	t.Helper()
	steps := []step{{from, initial, initial}}
	re := regexp.MustCompile(`time=(\S+) level=DEBUG msg="adaptive limit" rule=` + regexp.QuoteMeta(rule) + ` limit=(\d+) settled=(\d+)`)
	for _, m := range re.FindAllStringSubmatch(log, -1) {
		at, err := time.Parse(time.RFC3339Nano, m[1])
		if err != nil {
			t.Fatalf("log time %q: %v", m[1], err)
		}
		l, _ := strconv.Atoi(m[2])
		s, _ := strconv.Atoi(m[3])
		steps = append(steps, step{at, l, s})
	}
	return steps
}

// mostDuring is the highest limit in force at any time in [a, b].
func mostDuring(steps []step, a, b time.Time) int {
	most := 0
	for i, s := range steps {
		end := time.Unix(1<<62, 0)
		if i+1 < len(steps) {
			end = steps[i+1].t
		}
		if s.t.After(b) || !end.After(a) {
			continue
		}
		most = max(most, s.limit)
	}
	return most
}

// at is the step in force at t.
func at(steps []step, t time.Time) step {
	i, _ := slices.BinarySearchFunc(steps, t, func(s step, t time.Time) int { return s.t.Compare(t) })
	if i < len(steps) && steps[i].t.Equal(t) {
		return steps[i]
	}
	return steps[max(i-1, 0)]
}

// overlap checks that intervals [open, close) never number more at once
// than the most of their allowed: each interval's allowed is the limit in
// force when it was admitted. It returns the most seen at once and the
// violations found.
func overlap(open, close []time.Time, allowed []int) (most int, violations []string) {
	type ev struct {
		t     time.Time
		start bool
		i     int
	}
	var evs []ev
	for i := range open {
		evs = append(evs, ev{open[i], true, i}, ev{close[i], false, i})
	}
	// At one instant, closes first: an interval ends before the next begins.
	slices.SortFunc(evs, func(a, b ev) int {
		if c := a.t.Compare(b.t); c != 0 {
			return c
		}
		if a.start == b.start {
			return 0
		}
		if a.start {
			return 1
		}
		return -1
	})
	count := map[int]int{} // allowed value → intervals open with it
	openNow := 0
	for _, e := range evs {
		a := allowed[e.i]
		if !e.start {
			count[a]--
			openNow--
			continue
		}
		count[a]++
		openNow++
		most = max(most, openNow)
		top := 0
		for v, n := range count {
			if n > 0 {
				top = max(top, v)
			}
		}
		if openNow > top {
			violations = append(violations, fmt.Sprintf("%d open at %s, the limit at most %d", openNow, e.t.Format("15:04:05.000000"), top))
		}
	}
	return most, violations
}

type adaptiveConfig struct {
	capacity, clients int
	service           time.Duration // the median of a worker's time
	phase             time.Duration // each phase; with halve, a second at capacity/2
	halve             bool
	rule              string // the rule's adaptive: mapping
}

type adaptiveResult struct {
	settled         [2][]int // settled limit polled over the second half of each phase
	followRounds    float64  // -1: never
	followAfter     time.Duration
	clientMost      int
	serverMost      int
	violations      []string
	requests        int
	probes          uint64
	baseline        time.Duration
	baselineSource  string
	summary         string
	pushes, inProbe int
	// clockMoved is how far the wall clock moved against the monotonic
	// one during the run.
	clockMoved time.Duration
}

// steadyAdaptiveRun is adaptiveRun, run again (as a subtest each time, up
// to three) while the wall clock moves during a run. The daemon logs its
// limits on the wall clock and the clients time their connections on the
// monotonic one; once the wall clock is set - a paused virtual machine is
// given the time again when it resumes, which this machine's log shows
// ("random: crng reseeded due to virtual machine fork") - the two can no
// longer be laid side by side, and a run measured so proves nothing
// either way.
func steadyAdaptiveRun(t *testing.T, cfg adaptiveConfig) adaptiveResult {
	t.Helper()
	const runs = 3
	for run := 1; ; run++ {
		var r adaptiveResult
		if !t.Run(fmt.Sprint("run", run), func(t *testing.T) { r = adaptiveRun(t, cfg) }) {
			t.FailNow()
		}
		if r.clockMoved.Abs() <= time.Millisecond {
			return r
		}
		if run == runs {
			t.Fatalf("the wall clock moved against the monotonic clock in each of %d runs (last by %v): the daemon's log cannot be matched to the clients' times", runs, r.clockMoved)
		}
		t.Logf("run %d: the wall clock moved %v against the monotonic clock: the daemon's log cannot be matched to the clients' times; running again", run, r.clockMoved)
	}
}

// adaptiveRun runs one adaptive rule against a server of cfg.capacity.
func adaptiveRun(t *testing.T, cfg adaptiveConfig) adaptiveResult {
	e := newEnv(t)
	ns := privtest.NewNetNS(t)
	privtest.VethToHost(t, "10.210.0.1/24", ns, "10.210.0.2/24")
	srv := newAdaptiveServer(t, ns, "10.210.0.2:0", cfg.capacity, cfg.service)

	e.writePolicy(t, "rules:\n  - name: dep\n    destination: 10.210.0.2\n    adaptive: "+cfg.rule+"\n")
	d := e.start(t)
	cl := &control.Client{Socket: e.socket}
	initial, err := cl.Limit(context.Background(), "dep")
	if err != nil {
		t.Fatal(err)
	}

	phases := 1
	if cfg.halve {
		phases = 2
	}
	records := filepath.Join(t.TempDir(), "clients")
	offset := privtest.WallOffset()
	start := time.Now()
	clients := privtest.Spawn(t, e.cg, "requester", srv.addr, strconv.Itoa(cfg.clients), (time.Duration(phases) * cfg.phase).String(), records)

	type poll struct {
		t       time.Time
		settled int
	}
	var polls []poll
	halved := false
	for time.Since(start) < time.Duration(phases)*cfg.phase {
		if cfg.halve && !halved && time.Since(start) >= cfg.phase {
			srv.sem.setCap(cfg.capacity / 2)
			halved = true
		}
		l, err := cl.Limit(context.Background(), "dep")
		if err != nil {
			t.Fatal(err)
		}
		polls = append(polls, poll{time.Now(), int(l.SettledLimit)})
		time.Sleep(20 * time.Millisecond)
	}
	clients.Wait(t)
	final, err := cl.Limit(context.Background(), "dep")
	if err != nil {
		t.Fatal(err)
	}

	var r adaptiveResult
	r.probes, r.baseline, r.baselineSource = final.Probes, time.Duration(final.BaselineSeconds*float64(time.Second)), final.BaselineSource
	halfAt := start.Add(cfg.phase)
	for _, p := range polls {
		for ph := range phases {
			from := start.Add(time.Duration(ph)*cfg.phase + cfg.phase/2)
			if !p.t.Before(from) && p.t.Before(from.Add(cfg.phase/2)) {
				r.settled[ph] = append(r.settled[ph], p.settled)
			}
		}
	}

	steps := limitSteps(t, d.log.String(), "dep", int(initial.Limit), start.Add(-time.Hour))
	r.pushes = len(steps) - 1
	for _, s := range steps {
		if s.limit < s.settled {
			r.inProbe++
		}
	}
	conns := readClientConns(t, records, offset)
	r.requests = len(conns)
	r.clockMoved = privtest.WallOffset() - offset

	// Follow: rounds from the halving to when the limit came down for
	// good, counting each completed request as 1 / the limit in force:
	// the first settled limit at most 2.2 × c/2, or the start of a probe
	// that held the limit in force that low until then (bench/adaptivesim
	// reads its traces alike).
	r.followRounds = -1
	if cfg.halve {
		top := int(2.2 * float64(cfg.capacity/2))
		first, _ := slices.BinarySearchFunc(steps, halfAt, func(s step, t time.Time) int { return s.t.Compare(t) })
		after := append([]step{{halfAt, at(steps, halfAt).limit, at(steps, halfAt).settled}}, steps[first:]...)
		if i := slices.IndexFunc(after, func(s step) bool { return s.settled <= top }); i >= 0 {
			for i > 0 && after[i-1].limit <= top {
				i--
			}
			followed := after[i].t
			r.followAfter = followed.Sub(halfAt)
			r.followRounds = 0
			for _, c := range conns {
				if !c.closed.Before(halfAt) && c.closed.Before(followed) {
					r.followRounds += 1 / float64(at(steps, c.closed).limit)
				}
			}
		}
	}

	// Concurrency, from the clients' side and from the server's.
	const skew = 5 * time.Millisecond
	byPort := map[uint16][]int{}
	var open, closed []time.Time
	var allowed []int
	for i, c := range conns {
		byPort[c.port] = append(byPort[c.port], i)
		open, closed = append(open, c.returned), append(closed, c.closed)
		allowed = append(allowed, allowedFor(conns, i, steps, skew))
	}
	var v []string
	r.clientMost, v = overlap(open, closed, allowed)
	r.violations = append(r.violations, prefix("clients: ", v)...)
	srv.mu.Lock()
	seen := slices.Clone(srv.seen)
	srv.mu.Unlock()
	open, closed, allowed = nil, nil, nil
	unmatched := 0
	for _, s := range seen {
		i := slices.IndexFunc(byPort[s.port], func(i int) bool { return !s.accept.Before(conns[i].called) && !s.done.After(conns[i].closed) })
		if i < 0 {
			unmatched++ // a connection whose client gave up, or was killed at the end
			continue
		}
		open, closed = append(open, s.accept), append(closed, s.done)
		allowed = append(allowed, allowedFor(conns, byPort[s.port][i], steps, skew))
	}
	r.serverMost, v = overlap(open, closed, allowed)
	r.violations = append(r.violations, prefix("server: ", v)...)
	r.summary = fmt.Sprintf("%d requests (%d server-side, %d not matched to a client), %d limit pushes (%d into or within probes), %d probes, baseline %v from %s",
		r.requests, len(seen), unmatched, r.pushes, r.inProbe, r.probes, r.baseline.Round(10*time.Microsecond), r.baselineSource)
	return r
}

// allowedFor is the limit connection i was admitted under: the most it was
// while its connect() ran, give or take skew.
func allowedFor(conns []clientConn, i int, steps []step, skew time.Duration) int {
	return mostDuring(steps, conns[i].called.Add(-skew), conns[i].returned.Add(skew))
}

func prefix(p string, lines []string) []string {
	out := make([]string, len(lines))
	for i, l := range lines {
		out[i] = p + l
	}
	return out
}

// quantile is the q-quantile (nearest rank) of xs.
func quantile(xs []int, q float64) int {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s) == 0 {
		return 0
	}
	return s[max(int(math.Ceil(q*float64(len(s))))-1, 0)]
}

// TestAdaptiveDefaults: an adaptive rule with only its defaults (drain
// probes, request latency) settles between c and 2.2c (its 95th
// percentile at most 2.5c), follows the capacity down when it halves, and
// the server never sees more than the limit allowed.
func TestAdaptiveDefaults(t *testing.T) {
	const c = 12
	r := steadyAdaptiveRun(t, adaptiveConfig{capacity: c, clients: 8 * c, service: 25 * time.Millisecond, phase: 6 * time.Second, halve: true, rule: "{}"})
	t.Logf("capacity %d then %d, %d clients: %s", c, c/2, 8*c, r.summary)
	t.Logf("settled limit, second half of each phase: median %d p95 %d at c=%d; median %d p95 %d at c/2=%d",
		quantile(r.settled[0], 0.5), quantile(r.settled[0], 0.95), c, quantile(r.settled[1], 0.5), quantile(r.settled[1], 0.95), c/2)
	t.Logf("followed the halving in %.1f rounds (%v); at most %d connections open at once seen by the clients, %d by the server",
		r.followRounds, r.followAfter.Round(time.Millisecond), r.clientMost, r.serverMost)
	for ph, band := range []int{c, c / 2} {
		if m := quantile(r.settled[ph], 0.5); m < band || float64(m) > 2.2*float64(band) || len(r.settled[ph]) < 20 {
			t.Errorf("phase %d: settled limit median %d over %d polls; want inside [%d, %.1f]", ph, m, len(r.settled[ph]), band, 2.2*float64(band))
		}
		if p95 := quantile(r.settled[ph], 0.95); float64(p95) > 2.5*float64(band) {
			t.Errorf("phase %d: settled limit p95 %d; want at most %.1f", ph, p95, 2.5*float64(band))
		}
	}
	if r.followRounds < 0 || r.followRounds > 10 {
		t.Errorf("followed the halving in %.1f rounds; want at most 10 (-1: never)", r.followRounds)
	}
	for _, v := range r.violations[:min(len(r.violations), 10)] {
		t.Error(v)
	}
	if r.probes == 0 || r.baselineSource != "probes" {
		t.Errorf("the loop ran no probes (%d, baseline from %q): the defaults are not in force", r.probes, r.baselineSource)
	}
}

// TestAdaptiveConnectSamples is why request latency is the default: the
// server's kernel completes the handshake at once, whether or not its
// workers queue, so connect latency never shows the queue and the limit
// climbs far above the capacity.
func TestAdaptiveConnectSamples(t *testing.T) {
	const c = 12
	r := steadyAdaptiveRun(t, adaptiveConfig{capacity: c, clients: 8 * c, service: 25 * time.Millisecond, phase: 5 * time.Second, rule: "{samples: connect}"})
	t.Logf("capacity %d, %d clients, samples: connect: %s; settled limit, second half: median %d p95 %d; at most %d open at once",
		c, 8*c, r.summary, quantile(r.settled[0], 0.5), quantile(r.settled[0], 0.95), r.serverMost)
	if m := quantile(r.settled[0], 0.5); float64(m) <= 2.2*c {
		t.Errorf("settled limit median %d on connect samples; want above %.1f: connect latency should not see the server's queue", m, 2.2*c)
	}
	for _, v := range r.violations[:min(len(r.violations), 10)] {
		t.Error(v)
	}
}
