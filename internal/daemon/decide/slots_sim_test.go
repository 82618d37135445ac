package decide

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/egressd/egressd/pkg/shared"
	"github.com/egressd/egressd/pkg/shared/sharedtest"
)

// The simulation: hosts, each a kernel (a limit, the connections it
// holds) with closed-loop clients and a daemon running a Slots share, and
// one Redis (sharedtest's model of the Slots script), stepped a
// millisecond at a time. A daemon's tick is spread over several steps as
// it is on a real host: it lowers the kernel limit, reads the live count,
// sends the Resize, Redis runs it a little later, the reply arrives later
// still and the limit goes up; clients keep connecting between every two
// of those. Faults: Redis down (every call fails after a timeout), Redis
// losing its state, a failover to a replica that lags, a daemon paused, cut
// off from Redis, or killed and restarted (a new share adopting the
// kernel's rule). After every step the connections held by every kernel
// together are checked against the budget.

const (
	simTick    = 50 * time.Millisecond
	simCall    = 500 * time.Millisecond // a call to an unreachable Redis fails after this
	simRTT     = 2 * time.Millisecond   // a call Redis answers takes this each way
	simBackoff = 10 * time.Millisecond  // a refused client tries again after this
)

type simClient struct {
	until   time.Time // holding a connection, or backing off, until then
	holding bool
}

type simHost struct {
	name  string
	slots *Slots
	cfg   SlotsConfig
	limit int // the kernel's
	// The kernel rule's deadline and its limit past it (see Slots.Until).
	deadline time.Time
	after    int
	live     int
	refused  uint64
	clients  []*simClient

	paused bool // the daemon does nothing
	cut    bool // the daemon's calls to Redis fail

	// The daemon's tick in progress.
	phase  int
	at     time.Time // when the next phase runs
	plan   SlotsPlan
	req    shared.SlotsRequest
	sent   time.Time
	reply  shared.SlotsReply
	err    error
	events []Event
}

type simRedis struct {
	budget *sharedtest.Budget
	down   bool
	// A replica lagging behind: failover reverts to what the primary
	// held lag ago, and WAIT does not confirm while it lags.
	lag       time.Duration
	snapshots []simSnapshot
}

type simSnapshot struct {
	at     time.Time
	budget sharedtest.Budget
}

type sim struct {
	t      *testing.T
	rng    *rand.Rand
	now    time.Time
	start  time.Time
	redis  simRedis
	hosts  []*simHost
	budget int
	lease  time.Duration
	hold   [2]time.Duration // a connection is held for between these
	mode   Mode

	most       int // the most connections held at once
	violations int
	first      string // the first violation, described
	allowing   bool   // some host is in FailureMode allow's outage
}

func newSim(t *testing.T, seed uint64, budget int, lease time.Duration, persistent bool) *sim {
	s := &sim{t: t, rng: rand.New(rand.NewPCG(seed, seed^0x9e3779b9)), budget: budget, lease: lease, hold: [2]time.Duration{5 * time.Millisecond, 60 * time.Millisecond}}
	s.now = time.Unix(1_750_000_000, 0)
	s.start = s.now
	s.redis.budget = sharedtest.NewBudget(budget, lease, persistent)
	return s
}

func (s *sim) config() SlotsConfig {
	return SlotsConfig{Budget: s.budget, Lease: s.lease, Margin: 2 * (simTick + simCall), Idle: time.Second, Renew: min(s.lease/4, time.Second), Mode: s.mode}
}

// addHost starts a host with clients busy clients and a fresh daemon.
func (s *sim) addHost(clients int) *simHost {
	h := &simHost{name: fmt.Sprintf("host-%d:pool", len(s.hosts)), cfg: s.config()}
	h.slots = NewSlots(h.cfg, s.now)
	h.at = s.now.Add(time.Duration(s.rng.Int64N(int64(simTick))))
	s.setClients(h, clients)
	s.hosts = append(s.hosts, h)
	return h
}

func (s *sim) setClients(h *simHost, n int) {
	for len(h.clients) < n {
		h.clients = append(h.clients, &simClient{until: s.now})
	}
	for len(h.clients) > n {
		c := h.clients[len(h.clients)-1]
		if c.holding {
			h.live--
		}
		h.clients = h.clients[:len(h.clients)-1]
	}
}

// restart kills h's daemon and starts another after down, which adopts
// the kernel's rule, writes it back as the share has it, and ticks a tick
// later.
func (s *sim) restart(h *simHost, down time.Duration) {
	h.slots = nil
	h.phase, h.at = 0, s.now.Add(down)
}

// startDaemon starts h's daemon over the kernel rule its previous one left.
func (s *sim) startDaemon(h *simHost) {
	h.slots = NewSlots(h.cfg, s.now)
	h.slots.Adopt(SlotsObs{Limit: h.limit, Live: h.live, Refused: h.refused}, h.deadline)
	h.limit = h.slots.Limit()
	h.deadline, h.after = h.slots.Until()
	h.phase, h.at = 0, s.now.Add(simTick)
}

func (s *sim) run(d time.Duration, each func()) {
	for end := s.now.Add(d); s.now.Before(end); s.now = s.now.Add(time.Millisecond) {
		if each != nil {
			each()
		}
		s.snapshot()
		for _, h := range s.hosts {
			s.kernel(h)
		}
		for _, h := range s.hosts {
			s.daemon(h)
			s.kernel(h) // connections between the daemon's steps
		}
		s.check()
	}
}

func (s *sim) kernel(h *simHost) {
	for _, c := range h.clients {
		if s.now.Before(c.until) {
			continue
		}
		if c.holding {
			c.holding = false
			h.live--
			continue
		}
		limit := h.limit
		if !h.deadline.IsZero() && !s.now.Before(h.deadline) {
			limit = h.after
		}
		if h.live < limit {
			h.live++
			c.holding = true
			c.until = s.now.Add(s.hold[0] + time.Duration(s.rng.Int64N(int64(s.hold[1]-s.hold[0]))))
		} else {
			h.refused++
			c.until = s.now.Add(simBackoff)
		}
	}
}

func (s *sim) daemon(h *simHost) {
	if h.paused || s.now.Before(h.at) {
		return
	}
	if h.slots == nil {
		s.startDaemon(h)
		return
	}
	switch h.phase {
	case 0:
		h.plan = h.slots.Plan(SlotsObs{Limit: h.limit, Live: h.live, Refused: h.refused}, s.now)
		h.limit = h.plan.Limit
		h.deadline, h.after = h.slots.Until()
		h.phase, h.at = 1, s.now.Add(time.Millisecond)
	case 1:
		var ask bool
		h.req, ask = h.slots.Request(h.plan, h.live, s.now)
		if !ask {
			h.phase, h.at = 0, s.now.Add(simTick)
			return
		}
		h.sent = s.now
		if h.cut || s.redis.down {
			h.err = errors.New("unreachable")
			h.phase, h.at = 3, s.now.Add(simCall)
			return
		}
		h.phase, h.at = 2, s.now.Add(simRTT)
	case 2:
		h.reply, h.err = s.redis.budget.Resize(s.now, h.name, h.req), nil
		h.reply.Confirmed = s.redis.lag == 0
		h.phase, h.at = 3, s.now.Add(simRTT)
	case 3:
		var ev Event
		h.limit, ev = h.slots.Reply(h.plan, h.req, h.reply, h.err, h.sent, s.now)
		h.deadline, h.after = h.slots.Until()
		if ev != 0 {
			h.events = append(h.events, ev)
		}
		h.phase, h.at = 0, h.sent.Add(simTick)
	}
}

func (s *sim) snapshot() {
	r := &s.redis
	r.snapshots = append(r.snapshots, simSnapshot{at: s.now, budget: r.budget.Clone()})
	for len(r.snapshots) > 0 && s.now.Sub(r.snapshots[0].at) > r.lag+time.Millisecond {
		r.snapshots = r.snapshots[1:]
	}
}

// failover makes Redis what its replica had: the primary's state lag ago.
func (s *sim) failover() {
	r := &s.redis
	b := r.snapshots[0].budget
	r.budget = &b
	r.snapshots = nil
}

func (s *sim) check() {
	total := 0
	for _, h := range s.hosts {
		total += h.live
	}
	s.most = max(s.most, total)
	if total > s.budget && !s.allowing {
		s.violations++
		if s.first == "" {
			var b strings.Builder
			fmt.Fprintf(&b, "at +%v: %d connections held at once, budget %d:", s.now.Sub(s.start), total, s.budget)
			for _, h := range s.hosts {
				var v SlotsView
				if h.slots != nil { // nil: the daemon is down
					v = h.slots.View()
				}
				fmt.Fprintf(&b, " [%s live %d limit %d held %d fair %d redis %d failing %v]", h.name, h.live, h.limit, v.Held, v.Fair, s.redis.budget.HeldBy(h.name, s.now), v.Outage.Failing())
			}
			s.first = b.String()
		}
	}
}

func (s *sim) report(name string) {
	s.t.Helper()
	if s.violations > 0 {
		s.t.Errorf("%s: %d steps over the budget; the first %s", name, s.violations, s.first)
	}
}

// fills makes every host busy and fails the test unless, within a few
// seconds, the hosts together hold the whole budget at some instant: a
// share that never grows back keeps the invariant too, uselessly.
func (s *sim) fills(name string) {
	s.t.Helper()
	for _, h := range s.hosts {
		s.setClients(h, max(len(h.clients), s.budget))
	}
	s.most = 0
	s.run(3*time.Second, nil)
	if s.most < s.budget {
		s.t.Errorf("%s: at most %d connections at once after the faults, with every host busy: the budget is %d", name, s.most, s.budget)
	}
	s.report(name)
}

// TestSlotsSimStartTogether: every host starts busy at once; and hosts
// join and leave while the others stay busy, so shares rebalance.
func TestSlotsSimStartTogether(t *testing.T) {
	for seed := range uint64(40) {
		s := newSim(t, seed, 10, 3*time.Second, seed%2 == 0)
		n := 2 + s.rng.IntN(4)
		for range n {
			s.addHost(1 + s.rng.IntN(30))
		}
		s.run(4*time.Second, nil)
		// Join and leave.
		for range 6 {
			switch h := s.hosts[s.rng.IntN(len(s.hosts))]; {
			case s.rng.IntN(3) == 0:
				s.addHost(1 + s.rng.IntN(30))
			default:
				s.setClients(h, s.rng.IntN(30))
			}
			s.run(time.Duration(300+s.rng.IntN(1500))*time.Millisecond, nil)
		}
		s.fills(fmt.Sprintf("seed %d, %d hosts", seed, len(s.hosts)))
	}
}

// TestSlotsSimRedisLosesState: Redis restarts empty while every host is
// busy; one host's daemon is paused (or cut off from Redis) around it and
// comes back up to most of a lease later. Durability ephemeral freezes
// the budget and every host takes back what its kernel holds.
func TestSlotsSimRedisLosesState(t *testing.T) {
	for seed := range uint64(60) {
		lease := 3 * time.Second
		s := newSim(t, seed, 10, lease, false)
		for range 3 {
			s.addHost(5 + s.rng.IntN(20))
		}
		s.run(lease+2*time.Second, nil) // past the first use's freeze
		slow := s.hosts[s.rng.IntN(len(s.hosts))]
		away := time.Duration(s.rng.Int64N(int64(lease - simTick - simCall)))
		downFor := time.Duration(s.rng.Int64N(int64(time.Second)))
		cut := seed%2 == 1
		if cut {
			slow.cut = true
		} else {
			slow.paused = true
		}
		s.run(time.Duration(s.rng.Int64N(int64(simTick))), nil)
		s.redis.down = true
		s.run(downFor, nil)
		s.redis.budget.Lose()
		s.redis.down = false
		s.run(max(0, away-downFor), nil)
		slow.paused, slow.cut = false, false
		s.run(2*lease, nil)
		s.fills(fmt.Sprintf("seed %d (away %v, Redis down %v, cut %v)", seed, away, downFor, cut))
		if lost := s.events(StateLost); lost == 0 {
			t.Errorf("seed %d: no host reported Redis's lost state", seed)
		}
	}
}

// TestSlotsSimOutages: Redis unreachable for a while, for every host or
// for one (cut off), under each failure mode; then back, with its state
// or without.
func TestSlotsSimOutages(t *testing.T) {
	for seed := range uint64(60) {
		lease := 3 * time.Second
		s := newSim(t, seed, 10, lease, seed%4 == 0)
		s.mode = Mode(seed % modeLen)
		for range 3 {
			s.addHost(5 + s.rng.IntN(20))
		}
		s.run(lease+2*time.Second, nil)
		one := seed%2 == 1
		outage := time.Duration(s.rng.Int64N(int64(2 * lease)))
		if one {
			s.hosts[0].cut = true
		} else {
			s.redis.down = true
		}
		// FailureMode allow lifts the budget on purpose while Redis is
		// away, and until what it admitted has drained.
		s.allowing = s.mode == Allow
		s.run(outage, nil)
		if s.rng.IntN(2) == 0 && !one {
			s.redis.budget.Lose()
		}
		s.hosts[0].cut, s.redis.down = false, false
		if s.allowing {
			s.run(lease+time.Second, nil) // the freeze or the old leases, and the drain
			s.allowing = false
		}
		s.run(2*lease, nil)
		s.fills(fmt.Sprintf("seed %d (mode %v, outage %v, one host %v)", seed, s.mode, outage, one))
	}
}

// newBusySim starts three busy hosts on a budget of 10, past the first
// use's freeze; every other seed's budget is persistent.
func newBusySim(t *testing.T, seed uint64, lease time.Duration) *sim {
	s := newSim(t, seed, 10, lease, seed%2 == 0)
	for range 3 {
		s.addHost(5 + s.rng.IntN(20))
	}
	s.run(lease+2*time.Second, nil)
	return s
}

// TestSlotsSimRestartAndFailover: a daemon killed and restarted (a new
// share adopts the kernel's rule) while the others are busy; a failover
// to a replica that lags, while replicas are asked to confirm (WAIT).
func TestSlotsSimRestartAndFailover(t *testing.T) {
	for seed := range uint64(60) {
		lease := 3 * time.Second
		s := newBusySim(t, seed, lease)
		h := s.hosts[s.rng.IntN(len(s.hosts))]
		s.restart(h, time.Duration(s.rng.Int64N(int64(2*time.Second))))
		s.run(2*time.Second, nil)
		// While the replica lags, one host goes idle and hands its
		// slots back, and the others grow into them: the failover loses
		// that growth.
		s.redis.lag = time.Duration(300+s.rng.IntN(1000)) * time.Millisecond
		idle := s.hosts[s.rng.IntN(len(s.hosts))]
		s.setClients(idle, 0)
		s.run(simTick*2+time.Duration(s.rng.Int64N(int64(s.redis.lag-2*simTick))), nil)
		s.failover()
		s.setClients(idle, 5+s.rng.IntN(20))
		s.redis.lag = 0
		s.run(2*lease, nil)
		s.fills(fmt.Sprintf("seed %d", seed))
	}
}

// TestSlotsSimGoneLongerThanLease: a daemon killed for longer than the
// lease, while the others are busy: its kernel falls back at the rule's
// deadline, the others take the slots Redis let go, and the restarted
// daemon, adopting the rule, keeps that fallback until Redis answers.
func TestSlotsSimGoneLongerThanLease(t *testing.T) {
	for seed := range uint64(40) {
		lease := 3 * time.Second
		s := newBusySim(t, seed, lease)
		h := s.hosts[s.rng.IntN(len(s.hosts))]
		s.restart(h, lease+time.Duration(s.rng.Int64N(int64(2*lease))))
		s.run(3*lease, nil)
		s.fills(fmt.Sprintf("seed %d", seed))
	}
}

func (s *sim) events(e Event) int {
	n := 0
	for _, h := range s.hosts {
		for _, ev := range h.events {
			if ev&e != 0 {
				n++
			}
		}
	}
	return n
}
