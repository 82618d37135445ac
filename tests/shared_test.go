package tests

import (
	"context"
	"fmt"
	"io"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/egressd/egressd/internal/privtest"
	"github.com/egressd/egressd/internal/redistest"
	"github.com/egressd/egressd/pkg/control"
)

// holdServer answers one byte per connection after holding it for a
// while, and counts the connections it holds: in all, and per host (by
// the client's address). A connection counts from accept until the
// answer: its client holds it throughout, so the count never exceeds what
// the clients' kernels hold. (Counting until the client's FIN arrives
// would count connections the client already closed.)
type holdServer struct {
	port     int
	hold     time.Duration
	mu       sync.Mutex
	now, max int
	byHost   map[string]int
	maxHost  map[string]int
	accepted atomic.Int64
}

func newHoldServer(t *testing.T, ns *privtest.NetNS, hold time.Duration) *holdServer {
	t.Helper()
	var ln net.Listener
	if err := ns.Do(func() (err error) { ln, err = net.Listen("tcp4", "0.0.0.0:0"); return err }); err != nil {
		t.Fatal(err)
	}
	s := &holdServer{port: ln.Addr().(*net.TCPAddr).Port, hold: hold, byHost: map[string]int{}, maxHost: map[string]int{}}
	var wg sync.WaitGroup
	var conns sync.Map
	t.Cleanup(func() {
		ln.Close()
		conns.Range(func(c, _ any) bool { c.(net.Conn).Close(); return true })
		wg.Wait()
	})
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			conns.Store(c, true)
			wg.Go(func() {
				defer conns.Delete(c)
				defer c.Close()
				host, _, _ := net.SplitHostPort(c.RemoteAddr().String())
				s.add(host, 1)
				s.accepted.Add(1)
				c.SetDeadline(time.Now().Add(10 * time.Second))
				buf := make([]byte, 1)
				_, err := c.Read(buf)
				if err == nil {
					time.Sleep(s.hold)
				}
				s.add(host, -1)
				if err == nil {
					c.Write(buf)
				}
				io.Copy(io.Discard, c) // until the client closes
			})
		}
	})
	return s
}

func (s *holdServer) add(host string, d int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.now += d
	s.byHost[host] += d
	s.max = max(s.max, s.now)
	s.maxHost[host] = max(s.maxHost[host], s.byHost[host])
}

// peaks returns the most connections held at once, in all and per host,
// since the last call, and starts counting afresh from what is held now.
func (s *holdServer) peaks() (total int, byHost map[string]int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	total, byHost = s.max, s.maxHost
	s.max, s.maxHost = s.now, map[string]int{}
	for h, n := range s.byHost {
		s.maxHost[h] = n
	}
	return total, byHost
}

// sharingHost is one "host": a network namespace linked to the
// dependency's, a cgroup, and an egressd of its own sharing a budget in
// Redis with the others.
type sharingHost struct {
	*env
	ns     *privtest.NetNS
	client string // this host's address, as the dependency sees it
	dest   string // the dependency's address, from this host
	d      *daemon
}

func newSharingHost(t *testing.T, i int, dep *privtest.NetNS, rule string) *sharingHost {
	t.Helper()
	h := &sharingHost{env: newEnv(t), ns: privtest.NewNetNS(t)}
	h.client, h.dest = fmt.Sprintf("10.212.%d.2", i), fmt.Sprintf("10.212.%d.1", i)
	privtest.Veth(t, dep, h.dest+"/24", h.ns, h.client+"/24")
	h.args = []string{"--host-id", fmt.Sprintf("host-%d", i)}
	h.writePolicy(t, "rules:\n"+strings.ReplaceAll(rule, "DEST", h.dest))
	if rule == "" {
		h.writePolicy(t, "")
	}
	h.d = h.start(t)
	return h
}

// load runs closed-loop clients in the host's namespace and cgroup.
func (h *sharingHost) load(t *testing.T, port, clients int, d time.Duration) *privtest.Child {
	return h.ns.Spawn(t, h.cg, "requester", fmt.Sprintf("%s:%d", h.dest, port), fmt.Sprint(clients), d.String())
}

func (h *sharingHost) share(t *testing.T, rule string) control.Limit {
	t.Helper()
	l := h.limit(t, rule)
	if l.Shared == nil {
		t.Fatalf("rule %s has no share: %+v", rule, l)
	}
	return l
}

func sharedRule(name, limit, redisURL, key, mode string) string {
	r := fmt.Sprintf("  - name: %s\n    destination: DEST\n    %s\n    shared: {redis: %q, key: %q", name, limit, redisURL, key)
	if mode != "" {
		r += ", failureMode: " + mode
	}
	return r + "}\n"
}

// TestSharedConcurrencyAcrossHosts runs three daemons as three hosts
// sharing a concurrency budget of 10 for one dependency. What the
// dependency saw is the judge: never more than 10 connections at once,
// whoever has the demand; a host with all of it gets nearly all the
// budget; and through a Redis outage (FailureMode throw: each host keeps
// its share) and Redis coming back empty, still never more than 10, and
// the sharing resumes.
func TestSharedConcurrencyAcrossHosts(t *testing.T) {
	privtest.RequireRoot(t)
	rds := redistest.Start(t)
	dep := privtest.NewNetNS(t)
	srv := newHoldServer(t, dep, 30*time.Millisecond)
	rule := sharedRule("pool", "concurrency: 10", rds.URL(), "egressd-test:pool", "")
	var hosts []*sharingHost
	for i := range 3 {
		hosts = append(hosts, newSharingHost(t, i+1, dep, rule))
	}
	checkPeak := func(phase string) {
		t.Helper()
		total, byHost := srv.peaks()
		t.Logf("%s: the dependency held at most %d connections at once (per host %v)", phase, total, byHost)
		if total > 10 {
			t.Errorf("%s: the dependency held %d connections at once; the shared budget is 10", phase, total)
		}
	}

	// All the demand on one host: the idle two hand their shares back.
	lone := hosts[0].load(t, srv.port, 30, 3*time.Second)
	most := 0
	for start := time.Now(); time.Since(start) < 3*time.Second; time.Sleep(50 * time.Millisecond) {
		most = max(most, hosts[0].share(t, "pool").Shared.Slots)
	}
	t.Logf("one host busy: %s; it held up to %d slots", lone.Line(t), most)
	lone.Wait(t)
	if most < 9 {
		t.Errorf("the only busy host held at most %d of 10 slots; want nearly all", most)
	}
	checkPeak("one host busy")

	// Demand everywhere: the budget is split, never exceeded.
	var loads []*privtest.Child
	for _, h := range hosts {
		loads = append(loads, h.load(t, srv.port, 20, 6*time.Second))
	}
	time.Sleep(2 * time.Second)
	_, byHost := srv.peaks()
	srv.peaks()
	for _, h := range hosts {
		if byHost[h.client] < 2 {
			t.Errorf("three hosts busy: host %s had at most %d connections at once (%v); busy hosts split the budget", h.client, byHost[h.client], byHost)
		}
	}
	checkPeak("three hosts busy")

	// Redis goes away: each host keeps the share it held.
	held := make([]uint32, len(hosts))
	rds.Stop()
	for i, h := range hosts {
		h := h
		eventually(t, fmt.Sprintf("host %d sees Redis unreachable", i+1), func() bool { return !h.share(t, "pool").Shared.Reachable })
		held[i] = h.share(t, "pool").Limit
	}
	time.Sleep(time.Second)
	var sum uint32
	for i, h := range hosts {
		l := h.share(t, "pool")
		t.Logf("host %d during the outage: limit %d (held %d when it noticed), live %d, failure mode %s: %s", i+1, l.Limit, held[i], l.Live, l.Shared.FailureMode, l.Shared.Error)
		if l.Limit != held[i] || l.Shared.FailureMode != "throw" {
			t.Errorf("host %d: limit %d in mode %s during the outage; throw keeps the share held, %d", i+1, l.Limit, l.Shared.FailureMode, held[i])
		}
		sum += l.Limit
	}
	if sum > 10 {
		t.Errorf("the hosts' shares add up to %d during the outage; the budget is 10", sum)
	}
	if out := hosts[0].ok(t, "status"); !strings.Contains(out, "shared budgets: 1 rules, Redis UNREACHABLE for pool") {
		t.Errorf("status during the outage:\n%s", out)
	}
	m := hosts[0].scrape(t)
	if up, ok := m.value("egressd_shared_store_up", map[string]string{"rule": "pool"}); !ok || up != 0 {
		t.Errorf("egressd_shared_store_up = %v (present %v) during the outage, want 0", up, ok)
	}
	checkPeak("Redis down")

	// Redis comes back empty: the hosts find their shares again.
	rds.Restart()
	for i, h := range hosts {
		h := h
		eventually(t, fmt.Sprintf("host %d sees Redis again", i+1), func() bool { return h.share(t, "pool").Shared.Reachable })
	}
	time.Sleep(1500 * time.Millisecond)
	sum = 0
	for _, h := range hosts {
		sum += uint32(h.share(t, "pool").Shared.Slots)
	}
	if sum == 0 || sum > 10 {
		t.Errorf("after Redis came back the hosts hold %d slots in all, want 1..10", sum)
	}
	for i, l := range loads {
		t.Logf("host %d clients: %s", i+1, l.Line(t))
		l.Wait(t)
	}
	checkPeak("Redis back")
	if out := hosts[0].ok(t, "status"); !strings.Contains(out, "shared budgets: 1 rules, Redis reachable") {
		t.Errorf("status after Redis came back:\n%s", out)
	}
	if m := hosts[0].scrape(t); func() bool {
		v, ok := m.value("egressd_shared_store_up", map[string]string{"rule": "pool"})
		return !ok || v != 1
	}() {
		t.Error("egressd_shared_store_up is not 1 after Redis came back")
	}
}

// TestSharedFailureModes shows the other two failure modes while Redis is
// away: allow enforces the whole limit as if the host were alone, deny
// admits nothing new; both share again once Redis returns.
func TestSharedFailureModes(t *testing.T) {
	privtest.RequireRoot(t)
	rds := redistest.Start(t)
	dep := privtest.NewNetNS(t)
	srv := newHoldServer(t, dep, 30*time.Millisecond)
	allow := newSharingHost(t, 4, dep, sharedRule("pool", "concurrency: 10", rds.URL(), "egressd-test:modes", "allow"))
	// The second host's rule comes from the CLI.
	deny := newSharingHost(t, 5, dep, "")
	out := deny.ok(t, "limit", "set", "pool", "--dest", deny.dest, "--concurrency", "10",
		"--shared-redis", rds.URL(), "--shared-key", "egressd-test:modes", "--shared-failure-mode", "deny")
	if !strings.Contains(out, "shared: key egressd-test:modes, reachable") {
		t.Errorf("limit set of a shared rule says:\n%s", out)
	}

	loads := []*privtest.Child{allow.load(t, srv.port, 20, 5*time.Second), deny.load(t, srv.port, 20, 5*time.Second)}
	time.Sleep(time.Second)
	_, byHost := srv.peaks()
	if byHost[deny.client] == 0 || byHost[allow.client] == 0 {
		t.Errorf("before the outage each host should have had connections: %v", byHost)
	}

	rds.Stop()
	eventually(t, "both hosts see Redis unreachable", func() bool {
		return !allow.share(t, "pool").Shared.Reachable && !deny.share(t, "pool").Shared.Reachable
	})
	// Connections open when Redis went away drain; then deny admits none.
	time.Sleep(500 * time.Millisecond)
	srv.peaks()
	before := deny.limit(t, "pool").Admitted
	time.Sleep(1500 * time.Millisecond)
	_, byHost = srv.peaks()
	al, dl := allow.share(t, "pool"), deny.share(t, "pool")
	t.Logf("outage: allow host limit %d, dependency saw up to %d of its connections; deny host limit %d, admitted %d more, dependency saw up to %d",
		al.Limit, byHost[allow.client], dl.Limit, dl.Admitted-before, byHost[deny.client])
	if al.Limit != 10 || al.Shared.FailureMode != "allow" {
		t.Errorf("allow host: limit %d in mode %s during the outage, want the whole 10", al.Limit, al.Shared.FailureMode)
	}
	if dl.Limit != 0 || dl.Admitted != before || byHost[deny.client] != 0 || dl.Shared.FailureMode != "deny" {
		t.Errorf("deny host: limit %d, admitted %d more, dependency saw %d of its connections in mode %s; deny admits nothing",
			dl.Limit, dl.Admitted-before, byHost[deny.client], dl.Shared.FailureMode)
	}

	rds.Restart()
	eventually(t, "both hosts share again", func() bool {
		a, d := allow.share(t, "pool"), deny.share(t, "pool")
		return a.Shared.Reachable && d.Shared.Reachable && d.Limit > 0
	})
	time.Sleep(time.Second) // connections admitted by allow's whole limit drain
	srv.peaks()
	time.Sleep(time.Second)
	total, byHost := srv.peaks()
	t.Logf("shared again: the dependency held at most %d at once (%v)", total, byHost)
	if total > 10 || byHost[deny.client] == 0 {
		t.Errorf("after Redis returned: dependency held %d at once, %d from the deny host; want ≤ 10 and some", total, byHost[deny.client])
	}
	for _, l := range loads {
		l.Line(t)
		l.Wait(t)
	}
}

// TestSharedRateAcrossHosts shares a per-second budget between two hosts
// pushing far above it: what the dependency accepted over the run stays
// within the budget's burst and rate, and most of the budget is used.
func TestSharedRateAcrossHosts(t *testing.T) {
	privtest.RequireRoot(t)
	rds := redistest.Start(t)
	dep := privtest.NewNetNS(t)
	srv := newHoldServer(t, dep, 0)
	rule := sharedRule("rate", "perSecond: {permits: 50}", rds.URL(), "egressd-test:rate", "")
	a := newSharingHost(t, 6, dep, rule)
	b := newSharingHost(t, 7, dep, rule)

	const run = 4 * time.Second
	start := time.Now()
	loads := []*privtest.Child{a.load(t, srv.port, 8, run), b.load(t, srv.port, 8, run)}
	for _, l := range loads {
		t.Logf("clients: %s", l.Line(t))
		l.Wait(t)
	}
	elapsed := time.Since(start)
	accepted := srv.accepted.Load()
	// The bucket starts full (50) and gains 50 a second.
	most := 50 + 50*elapsed.Seconds()
	la, lb := a.share(t, "rate"), b.share(t, "rate")
	t.Logf("%v: the dependency accepted %d connections (budget at most %.0f); host A spent %d, host B %d; granted %d and %d, handed back %d and %d",
		elapsed.Round(time.Millisecond), accepted, most, la.Shared.Spent, lb.Shared.Spent, la.Shared.Granted, lb.Shared.Granted, la.Shared.Returned, lb.Shared.Returned)
	if float64(accepted) > most {
		t.Errorf("the dependency accepted %d connections in %v; the shared budget allows %.0f", accepted, elapsed, most)
	}
	if float64(accepted) < 0.7*50*run.Seconds() {
		t.Errorf("only %d connections in %v: the hosts used under 70%% of a budget of 50/s", accepted, run)
	}
	if la.Shared.Spent == 0 || lb.Shared.Spent == 0 {
		t.Errorf("a host got none of the budget: spent %d and %d", la.Shared.Spent, lb.Shared.Spent)
	}
	// Idle, each host hands back what it claimed and did not spend, but
	// one permit.
	time.Sleep(1500 * time.Millisecond)
	for i, h := range []*sharingHost{a, b} {
		l := h.share(t, "rate")
		if l.Shared.Granted > l.Shared.Spent+1 {
			t.Errorf("host %d idle for 1.5s still holds %d unspent permits (granted %d, spent %d, handed back %d)",
				i+1, l.Shared.Granted-l.Shared.Spent, l.Shared.Granted, l.Shared.Spent, l.Shared.Returned)
		}
	}
	// One connection after the idle spell: admitted on the permit kept;
	// the host claims a batch ahead of demand, and hands all but one
	// back when idle again.
	one := a.load(t, srv.port, 1, time.Millisecond)
	// (The client keeps connecting for its millisecond; its first
	// connection is the one that counts.)
	if line := one.Line(t); !strings.HasPrefix(line, "done ok 1 ") {
		t.Errorf("a connection after an idle spell: %s; want the first admitted", line)
	}
	one.Wait(t)
	time.Sleep(1500 * time.Millisecond)
	if l := a.share(t, "rate"); l.Shared.Granted != l.Shared.Spent+1 || l.Shared.Returned <= la.Shared.Returned {
		t.Errorf("after one connection and an idle spell: granted %d, spent %d, handed back %d (was %d); want the unspent batch handed back",
			l.Shared.Granted, l.Shared.Spent, l.Shared.Returned, la.Shared.Returned)
	} else {
		t.Logf("after one connection and an idle spell: granted %d, spent %d, handed back %d", l.Shared.Granted, l.Shared.Spent, l.Shared.Returned)
	}
	if la.Shape != "per_second" {
		t.Errorf("shape %q, want per_second", la.Shape)
	}
}

// loadRecorded is load with every connection's client-side interval
// recorded; intervals reads them once the clients are done.
func (h *sharingHost) loadRecorded(t *testing.T, port, clients int, d time.Duration) *recordedLoad {
	path := filepath.Join(t.TempDir(), "intervals")
	return &recordedLoad{Child: h.ns.Spawn(t, h.cg, "requester", fmt.Sprintf("%s:%d", h.dest, port), fmt.Sprint(clients), d.String(), path), path: path}
}

type recordedLoad struct {
	*privtest.Child
	path string
}

// intervals waits for the clients to finish and returns their intervals.
func (l *recordedLoad) intervals(t *testing.T) []privtest.Interval {
	t.Helper()
	t.Logf("clients: %s", l.Line(t))
	l.Wait(t)
	ivs, err := privtest.ReadIntervals(l.path)
	if err != nil {
		t.Fatal(err)
	}
	return ivs
}

func TestSharedStartTogetherExperiment(t *testing.T) {
	privtest.RequireRoot(t)
	rds := redistest.Start(t)
	dep := privtest.NewNetNS(t)
	srv := newHoldServer(t, dep, 30*time.Millisecond)
	for round := range 10 {
		key := fmt.Sprintf("egressd-test:together-%d", round)
		rule := sharedRule("pool", "concurrency: 10", rds.URL(), key, "")
		var hosts []*sharingHost
		for i := range 3 {
			hosts = append(hosts, newSharingHostStopped(t, 20+round*3+i, dep, rule))
		}
		var wg sync.WaitGroup
		var mu sync.Mutex
		var ready int64
		for _, h := range hosts {
			wg.Go(func() {
				h.d = h.start(t)
				mu.Lock()
				ready = max(ready, privtest.Monotonic())
				mu.Unlock()
			})
		}
		wg.Wait()
		start := privtest.Monotonic()
		var loads []*recordedLoad
		for _, h := range hosts {
			loads = append(loads, h.loadRecorded(t, srv.port, 20, 2*time.Second))
		}
		t.Logf("daemons ready at +%d ms", (ready-start)/1e6)
		ready = start
		type sample struct {
			at          int64
			host        int
			limit, live int64
			slots       int
		}
		var samples []sample
		stopPoll := make(chan struct{})
		var pollWG sync.WaitGroup
		for i, h := range hosts {
			pollWG.Go(func() {
				cl := &control.Client{Socket: h.socket, Timeout: time.Second}
				for {
					select {
					case <-stopPoll:
						return
					default:
					}
					var l control.Limit
					if err := cl.Get(context.Background(), "limit?name=pool", &l); err == nil && l.Shared != nil {
						mu.Lock()
						samples = append(samples, sample{privtest.Monotonic(), i, int64(l.Limit), l.Live, l.Shared.Slots})
						mu.Unlock()
					}
					time.Sleep(5 * time.Millisecond)
				}
			})
		}
		var all []privtest.Interval
		for _, l := range loads {
			all = append(all, l.intervals(t)...)
		}
		close(stopPoll)
		pollWG.Wait()
		for _, sm := range samples {
			if sm.at-ready < 400e6 {
				t.Logf("  +%d ms host %d: limit %d live %d slots %d", (sm.at-ready)/1e6, sm.host, sm.limit, sm.live, sm.slots)
			}
		}
		for _, w := range [][2]int64{{0, 100}, {100, 200}, {200, 500}, {500, 3000}} {
			most, at := privtest.MaxOverlap(all, ready+w[0]*1e6, ready+w[1]*1e6)
			t.Logf("round %d ready+[%d ms, %d ms): clients held %d at once (at ready+%d ms)", round, w[0], w[1], most, (at-ready)/1e6)
		}
	}
}

func newSharingHostStopped(t *testing.T, i int, dep *privtest.NetNS, rule string) *sharingHost {
	t.Helper()
	h := &sharingHost{env: newEnv(t), ns: privtest.NewNetNS(t)}
	h.client, h.dest = fmt.Sprintf("10.212.%d.2", i), fmt.Sprintf("10.212.%d.1", i)
	privtest.Veth(t, dep, h.dest+"/24", h.ns, h.client+"/24")
	h.args = []string{"--host-id", fmt.Sprintf("host-%d", i)}
	h.writePolicy(t, "rules:\n"+strings.ReplaceAll(rule, "DEST", h.dest))
	return h
}
