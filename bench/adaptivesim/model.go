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

	// Open loop: Poisson arrivals at Load × full capacity, whatever happens
	// to them; a refused arrival is lost, not retried.
	Open bool
	Load float64

	// Closed loop: Clients callers, each issuing its next call the instant
	// the previous one returns, and after a refusal waiting an exponentially
	// distributed Backoff (mean) before asking again.
	Clients int
	Backoff time.Duration

	Phase time.Duration // length of each phase; the run is 3 × Phase
	Seed  uint64
}

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

// point is one step of a controller's limit: from instant t the limit in
// force was limit and the limit it had settled on settled (the same but for
// a Settler in a probe), and rounds rounds had completed since the start of
// the run.
type point struct {
	t       time.Duration
	limit   int
	rounds  float64
	settled int
}

// Trace is what one run of one controller produced.
type Trace struct {
	Latencies []time.Duration // of every call that completed, in completion order
	LatAt     [3]int          // index into Latencies of each phase's first
	Completed [3]int          // calls completed per phase
	Refused   int             // acquires refused by the controller
	Failed    int             // calls the dependency's full queue turned away
	Limit     []point         // every change of the limit, plus one at each phase start
	PhaseAt   [3]int          // index into Limit of the point at each phase start
}

// A call in flight: admitted by the controller, queued or in service.
type call struct {
	start   time.Duration
	service time.Duration
	token   any
	client  int // -1 for an open-loop arrival
}

type eventKind uint8

const (
	evArrival  eventKind = iota // next open-loop arrival
	evWake                      // closed-loop client arg asks again
	evDone                      // call arg leaves its server
	evCapacity                  // the dependency now has arg servers
)

type event struct {
	at   time.Duration
	seq  uint64 // ties at one instant run in the order they were scheduled
	kind eventKind
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

// sim is one discrete-event run: a dependency of c FIFO servers in virtual
// time, its callers, and a controller between them. Every random draw comes
// from a stream owned by the thing it describes (the arrival process, or one
// client), so every controller sees the same trace: the same arrivals at the
// same instants asking for the same service, only admitted differently.
type sim struct {
	sc  *Scenario
	ctl Controller
	end time.Duration

	now    time.Duration
	seq    uint64
	events events

	servers, busy int
	queue         []int // call ids, FIFO
	calls         []call
	free          []int

	mu       float64 // of the service time's logarithm, in nanoseconds
	arrivals *rand.Rand
	clients  []*rand.Rand

	out        Trace
	limit      int     // last limit recorded in out.Limit
	settled    int     // and the last settled limit
	roundsDone float64 // rounds completed since the start
	phase      int
}

func (s *sim) rounds() float64 { return s.roundsDone }

// Simulate runs sc with ctl and returns what happened. Same sc, same
// controller behaviour, same Trace.
func Simulate(sc *Scenario, ctl Controller) *Trace {
	s := &sim{
		sc:      sc,
		ctl:     ctl,
		end:     3 * sc.Phase,
		servers: sc.Servers,
		// A lognormal with mean m has μ = ln m − σ²/2.
		mu: math.Log(float64(sc.Mean)) - sc.Sigma*sc.Sigma/2,
	}
	s.limit, s.settled = ctl.Limit(), settled(ctl)
	s.out.Limit = append(s.out.Limit, point{0, s.limit, 0, s.settled})

	s.schedule(sc.Phase, evCapacity, sc.serversAt(sc.Phase))
	s.schedule(2*sc.Phase, evCapacity, sc.serversAt(2*sc.Phase))
	if sc.Open {
		s.arrivals = newStream(sc.Seed, 0)
		s.schedule(s.interarrival(), evArrival, 0)
	} else {
		for i := range sc.Clients {
			r := newStream(sc.Seed, uint64(i)+1)
			s.clients = append(s.clients, r)
			// Spread the first calls over one mean service time.
			s.schedule(time.Duration(r.Int64N(int64(sc.Mean))), evWake, i)
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
			s.out.PhaseAt[s.phase] = len(s.out.Limit)
			s.out.LatAt[s.phase] = len(s.out.Latencies)
			s.out.Limit = append(s.out.Limit, point{time.Duration(s.phase) * sc.Phase, s.limit, s.rounds(), s.settled})
		}
		switch e.kind {
		case evArrival:
			s.schedule(s.now+s.interarrival(), evArrival, 0)
			s.attempt(-1, s.service(s.arrivals))
		case evWake:
			s.attempt(e.arg, s.service(s.clients[e.arg]))
		case evDone:
			s.done(e.arg)
		case evCapacity:
			s.servers = e.arg
			s.startQueued()
		}
	}
	return &s.out
}

// newStream returns random stream n of seed: 0 is the arrival process, i+1
// closed-loop client i.
func newStream(seed, n uint64) *rand.Rand {
	return rand.New(rand.NewPCG(seed, n))
}

func (s *sim) schedule(at time.Duration, kind eventKind, arg int) {
	s.seq++
	heap.Push(&s.events, event{at, s.seq, kind, arg})
}

// interarrival draws the gap to the next open-loop arrival: exponential, at
// Load × full capacity.
func (s *sim) interarrival() time.Duration {
	rate := s.sc.Load * s.sc.capacity(s.sc.Servers)
	return time.Duration(s.arrivals.ExpFloat64() / rate * float64(time.Second))
}

// service draws a lognormal service time from r.
func (s *sim) service(r *rand.Rand) time.Duration {
	return time.Duration(math.Exp(s.mu + s.sc.Sigma*r.NormFloat64()))
}

// backoff draws how long closed-loop client i waits after a refusal.
func (s *sim) backoff(i int) time.Duration {
	return time.Duration(s.clients[i].ExpFloat64() * float64(s.sc.Backoff))
}

// attempt is a caller asking for a permit and, with one, calling.
func (s *sim) attempt(client int, service time.Duration) {
	token, ok := s.ctl.Acquire(s.now)
	s.observe()
	if !ok {
		s.out.Refused++
		if client >= 0 {
			s.schedule(s.now+s.backoff(client), evWake, client)
		}
		return
	}
	id := s.newCall(call{s.now, service, token, client})
	switch {
	case s.busy < s.servers:
		s.serve(id)
	case len(s.queue) < s.sc.QueuePer*s.servers:
		s.queue = append(s.queue, id)
	default:
		// The dependency's queue is full: a fast failure. Nothing was served,
		// so there is no latency worth learning from.
		s.out.Failed++
		s.ctl.Done(s.now, token, 0, true)
		s.observe()
		s.freeCall(id)
		if client >= 0 {
			s.schedule(s.now+s.backoff(client), evWake, client)
		}
	}
}

func (s *sim) serve(id int) {
	s.busy++
	s.schedule(s.now+s.calls[id].service, evDone, id)
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
	s.freeCall(id)
	s.busy--
	s.startQueued()

	latency := s.now - c.start
	s.out.Latencies = append(s.out.Latencies, latency)
	s.out.Completed[s.phase]++
	// A round is one limit's worth of completed calls, whatever the
	// controller: this call is 1/limit of the round it counted toward.
	if s.limit != unlimited {
		s.roundsDone += 1 / float64(s.limit)
	}
	s.ctl.Done(s.now, c.token, latency, false)
	s.observe()
	if c.client >= 0 {
		s.attempt(c.client, s.service(s.clients[c.client]))
	}
}

// observe records the controller's limit when it has moved.
func (s *sim) observe() {
	if l, h := s.ctl.Limit(), settled(s.ctl); l != s.limit || h != s.settled {
		s.limit, s.settled = l, h
		s.out.Limit = append(s.out.Limit, point{s.now, l, s.rounds(), h})
	}
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
