package tests

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/internal/privtest"
	"github.com/egressd/egressd/internal/redistest"
	"github.com/egressd/egressd/pkg/control"
)

// holdServer answers one byte per connection after holding it for a
// while, and counts the connections it accepted. The tests judge a limit
// by the clients' intervals, not by what the server saw: its view lags
// behind the clients' closes.
type holdServer struct {
	port     int
	hold     time.Duration
	accepted atomic.Int64
}

func newHoldServer(t *testing.T, ns *privtest.NetNS, hold time.Duration) *holdServer {
	t.Helper()
	var ln net.Listener
	if err := ns.Do(func() (err error) { ln, err = net.Listen("tcp4", "0.0.0.0:0"); return err }); err != nil {
		t.Fatal(err)
	}
	s := &holdServer{port: ln.Addr().(*net.TCPAddr).Port, hold: hold}
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
				s.accepted.Add(1)
				c.SetDeadline(time.Now().Add(10 * time.Second))
				buf := make([]byte, 1)
				_, err := c.Read(buf)
				if err == nil {
					time.Sleep(s.hold)
				}
				if err == nil {
					c.Write(buf)
				}
				io.Copy(io.Discard, c) // until the client closes
			})
		}
	})
	return s
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
	// viaVeth is this host's address of the test's namespace, where Redis
	// listens, when its daemon runs in the host's namespace.
	viaVeth string
}

// newSharingHost starts a host whose daemon runs in the test's namespace,
// with rule (DEST is replaced by the dependency's address).
func newSharingHost(t *testing.T, i int, dep *privtest.NetNS, rule string) *sharingHost {
	t.Helper()
	h := prepareHost(t, i, dep)
	h.writePolicy(t, "rules:\n"+strings.ReplaceAll(rule, "DEST", h.dest))
	if rule == "" {
		h.writePolicy(t, "")
	}
	h.d = h.start(t)
	return h
}

func prepareHost(t *testing.T, i int, dep *privtest.NetNS) *sharingHost {
	t.Helper()
	h := &sharingHost{env: newEnv(t), ns: privtest.NewNetNS(t)}
	h.client, h.dest = fmt.Sprintf("10.212.%d.2", i), fmt.Sprintf("10.212.%d.1", i)
	privtest.Veth(t, dep, h.dest+"/24", h.ns, h.client+"/24")
	h.args = []string{"--host-id", fmt.Sprintf("host-%d", i)}
	return h
}

// load runs closed-loop clients in the host's namespace and cgroup.
func (h *sharingHost) load(t *testing.T, port, clients int, d time.Duration) *privtest.Child {
	return h.ns.Spawn(t, h.cg, "requester", fmt.Sprintf("%s:%d", h.dest, port), fmt.Sprint(clients), d.String())
}

// rule asks the daemon for a rule through the control API (faster than
// the CLI, for polling).
func (e *env) rule(t *testing.T, name string) control.Limit {
	t.Helper()
	cl := &control.Client{Socket: e.socket, Timeout: 5 * time.Second}
	defer cl.CloseIdleConnections()
	var l control.Limit
	if err := cl.Get(context.Background(), "limit?name="+name, &l); err != nil {
		t.Fatalf("limit %s: %v", name, err)
	}
	return l
}

// share is rule for a shared rule.
func (h *sharingHost) share(t *testing.T, rule string) control.Limit {
	t.Helper()
	l := h.rule(t, rule)
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

// world is hosts sharing one concurrency budget for a dependency, through
// one Redis; it records what every client saw, to judge the budget by.
type world struct {
	t      *testing.T
	rds    *redistest.Server
	dep    *privtest.NetNS
	srv    *holdServer
	hosts  []*sharingHost
	budget int
	// protocols, when set, is the shared rule's protocols, e.g. "[tcp, udp]".
	protocols string
	binds     []string
	loads     []*recordedLoad
	ivs       []privtest.Interval
	byHost    map[int][]privtest.Interval // by index in hosts
}

// newWorld makes a world whose dependency holds each connection 20 ms.
func newWorld(t *testing.T, rds *redistest.Server, budget int) *world {
	return newWorldHolding(t, rds, budget, 20*time.Millisecond)
}

func newWorldHolding(t *testing.T, rds *redistest.Server, budget int, hold time.Duration) *world {
	privtest.RequireRoot(t)
	dep := privtest.NewNetNS(t)
	return &world{t: t, rds: rds, dep: dep, srv: newHoldServer(t, dep, hold), budget: budget, byHost: map[int][]privtest.Interval{}}
}

// addHost starts a host whose policy is the shared rule "pool", shared
// being its shared mapping's settings but redis (e.g. "key: k, lease:
// 3s"), or all of them when they name redis. With inNetNS its daemon runs
// in the host's namespace and reaches Redis over a veth, so a firewall
// rule there cuts it off.
func (w *world) addHost(shared string, inNetNS bool) *sharingHost {
	t := w.t
	t.Helper()
	i := 30 + len(w.hosts)
	h := prepareHost(t, i, w.dep)
	redisAddr := w.rds.Addr()
	if inNetNS {
		h.viaVeth = fmt.Sprintf("10.213.%d.1", i)
		privtest.VethToHost(t, h.viaVeth+"/24", h.ns, fmt.Sprintf("10.213.%d.2/24", i))
		w.binds = append(w.binds, h.viaVeth)
		w.rds.Bind(t, w.binds...)
		redisAddr = fmt.Sprintf("%s:%d", h.viaVeth, w.rds.Port())
		h.env.ns = h.ns
	}
	if !strings.Contains(shared, "redis:") {
		shared = fmt.Sprintf(`redis: "redis://%s", %s`, redisAddr, shared)
	}
	protocols := ""
	if w.protocols != "" {
		protocols = "    protocols: " + w.protocols + "\n"
	}
	h.writePolicy(t, fmt.Sprintf("rules:\n  - name: pool\n    destination: %s\n%s    concurrency: %d\n    shared: {%s}\n", h.dest, protocols, w.budget, shared))
	h.d = h.start(t)
	w.hosts = append(w.hosts, h)
	return h
}

// busy starts clients on h until stopAll.
func (w *world) busy(h *sharingHost, clients int) {
	path := filepath.Join(w.t.TempDir(), "intervals")
	c := h.ns.Spawn(w.t, h.cg, "requester", fmt.Sprintf("%s:%d", h.dest, w.srv.port), fmt.Sprint(clients), "10m", path)
	w.loads = append(w.loads, &recordedLoad{Child: c, path: path, host: slices.Index(w.hosts, h)})
}

// stopAll stops every host's clients and keeps what they saw.
func (w *world) stopAll() {
	for _, l := range w.loads {
		l.CloseInput()
	}
	for _, l := range w.loads {
		ivs := l.intervals(w.t)
		w.ivs = append(w.ivs, ivs...)
		w.byHost[l.host] = append(w.byHost[l.host], ivs...)
	}
	w.loads = nil
}

// held returns the most connections the clients held at once (a lower
// bound on what the kernels held) between from and to, Monotonic
// instants; stopAll first.
func (w *world) held(from, to int64) int {
	most, _ := privtest.MaxOverlap(w.ivs, from, to)
	return most
}

// check fails the test if, between from and to, the clients held more
// connections at once than the budget; it logs what they held.
func (w *world) check(phase string, from, to int64) int {
	w.t.Helper()
	most, at := privtest.MaxOverlap(w.ivs, from, to)
	w.t.Logf("%s: the clients held at most %d connections at once (budget %d)", phase, most, w.budget)
	if most > w.budget {
		w.t.Errorf("%s: the clients held %d connections at once, %.0f ms into it; the shared budget is %d", phase, most, float64(at-from)/1e6, w.budget)
	}
	return most
}

// thawed waits until no host reports the budget frozen.
func (w *world) thawed() {
	w.t.Helper()
	for i, h := range w.hosts {
		clocktest.Eventually(w.t, fmt.Sprintf("host %d to see the budget thawed", i+1), func() bool { return h.share(w.t, "pool").Shared.FrozenUntil.IsZero() })
	}
}

// idle waits until every host has handed its whole share back, as a host
// without connections does.
func (w *world) idle() {
	w.t.Helper()
	for i, h := range w.hosts {
		clocktest.Eventually(w.t, fmt.Sprintf("host %d to hand its share back", i+1), func() bool { return h.share(w.t, "pool").Shared.Slots == 0 })
	}
}

// slots returns the slots each host holds, as its daemon says.
func (w *world) slots() []int {
	var out []int
	for _, h := range w.hosts {
		out = append(out, h.share(w.t, "pool").Shared.Slots)
	}
	return out
}

type recordedLoad struct {
	*privtest.Child
	path string
	host int
}

// intervals waits for the clients to finish and returns their intervals.
func (l *recordedLoad) intervals(t *testing.T) []privtest.Interval {
	t.Helper()
	if line := l.Line(t); !strings.HasPrefix(line, "done ") {
		t.Errorf("clients: %s", line)
	}
	l.Wait(t)
	ivs, err := privtest.ReadIntervals(l.path)
	if err != nil {
		t.Fatal(err)
	}
	return ivs
}

// pause stops a daemon's process (SIGSTOP) until resume: it renews
// nothing, and its kernel keeps enforcing what it last wrote.
func (d *daemon) pause(t *testing.T)  { d.signal(t, syscall.SIGSTOP) }
func (d *daemon) resume(t *testing.T) { d.signal(t, syscall.SIGCONT) }

func (d *daemon) signal(t *testing.T, sig syscall.Signal) {
	t.Helper()
	if err := d.cmd.Process.Signal(sig); err != nil {
		t.Fatal(err)
	}
}

// cut drops what the host sends to Redis's port, with a firewall rule in
// its namespace, until the returned function is called: Redis calls time
// out, as across a network partition.
func (w *world) cut(h *sharingHost) (restore func()) {
	t := w.t
	t.Helper()
	nft := func(script string) {
		t.Helper()
		cmd := exec.Command("nft", "-f", "-")
		cmd.Stdin = strings.NewReader(script)
		var out []byte
		err := h.ns.Do(func() (err error) { out, err = cmd.CombinedOutput(); return err })
		if err != nil {
			t.Fatalf("nft: %v\n%s", err, out)
		}
	}
	nft(fmt.Sprintf("table inet egressdcut {\n chain out {\n  type filter hook output priority 0; policy accept;\n  tcp dport %d drop\n }\n}\n", w.rds.Port()))
	return func() { nft("delete table inet egressdcut\n") }
}

// TestSharedConcurrencyAcrossHosts runs three daemons as three hosts
// sharing a concurrency budget of 10. The clients are the judge: never
// more than 10 connections held at once across the hosts, whoever has the
// demand. The budget's first use (durability ephemeral) is frozen for a
// lease; then a host with all the demand gets nearly all of it; busy hosts
// split it; through a Redis outage (FailureMode throw: each host keeps its
// share) and Redis coming back empty (frozen again while hosts take back
// what their kernels hold), still never more than 10.
func TestSharedConcurrencyAcrossHosts(t *testing.T) {
	rds := redistest.Start(t)
	w := newWorld(t, rds, 10)
	start := privtest.Monotonic()
	// Redis's first answer to the first host freezes the budget for a
	// lease from then: asked as soon as it came, before two more daemons
	// take their seconds to start on a loaded machine.
	w.addHost(`key: "egressd-test:pool", lease: 3s`, false)
	var l control.Limit
	clocktest.Eventually(t, "Redis's first answer to the first host", func() bool {
		l = w.hosts[0].share(t, "pool")
		return !l.Shared.Waiting
	})
	if l.Shared.FrozenUntil.IsZero() || l.Shared.Durability != "ephemeral" || l.Limit != 0 {
		t.Errorf("a new ephemeral budget: %+v, limit %d; want it frozen, limit 0", l.Shared, l.Limit)
	}
	for range 2 {
		w.addHost(`key: "egressd-test:pool", lease: 3s`, false)
	}
	w.thawed()

	// All the demand on one host: the idle two hand their shares back.
	phase := privtest.Monotonic()
	w.busy(w.hosts[0], 30)
	most := 0
	// The load's length, sampled: not a wait for a condition.
	for end := time.Now().Add(2 * time.Second); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		most = max(most, w.hosts[0].share(t, "pool").Shared.Slots)
	}
	w.stopAll()
	w.check("one host busy", phase, privtest.Monotonic())
	if most < 9 {
		t.Errorf("the only busy host held at most %d of 10 slots; want nearly all", most)
	}

	// Demand everywhere: the budget is split, never exceeded.
	for _, h := range w.hosts {
		w.busy(h, 20)
	}
	clocktest.Eventually(t, "three busy hosts to split the budget, two slots each at least", func() bool { return slices.Min(w.slots()) >= 2 })

	// Redis goes away: each host keeps the share it held.
	rds.Stop()
	held := make([]uint32, len(w.hosts))
	for i, h := range w.hosts {
		clocktest.Eventually(t, fmt.Sprintf("host %d sees Redis unreachable", i+1), func() bool { return !h.share(t, "pool").Shared.Reachable })
		held[i] = h.share(t, "pool").Limit
	}
	time.Sleep(500 * time.Millisecond)
	var sum uint32
	for i, h := range w.hosts {
		l := h.share(t, "pool")
		t.Logf("host %d during the outage: limit %d (held %d when it noticed), live %d, failure mode %s, expired %v: %s", i+1, l.Limit, held[i], l.Live, l.Shared.FailureMode, l.Shared.Expired, l.Shared.Error)
		// A host keeps its share until its slots' lease could have run
		// out in Redis (the lease less a margin, from its last renewal):
		// with a 3 s lease as little as 1.1 s after Redis went away,
		// which seeing every host notice and waiting half a second can
		// outlast. Then it admits nothing new (share/slots_test.go checks
		// when).
		want := held[i]
		if l.Shared.Expired {
			want = 0
		}
		if l.Limit != want || l.Shared.FailureMode != "throw" {
			t.Errorf("host %d: limit %d in mode %s during the outage (expired %v); throw keeps the share held, %d, until its lease could have run out", i+1, l.Limit, l.Shared.FailureMode, l.Shared.Expired, held[i])
		}
		sum += l.Limit
	}
	if sum > 10 {
		t.Errorf("the hosts' shares add up to %d during the outage; the budget is 10", sum)
	}
	if out := w.hosts[0].ok(t, "status"); !strings.Contains(out, "shared budgets: 1 rules, Redis UNREACHABLE for pool") {
		t.Errorf("status during the outage:\n%s", out)
	}
	if up, ok := w.hosts[0].scrape(t).value("egressd_shared_store_up", map[string]string{"rule": "pool"}); !ok || up != 0 {
		t.Errorf("egressd_shared_store_up = %v (present %v) during the outage, want 0", up, ok)
	}

	// Redis comes back empty: the budget is frozen while each host takes
	// back what its kernel holds; then the hosts share again.
	rds.Restart()
	for i, h := range w.hosts {
		clocktest.Eventually(t, fmt.Sprintf("host %d sees Redis again", i+1), func() bool { return h.share(t, "pool").Shared.Reachable })
	}
	frozen := 0
	for _, h := range w.hosts {
		if !h.share(t, "pool").Shared.FrozenUntil.IsZero() {
			frozen++
		}
	}
	w.thawed()
	var slots []int
	clocktest.Eventually(t, "the hosts to hold most of the 10 slots again", func() bool {
		slots = w.slots()
		return slots[0]+slots[1]+slots[2] >= 8
	})
	w.stopAll()
	w.check("the whole run", start, privtest.Monotonic())
	t.Logf("after Redis came back empty: %d hosts saw the budget frozen; then slots %v", frozen, slots)
	if frozen == 0 {
		t.Error("no host saw the budget frozen after Redis came back empty")
	}
	if sum := slots[0] + slots[1] + slots[2]; sum < 8 || sum > 10 {
		t.Errorf("after Redis came back the hosts hold %v slots, %d in all; want most of the 10, and no more", slots, sum)
	}
	if out := w.hosts[0].ok(t, "status"); !strings.Contains(out, "shared budgets: 1 rules, Redis reachable") {
		t.Errorf("status after Redis came back:\n%s", out)
	}
	m := w.hosts[0].scrape(t)
	if v, ok := m.value("egressd_shared_store_up", map[string]string{"rule": "pool"}); !ok || v != 1 {
		t.Error("egressd_shared_store_up is not 1 after Redis came back")
	}
	if v, ok := m.value("egressd_shared_state_lost_total", map[string]string{"rule": "pool"}); !ok || v < 1 {
		t.Errorf("egressd_shared_state_lost_total = %v (present %v) after Redis lost the state, want 1", v, ok)
	}
}

// TestSharedHostsStartBusyTogether: ten times, on shares that went idle,
// the hosts' clients start at once (within a few milliseconds, in a random
// order); in every other round one host joins late and another leaves
// early while the rest stay busy, so the fair shares move. The hosts grow
// together, and never past the budget.
func TestSharedHostsStartBusyTogether(t *testing.T) {
	rds := redistest.Start(t)
	w := newWorld(t, rds, 10)
	for range 3 {
		w.addHost(`key: "egressd-test:together", lease: 2s`, false)
	}
	w.thawed()
	rng := rand.New(rand.NewPCG(1, 2))
	for round := range 10 {
		w.idle()
		from := privtest.Monotonic()
		order := rng.Perm(len(w.hosts))
		moving := round%2 == 1
		for i, h := range order {
			if moving && i == 0 {
				continue // joins late
			}
			w.busy(w.hosts[h], 5+rng.IntN(25))
			time.Sleep(time.Duration(rng.IntN(10)) * time.Millisecond)
		}
		if moving {
			time.Sleep(time.Duration(500+rng.IntN(1000)) * time.Millisecond)
			late := w.hosts[order[0]]
			w.busy(late, 10+rng.IntN(20))
			clocktest.Eventually(t, "the late host gets a share", func() bool { return late.share(t, "pool").Shared.Slots >= 2 })
			// One of the others leaves: its clients stop.
			w.loads[0].CloseInput()
		}
		time.Sleep(time.Duration(800+rng.IntN(700)) * time.Millisecond)
		w.stopAll()
		if most := w.check(fmt.Sprintf("round %d (a host joins late and one leaves: %v)", round, moving), from, privtest.Monotonic()); most < 9 {
			t.Errorf("round %d: the busy hosts held at most %d at once; want the budget, 10, nearly used", round, most)
		}
	}
}

// TestSharedRedisEmptyWhileHostAway: ten times, while every host is busy,
// one host's daemon is paused (SIGSTOP) or cut off from Redis (a firewall
// rule in its namespace) and Redis restarts empty meanwhile; the host
// comes back before its lease ends. The others may take back only what
// their kernels hold until a lease has passed, so the late host's
// connections always still have their slots.
func TestSharedRedisEmptyWhileHostAway(t *testing.T) {
	rds := redistest.Start(t)
	w := newWorld(t, rds, 10)
	for range 3 {
		w.addHost(`key: "egressd-test:away", lease: 3s`, true)
	}
	w.thawed()
	rng := rand.New(rand.NewPCG(3, 4))
	for _, h := range w.hosts {
		w.busy(h, 10+rng.IntN(20))
	}
	for round := range 10 {
		time.Sleep(time.Second)
		from := privtest.Monotonic()
		h := w.hosts[rng.IntN(len(w.hosts))]
		away := time.Duration(300+rng.IntN(1700)) * time.Millisecond
		cut := round%2 == 1
		var restore func()
		if cut {
			restore = w.cut(h)
		} else {
			h.d.pause(t)
		}
		downFor := time.Duration(rng.IntN(int(away/time.Millisecond/2))) * time.Millisecond
		time.Sleep(time.Duration(rng.IntN(100)) * time.Millisecond)
		rds.Stop()
		time.Sleep(downFor)
		rds.Restart()
		time.Sleep(away - downFor)
		if cut {
			restore()
		} else {
			h.d.resume(t)
		}
		w.thawed()
		time.Sleep(500 * time.Millisecond)
		w.stopAll()
		w.check(fmt.Sprintf("round %d (host away %v, cut %v, Redis down %v)", round, away, cut, downFor), from, privtest.Monotonic())
		if lost := h.share(t, "pool"); lost.Shared.Epoch == 0 {
			t.Errorf("round %d: the late host knows no epoch: %+v", round, lost.Shared)
		}
		for _, h := range w.hosts {
			w.busy(h, 10+rng.IntN(20))
		}
	}
	w.stopAll()
}
