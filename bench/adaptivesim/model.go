package main

import (
	"container/heap"
	"math"
	"math/rand/v2"
	"slices"
	"time"
)

// Scenario is one run of the dependency model: who calls, how hard, and how
// long each of the three phases lasts (full capacity, half capacity after the
// drop, full capacity again after the recovery).
type Scenario struct {
	Name string

	Servers  int           // c at full capacity; c/2 between the drop and the recovery
	Mean     time.Duration // mean service time
	Sigma    float64       // shape of the lognormal service time (σ of its logarithm)
	QueuePer int           // the dependency's FIFO holds QueuePer × current servers calls

	// Hosts call the dependency, each through its own controller (no
	// shared budget), each with its own callers: Load / Hosts of the open
	// loop's arrivals or Clients of its own. One host when zero.
	Hosts int

	// Open loop: Poisson arrivals at Load × full capacity in all, whatever
	// happens to them; a refused arrival is lost, not retried.
	Open bool
	Load float64

	// Closed loop: Clients callers per host, each issuing its next call
	// the instant the previous one returns, and after a refusal waiting an
	// exponentially distributed Backoff (mean) before asking again.
	Clients int
	Backoff time.Duration

	Phase time.Duration // length of each phase; the run is 3 × Phase
	Seed  uint64
}

func (sc *Scenario) hosts() int { return max(sc.Hosts, 1) }

// serversAt is the capacity schedule: c, then c/2 from the drop at Phase,
// then c again from the recovery at 2 × Phase.
func (sc *Scenario) serversAt(t time.Duration) int {
	if t >= sc.Phase && t < 2*sc.Phase {
		return sc.Servers / 2
	}
	return sc.Servers
}

// capacity is calls per second the dependency completes with c servers busy.
func (sc *Scenario) capacity(c int) float64 {
	return float64(c) / sc.Mean.Seconds()
}

// Controller is the small interface every limiter is driven through. Acquire
// asks for a permit at virtual instant now; a refusal is final for that
// attempt. Done returns the permit at now with what the caller measured while
// holding it: latency (queue wait plus service), or failed when the
// dependency turned the call away without serving it. token is whatever
// Acquire returned with the permit.
type Controller interface {
	Acquire(now time.Duration) (token any, ok bool)
	Done(now time.Duration, token any, latency time.Duration, failed bool)
	// Limit is the limit in force; math.MaxInt32 for no limit.
	Limit() int
}

// Settler is a Controller whose limit in force can differ for a while from
// the limit it has settled on: egressd's with drain probes, whose Limit is
// the probe's during one. The table judges the settled limit against the
// band, since a probe leaves it on purpose; the plot draws the limit in force.
type Settler interface {
	Settled() int
}

// settled is ctl's settled limit: Settled for a Settler, Limit otherwise.
func settled(ctl Controller) int {
	if s, ok := ctl.(Settler); ok {
		return s.Settled()
	}
	return ctl.Limit()
}

// unlimited is the Limit of a controller that never refuses.
const unlimited = math.MaxInt32

// point is one step of a limit: from instant t the limit in force was limit
// and the limit settled on settled (the same but for a Settler in a probe),
// and rounds rounds had completed since the start of the run. For the sum
// over hosts, each is the sum, and rounds the hosts' mean.
type point struct {
	t       time.Duration
	limit   int
	rounds  float64
	settled int
}

// Steps is a limit over time: every change, plus one at each phase start.
type Steps struct {
	Points  []point
	PhaseAt [3]int // index of the point at each phase start
}

// Trace is what one run of one scenario produced.
type Trace struct {
	Latencies []time.Duration // of every call that completed, in completion order
	LatAt     [3]int          // index into Latencies of each phase's first
	Completed [3]int          // calls completed per phase
	Refused   int             // acquires refused by the controllers
	Failed    int             // calls the dependency's full queue turned away
	// Limit is the controller's limit; with several hosts, the sum of
	// theirs.
	Limit Steps
	// Hosts are each host's own limit and calls completed in the second
	// half of each phase; nil for one host.
	Hosts []HostTrace
}

// HostTrace is one of several hosts' part of a run.
type HostTrace struct {
	Limit  Steps
	Steady [3]int // calls completed in the second half of each phase
}

// A call in flight: admitted by a controller, queued or in service.
type call struct {
	start   time.Duration
	service time.Duration
	token   any
	host    int
	client  int // -1 for an open-loop arrival
}

type eventKind uint8

const (
	evArrival  eventKind = iota // next open-loop arrival at host
	evWake                      // closed-loop client arg of host asks again
	evDone                      // call arg leaves its server
	evCapacity                  // the dependency now has arg servers
)

type event struct {
	at   time.Duration
	seq  uint64 // ties at one instant run in the order they were scheduled
	kind eventKind
	host int
	arg  int
}

type events []event

func (e events) Len() int { return len(e) }
func (e events) Less(i, j int) bool {
	if e[i].at != e[j].at {
		return e[i].at < e[j].at
	}
	return e[i].seq < e[j].seq
}
func (e events) Swap(i, j int) { e[i], e[j] = e[j], e[i] }
func (e *events) Push(x any)   { *e = append(*e, x.(event)) }
func (e *events) Pop() any {
	old := *e
	x := old[len(old)-1]
	*e = old[:len(old)-1]
	return x
}

// host is one caller of the dependency and its controller.
type host struct {
	ctl      Controller
	arrivals *rand.Rand   // open loop
	clients  []*rand.Rand // closed loop
	limit    Steps
	steady   [3]int

	last       point // the limit last recorded
	roundsDone float64
}

// sim is one discrete-event run: a dependency of c FIFO servers in virtual
// time, its hosts, each with its callers and a controller between them and
// the dependency. Every random draw comes from a stream owned by the thing
// it describes (a host's arrival process, or one client), so every
// controller sees the same trace: the same arrivals at the same instants
// asking for the same service, only admitted differently.
type sim struct {
	sc  *Scenario
	end time.Duration

	now    time.Duration
	seq    uint64
	events events

	servers, busy int
	queue         []int // call ids, FIFO
	calls         []call
	free          []int

	mu    float64 // of the service time's logarithm, in nanoseconds
	hosts []*host

	out   Trace
	sum   point // the sum of the hosts' limits last recorded
	phase int
}

// Simulate runs sc with a controller per host, made by make, and returns
// what happened. Same sc, same controller behaviour, same Trace.
func Simulate(sc *Scenario, make func(host int) Controller) *Trace {
	s := &sim{
		sc:      sc,
		end:     3 * sc.Phase,
		servers: sc.Servers,
		// A lognormal with mean m has μ = ln m − σ²/2.
		mu: math.Log(float64(sc.Mean)) - sc.Sigma*sc.Sigma/2,
	}
	for i := range sc.hosts() {
		h := &host{ctl: make(i)}
		h.last = point{0, h.ctl.Limit(), 0, settled(h.ctl)}
		h.limit.Points = []point{h.last}
		s.hosts = append(s.hosts, h)
	}
	s.sum = s.total()
	s.out.Limit.Points = []point{s.sum}

	s.schedule(sc.Phase, evCapacity, 0, sc.serversAt(sc.Phase))
	s.schedule(2*sc.Phase, evCapacity, 0, sc.serversAt(2*sc.Phase))
	for i, h := range s.hosts {
		if sc.Open {
			h.arrivals = newStream(sc.Seed, i, 0)
			s.schedule(s.interarrival(h), evArrival, i, 0)
			continue
		}
		for j := range sc.Clients {
			r := newStream(sc.Seed, i, j+1)
			h.clients = append(h.clients, r)
			// Spread the first calls over one mean service time.
			s.schedule(time.Duration(r.Int64N(int64(sc.Mean))), evWake, i, j)
		}
	}

	for s.events.Len() > 0 {
		e := heap.Pop(&s.events).(event)
		if e.at >= s.end {
			break
		}
		s.now = e.at
		for s.phase < 2 && s.now >= time.Duration(s.phase+1)*sc.Phase {
			s.phase++
			s.out.LatAt[s.phase] = len(s.out.Latencies)
			at := time.Duration(s.phase) * sc.Phase
			s.out.Limit.mark(s.phase, s.total(), at)
			for _, h := range s.hosts {
				now := h.last
				now.rounds = h.roundsDone
				h.limit.mark(s.phase, now, at)
			}
		}
		switch e.kind {
		case evArrival:
			h := s.hosts[e.host]
			s.schedule(s.now+s.interarrival(h), evArrival, e.host, 0)
			s.attempt(e.host, -1, s.service(h.arrivals))
		case evWake:
			s.attempt(e.host, e.arg, s.service(s.hosts[e.host].clients[e.arg]))
		case evDone:
			s.done(e.arg)
		case evCapacity:
			s.servers = e.arg
			s.startQueued()
		}
	}
	if len(s.hosts) > 1 {
		for _, h := range s.hosts {
			s.out.Hosts = append(s.out.Hosts, HostTrace{Limit: h.limit, Steady: h.steady})
		}
	}
	return &s.out
}

// mark records the point in force at the start of phase p.
func (st *Steps) mark(p int, last point, at time.Duration) {
	st.PhaseAt[p] = len(st.Points)
	last.t = at
	st.Points = append(st.Points, last)
}

// newStream returns random stream n of host h's: 0 is its arrival
// process, j+1 its closed-loop client j. Host 0's are those of the
// one-host model.
func newStream(seed uint64, h, n int) *rand.Rand {
	return rand.New(rand.NewPCG(seed, uint64(h)<<20|uint64(n)))
}

func (s *sim) schedule(at time.Duration, kind eventKind, host, arg int) {
	s.seq++
	heap.Push(&s.events, event{at, s.seq, kind, host, arg})
}

// interarrival draws the gap to a host's next open-loop arrival:
// exponential, at its share of Load × full capacity.
func (s *sim) interarrival(h *host) time.Duration {
	rate := s.sc.Load * s.sc.capacity(s.sc.Servers) / float64(len(s.hosts))
	return time.Duration(h.arrivals.ExpFloat64() / rate * float64(time.Second))
}

// service draws a lognormal service time from r.
func (s *sim) service(r *rand.Rand) time.Duration {
	return time.Duration(math.Exp(s.mu + s.sc.Sigma*r.NormFloat64()))
}

// backoff draws how long closed-loop client j of h waits after a refusal.
func (s *sim) backoff(h *host, j int) time.Duration {
	return time.Duration(h.clients[j].ExpFloat64() * float64(s.sc.Backoff))
}

// retry schedules a closed-loop client's next attempt after a refusal or
// a failure; an open-loop arrival is lost.
func (s *sim) retry(hi, client int) {
	if client >= 0 {
		s.schedule(s.now+s.backoff(s.hosts[hi], client), evWake, hi, client)
	}
}

// attempt is a caller of host hi asking for a permit and, with one,
// calling.
func (s *sim) attempt(hi, client int, service time.Duration) {
	h := s.hosts[hi]
	token, ok := h.ctl.Acquire(s.now)
	s.observe(h)
	if !ok {
		s.out.Refused++
		s.retry(hi, client)
		return
	}
	id := s.newCall(call{s.now, service, token, hi, client})
	switch {
	case s.busy < s.servers:
		s.serve(id)
	case len(s.queue) < s.sc.QueuePer*s.servers:
		s.queue = append(s.queue, id)
	default:
		// The dependency's queue is full: a fast failure. Nothing was served,
		// so there is no latency worth learning from.
		s.out.Failed++
		h.ctl.Done(s.now, token, 0, true)
		s.observe(h)
		s.freeCall(id)
		s.retry(hi, client)
	}
}

func (s *sim) serve(id int) {
	s.busy++
	s.schedule(s.now+s.calls[id].service, evDone, 0, id)
}

// startQueued moves queued calls onto idle servers, oldest first.
func (s *sim) startQueued() {
	n := 0
	for n < len(s.queue) && s.busy < s.servers {
		s.serve(s.queue[n])
		n++
	}
	s.queue = s.queue[:copy(s.queue, s.queue[n:])]
}

// done is call id leaving its server: the server takes the next queued call,
// the caller returns its permit with the latency it measured, and a
// closed-loop caller calls again at once.
func (s *sim) done(id int) {
	c := s.calls[id]
	h := s.hosts[c.host]
	s.freeCall(id)
	s.busy--
	s.startQueued()

	latency := s.now - c.start
	s.out.Latencies = append(s.out.Latencies, latency)
	s.out.Completed[s.phase]++
	if s.now >= time.Duration(s.phase)*s.sc.Phase+s.sc.Phase/2 {
		h.steady[s.phase]++
	}
	// A round is one limit's worth of completed calls, whatever the
	// controller: this call is 1/limit of the round it counted toward.
	if h.last.limit != unlimited {
		h.roundsDone += 1 / float64(h.last.limit)
	}
	h.ctl.Done(s.now, c.token, latency, false)
	s.observe(h)
	if c.client >= 0 {
		s.attempt(c.host, c.client, s.service(h.clients[c.client]))
	}
}

// observe records h's limit, and the sum of the hosts', when it has moved.
func (s *sim) observe(h *host) {
	l, st := h.ctl.Limit(), settled(h.ctl)
	if l == h.last.limit && st == h.last.settled {
		return
	}
	h.last = point{s.now, l, h.roundsDone, st}
	h.limit.Points = append(h.limit.Points, h.last)
	s.sum = s.total()
	s.out.Limit.Points = append(s.out.Limit.Points, s.sum)
}

// total is the sum of the hosts' limits now, with their mean rounds; a
// host without a limit makes the sum unlimited.
func (s *sim) total() point {
	p := point{t: s.now}
	for _, h := range s.hosts {
		if h.last.limit == unlimited {
			return point{s.now, unlimited, 0, unlimited}
		}
		p.limit += h.last.limit
		p.settled += h.last.settled
		p.rounds += h.roundsDone / float64(len(s.hosts))
	}
	return p
}

func (s *sim) newCall(c call) int {
	if n := len(s.free); n > 0 {
		id := s.free[n-1]
		s.free = s.free[:n-1]
		s.calls[id] = c
		return id
	}
	s.calls = append(s.calls, c)
	return len(s.calls) - 1
}

func (s *sim) freeCall(id int) {
	s.calls[id] = call{}
	s.free = append(s.free, id)
}

// percentile returns the p-th percentile (0 < p ≤ 1) of d by nearest rank.
func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	rank := int(math.Ceil(p * float64(len(sorted))))
	return sorted[max(rank, 1)-1]
}

func sortedCopy(d []time.Duration) []time.Duration {
	c := slices.Clone(d)
	slices.Sort(c)
	return c
}
