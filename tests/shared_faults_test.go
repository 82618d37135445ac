package tests

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/internal/privtest"
	"github.com/egressd/egressd/internal/redistest"
	"github.com/egressd/egressd/pkg/control"
)

// TestSharedFailureModes shows the other two failure modes while Redis is
// away: allow enforces the whole limit as if the host were alone, deny
// admits nothing new; both share again once Redis returns, empty.
func TestSharedFailureModes(t *testing.T) {
	rds := redistest.Start(t)
	w := newWorld(t, rds, 10)
	allow := w.addHost(`key: "egressd-test:modes", failureMode: allow, durability: persistent`, false)
	// The second host's rule comes from the CLI.
	deny := prepareHost(t, 31, w.dep)
	deny.writePolicy(t, "")
	deny.d = deny.start(t)
	w.hosts = append(w.hosts, deny)
	out := deny.ok(t, "limit", "set", "pool", "--dest", deny.dest, "--concurrency", "10",
		"--shared-redis", rds.URL(), "--shared-key", "egressd-test:modes", "--shared-failure-mode", "deny")
	// Its first call to Redis may not have come back yet.
	if !strings.Contains(out, "shared: key egressd-test:modes, reachable") && !strings.Contains(out, "shared: key egressd-test:modes, waiting for Redis's first answer") {
		t.Errorf("limit set of a shared rule says:\n%s", out)
	}
	clocktest.Eventually(t, "the CLI's rule sees Redis", func() bool { return deny.share(t, "pool").Shared.Reachable })
	w.thawed()
	start := privtest.Monotonic()
	w.busy(allow, 20)
	w.busy(deny, 20)
	clocktest.Eventually(t, "both hosts hold slots", func() bool {
		return allow.share(t, "pool").Shared.Slots > 0 && deny.share(t, "pool").Shared.Slots > 0
	})
	time.Sleep(time.Second)
	before := privtest.Monotonic()

	rds.Stop()
	clocktest.Eventually(t, "both hosts see Redis unreachable", func() bool {
		return !allow.share(t, "pool").Shared.Reachable && !deny.share(t, "pool").Shared.Reachable
	})
	clocktest.Eventually(t, "the connections the deny host admitted before the outage to drain", func() bool { return deny.share(t, "pool").Live == 0 })
	denied := deny.share(t, "pool").Admitted
	outage := privtest.Monotonic()
	time.Sleep(1500 * time.Millisecond)
	al, dl := allow.share(t, "pool"), deny.share(t, "pool")
	t.Logf("outage: allow host limit %d, live %d; deny host limit %d, admitted %d more", al.Limit, al.Live, dl.Limit, dl.Admitted-denied)
	if al.Limit != 10 || al.Shared.FailureMode != "allow" {
		t.Errorf("allow host: limit %d in mode %s during the outage, want the whole 10", al.Limit, al.Shared.FailureMode)
	}
	if dl.Limit != 0 || dl.Admitted != denied || dl.Shared.FailureMode != "deny" {
		t.Errorf("deny host: limit %d, admitted %d more in mode %s; deny admits nothing", dl.Limit, dl.Admitted-denied, dl.Shared.FailureMode)
	}
	settled := privtest.Monotonic()

	rds.Restart()
	clocktest.Eventually(t, "both hosts reach Redis again", func() bool {
		return allow.share(t, "pool").Shared.Reachable && deny.share(t, "pool").Shared.Reachable
	})
	w.thawed() // a persistent budget Redis lost: the hosts that held slots freeze it
	back := privtest.Monotonic()
	clocktest.Eventually(t, "the deny host shares again", func() bool { return deny.share(t, "pool").Limit > 0 })
	time.Sleep(2 * time.Second) // what allow admitted beyond its share drains
	drained := privtest.Monotonic()
	time.Sleep(time.Second)
	w.stopAll()
	w.check("before the outage", start, before)
	if n := w.heldBy(deny, outage, settled); n != 0 {
		t.Errorf("the deny host's clients held %d connections during the outage, after its connections drained; want none", n)
	}
	t.Logf("while Redis was away the hosts held up to %d at once (allow lifts the budget); from Redis's return %d", w.held(outage, back), w.held(back, drained))
	w.check("shared again", drained, privtest.Monotonic())
}

// heldBy is held for one host's clients (by its address at the
// dependency): stopAll first.
func (w *world) heldBy(h *sharingHost, from, to int64) int {
	for i, host := range w.hosts {
		if host == h {
			most, _ := privtest.MaxOverlap(w.byHost[i], from, to)
			return most
		}
	}
	return 0
}

// TestSharedRateAcrossHosts shares a per-second budget between two hosts
// pushing far above it: what the dependency accepted over the run stays
// within the budget's burst and rate, and most of the budget is used. Then
// Redis restarts empty: the documented exception, one fresh burst, is
// measured.
func TestSharedRateAcrossHosts(t *testing.T) {
	privtest.RequireRoot(t)
	rds := redistest.Start(t)
	dep := privtest.NewNetNS(t)
	srv := newHoldServer(t, dep, 0)
	rule := sharedRule("rate", "perSecond: {permits: 50}", rds.URL(), "egressd-test:rate", "")
	a := newSharingHost(t, 6, dep, rule)
	b := newSharingHost(t, 7, dep, rule)

	const run = 4 * time.Second
	// Each host claimed a batch as its rule came, ahead of demand: the
	// budget gave those before the run, and the bucket refilled since.
	held := func(h *sharingHost) uint64 { l := h.share(t, "rate"); return l.Shared.Granted - l.Shared.Spent }
	before := held(a) + held(b)
	start := time.Now()
	loads := []*privtest.Child{a.load(t, srv.port, 8, run), b.load(t, srv.port, 8, run)}
	for _, l := range loads {
		t.Logf("clients: %s", l.Line(t))
		l.Wait(t)
	}
	elapsed := time.Since(start)
	accepted := srv.accepted.Load()
	// The bucket is at most full (50) as the run starts and gains 50 a
	// second; the hosts held what they had claimed before.
	most := float64(before) + 50 + 50*elapsed.Seconds()
	la, lb := a.share(t, "rate"), b.share(t, "rate")
	t.Logf("%v: the dependency accepted %d connections (budget at most %.0f, %d of it claimed before the run); host A spent %d, host B %d; granted %d and %d, handed back %d and %d",
		elapsed.Round(time.Millisecond), accepted, most, before, la.Shared.Spent, lb.Shared.Spent, la.Shared.Granted, lb.Shared.Granted, la.Shared.Returned, lb.Shared.Returned)
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
	// one permit. A host that has nothing unspent shows no sign of its
	// idle spell: the daemons' idle time (1 s) must pass on their clock.
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
	var l control.Limit
	clocktest.Eventually(t, "host a, idle again, to hand back the unspent batch but one permit", func() bool {
		l = a.share(t, "rate")
		return l.Shared.Granted == l.Shared.Spent+1 && l.Shared.Returned > la.Shared.Returned
	})
	t.Logf("after one connection and an idle spell: granted %d, spent %d, handed back %d", l.Shared.Granted, l.Shared.Spent, l.Shared.Returned)
	if la.Shape != "per_second" {
		t.Errorf("shape %q, want per_second", la.Shape)
	}

	// Both busy and past the bucket's burst: 3 s as a baseline; then Redis
	// restarts empty, and its bucket is full again: 3 s more hold one
	// fresh burst more than a bucket that kept its state allows.
	loads = []*privtest.Child{a.load(t, srv.port, 8, 9*time.Second), b.load(t, srv.port, 8, 9*time.Second)}
	time.Sleep(2 * time.Second)
	mark := srv.accepted.Load()
	time.Sleep(3 * time.Second)
	steady := srv.accepted.Load() - mark
	rds.Stop()
	rds.Restart()
	mark = srv.accepted.Load()
	time.Sleep(3 * time.Second)
	after := srv.accepted.Load() - mark
	for _, l := range loads {
		l.Line(t)
		l.Wait(t)
	}
	t.Logf("the dependency accepted %d connections in 3 s at the budget's rate (50/s, burst 50), and %d in the 3 s after Redis restarted empty: %d more", steady, after, after-steady)
	if after > steady+50+2*2*batchOf(50) {
		t.Errorf("%d accepted in the 3 s after Redis lost the bucket, %d in 3 s before: more than one fresh burst (50) and the hosts' batches", after, steady)
	}
}

// batchOf is the permits a host claims at once from a budget of
// perSecond (the daemon's 100 ms of the rate).
func batchOf(perSecond int) int64 { return int64(max(1, (perSecond+9)/10)) }

// TestSharedSentinelFailover shares a budget through a Sentinel-watched
// primary with a replica; grants count only once the replica has them
// (replicas: 1). The replica is stopped while the shares move (one host
// goes idle, the other grows into its slots: that growth is not confirmed,
// so not used), then the primary is killed and Sentinel promotes the
// replica, which lacks those writes, while the idle host is busy again and
// takes back the slots the replica says are its own. The clients never
// hold more than the budget, and the hosts share again through the new
// primary once a replica confirms growth again.
func TestSharedSentinelFailover(t *testing.T) {
	primary := redistest.Start(t)
	replica := redistest.StartWith(t, redistest.Config{ReplicaOf: primary})
	primary.WaitReplica(t, replica)
	sentinel := redistest.StartSentinel(t, "budgets", primary, time.Second)
	// Connections held long enough that a kernel's excess is still open
	// when another host takes slots Redis says are free.
	w := newWorldHolding(t, primary, 10, 300*time.Millisecond)
	url := fmt.Sprintf("redis+sentinel://%s?master_name=budgets", sentinel.Addr())
	for range 2 {
		w.addHost(fmt.Sprintf(`redis: %q, key: "egressd-test:sentinel", replicas: 1`, url), false)
	}
	w.thawed()
	a, b := w.hosts[0], w.hosts[1]
	start := privtest.Monotonic()
	w.busy(a, 20)
	w.busy(b, 20)
	time.Sleep(2 * time.Second)

	replica.Pause()
	// a goes idle and hands its slots back; b could grow into them, but
	// no replica confirms it. Then the primary dies, and a is busy again
	// as the replica, which lacks all of that, takes over: a's slots are
	// a's again there.
	w.stopAll()
	w.busy(b, 20)
	time.Sleep(1500 * time.Millisecond)
	primary.Stop()
	replica.Resume()
	w.busy(a, 20)
	clocktest.Eventually(t, "Sentinel promotes the replica", func() bool { return sentinel.Primary(t, "budgets") == replica.Addr() })
	failedOver := privtest.Monotonic()
	for _, h := range w.hosts {
		clocktest.Eventually(t, "the hosts reach the new primary", func() bool { return h.share(t, "pool").Shared.Reachable })
	}
	// The new primary has no replica to confirm growth: host a, idle
	// meanwhile, cannot grow back.
	clocktest.Eventually(t, "host a's growth left unconfirmed", func() bool { return a.share(t, "pool").Shared.Unconfirmed > 0 })
	if l := a.share(t, "pool"); l.Limit != 0 {
		t.Errorf("with no replica to confirm it, host a's kernel limit is %d; want 0: its growth unused", l.Limit)
	}
	// A new replica joins the new primary, and growth is confirmed again.
	fresh := redistest.StartWith(t, redistest.Config{ReplicaOf: replica})
	replica.WaitReplica(t, fresh)
	clocktest.Eventually(t, "host a grows again, confirmed by the new replica", func() bool { return a.share(t, "pool").Limit > 0 })
	time.Sleep(time.Second)
	slots := w.slots()
	w.stopAll()
	w.check("across the failover", start, privtest.Monotonic())
	if most := w.check("after it", failedOver, privtest.Monotonic()); most < 9 {
		t.Errorf("after the failover the busy hosts held at most %d at once; want the budget used again", most)
	}
	t.Logf("after the failover the hosts hold %v slots", slots)
	if slots[0] == 0 || slots[1] == 0 {
		t.Errorf("after the failover the hosts hold %v slots; busy hosts share", slots)
	}
	if !strings.Contains(b.d.log.String(), "replicas did not confirm a grant in time") {
		t.Error("host b never logged an unconfirmed grant while the replica was stopped")
	}
}

// TestSharedPersistentRedisRestart: with an AOF and durability
// persistent, a Redis killed and restarted reads the budget back: same
// epoch, no freeze, the shares resume where they were.
func TestSharedPersistentRedisRestart(t *testing.T) {
	rds := redistest.StartWith(t, redistest.Config{AOF: true})
	w := newWorld(t, rds, 10)
	for range 2 {
		w.addHost(`key: "egressd-test:aof", durability: persistent`, false)
	}
	first := w.hosts[0].share(t, "pool")
	if !first.Shared.FrozenUntil.IsZero() {
		t.Errorf("a new persistent budget is frozen: %+v", first.Shared)
	}
	start := privtest.Monotonic()
	for _, h := range w.hosts {
		w.busy(h, 20)
	}
	time.Sleep(1500 * time.Millisecond)
	epoch := w.hosts[0].share(t, "pool").Shared.Epoch
	rds.Stop()
	rds.Restart()
	for _, h := range w.hosts {
		clocktest.Eventually(t, "the hosts reach Redis again", func() bool { return h.share(t, "pool").Shared.Reachable })
		if l := h.share(t, "pool"); !l.Shared.FrozenUntil.IsZero() || l.Shared.Epoch != epoch {
			t.Errorf("after Redis read its AOF back: %+v; want epoch %d, not frozen", l.Shared, epoch)
		}
	}
	time.Sleep(time.Second)
	w.stopAll()
	w.check("across the restart", start, privtest.Monotonic())
	if v, ok := w.hosts[0].scrape(t).value("egressd_shared_state_lost_total", map[string]string{"rule": "pool"}); !ok || v != 0 {
		t.Errorf("egressd_shared_state_lost_total = %v (present %v), want 0: Redis kept the state", v, ok)
	}
}

// TestSharedDaemonKilledOrPaused: a daemon killed (-9) and restarted
// adopts its pinned rule and its slots in Redis; a daemon paused for less
// than the lease keeps its slots, and its kernel its limit. Meanwhile the
// others stay busy, and the clients never hold more than the budget.
func TestSharedDaemonKilledOrPaused(t *testing.T) {
	rds := redistest.Start(t)
	w := newWorld(t, rds, 10)
	for range 3 {
		w.addHost(`key: "egressd-test:crash", lease: 3s`, false)
	}
	w.thawed()
	rng := rand.New(rand.NewPCG(5, 6))
	start := privtest.Monotonic()
	for _, h := range w.hosts {
		w.busy(h, 10+rng.IntN(15))
	}
	for round := range 3 {
		time.Sleep(time.Second)
		killed, paused := w.hosts[round%3], w.hosts[(round+1)%3]
		killed.d.kill(t)
		paused.d.pause(t)
		time.Sleep(time.Duration(300+rng.IntN(1200)) * time.Millisecond)
		killed.d = killed.start(t)
		time.Sleep(time.Duration(rng.IntN(800)) * time.Millisecond)
		paused.d.resume(t)
	}
	clocktest.Eventually(t, "the busy hosts to hold most of the 10 slots after the kills and pauses", func() bool {
		slots := w.slots()
		return slots[0]+slots[1]+slots[2] >= 8
	})
	w.stopAll()
	w.check("kills and pauses", start, privtest.Monotonic())
}

// TestSharedDaemonGoneLongerThanLease: a daemon killed and not restarted
// for longer than the lease leaves its kernel enforcing its share only
// until that lease could run out in Redis: from then its kernel admits no
// new connection, while the other host takes the slots Redis let go, and
// the clients never hold more than the budget. Restarted, it shares again.
func TestSharedDaemonGoneLongerThanLease(t *testing.T) {
	rds := redistest.Start(t)
	w := newWorld(t, rds, 10)
	a := w.addHost(`key: "egressd-test:gone", lease: 3s`, false)
	b := w.addHost(`key: "egressd-test:gone", lease: 3s`, false)
	w.thawed()
	start := privtest.Monotonic()
	w.busy(a, 20)
	w.busy(b, 20)
	clocktest.Eventually(t, "each host near its fair share, 5", func() bool { return min(a.share(t, "pool").Shared.Slots, b.share(t, "pool").Shared.Slots) >= 4 })
	a.d.kill(t)
	killed := privtest.Monotonic()
	// a's kernel stops admitting at its last confirmed renewal + the
	// lease - 1.1 s, within 1.9 s; its connections last 20 ms.
	time.Sleep(7 * time.Second)
	gone := privtest.Monotonic()
	a.d = a.start(t)
	clocktest.Eventually(t, "the restarted host holds slots again", func() bool { return a.share(t, "pool").Shared.Slots > 0 })
	time.Sleep(time.Second)
	w.stopAll()
	w.check("a daemon gone longer than the lease", start, privtest.Monotonic())
	after := killed + int64(3500*time.Millisecond)
	if n := w.heldBy(a, after, gone); n != 0 {
		t.Errorf("the killed daemon's clients held %d connections at once from 3.5 s after the kill: its kernel admitted past the lease", n)
	}
	if n := w.heldBy(b, killed+int64(4*time.Second), gone); n < w.budget-2 {
		t.Errorf("the other host's clients held at most %d connections at once while the first was gone, want most of the %d Redis let go to it", n, w.budget)
	}
}

// TestSharedCluster shares a budget through a Redis Cluster of three
// primaries: the budget's keys share a hash slot, and the hosts split the
// budget as with one server.
func TestSharedCluster(t *testing.T) {
	nodes := redistest.StartCluster(t, 3)
	w := newWorld(t, nodes[0], 6)
	url := fmt.Sprintf("redis+cluster://%s?addr=%s&addr=%s", nodes[0].Addr(), nodes[1].Addr(), nodes[2].Addr())
	for range 2 {
		w.addHost(fmt.Sprintf(`redis: %q, key: "egressd-test:{cluster}", durability: persistent`, url), false)
	}
	start := privtest.Monotonic()
	for _, h := range w.hosts {
		w.busy(h, 15)
	}
	// The load's length, for the check of what the clients held.
	time.Sleep(2 * time.Second)
	clocktest.Eventually(t, "the busy hosts to share the 6 slots through the cluster", func() bool {
		slots := w.slots()
		return slots[0] > 0 && slots[1] > 0 && slots[0]+slots[1] >= 5
	})
	w.stopAll()
	w.check("through the cluster", start, privtest.Monotonic())
}
