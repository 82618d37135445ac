package serve

import (
	"maps"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/egressd/egressd/pkg/partition"
)

// Middleware applies named policies to the routes they are given to, and
// reads the edge headers of the requests it sees. It is safe for concurrent
// use, and holds no goroutine.
type Middleware struct {
	policies map[string]*policy
	crit     CriticalityOptions
	reject   func(w http.ResponseWriter, r *http.Request, rej *Rejection)
	obs      Observer
}

// policy is a Policy made.
type policy struct {
	m       *Middleware
	name    string
	by      func(*http.Request) string
	limiter *partition.Partitioned
	obs     PolicyObserver // nil: none
}

// New returns a middleware, or an [*OptionsError] listing every problem
// with opts.
func New(opts Options) (*Middleware, error) {
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	m := &Middleware{
		policies: make(map[string]*policy, len(opts.Policies)),
		crit:     opts.Criticality,
		reject:   opts.Reject,
		obs:      opts.Observer,
	}
	if m.reject == nil {
		m.reject = DefaultReject
	}
	for _, p := range opts.Policies {
		l, obs, err := PolicyLimiter(p, m.obs)
		if err != nil { // Validate has seen these options; not reached
			return nil, err
		}
		m.policies[p.Name] = &policy{m: m, name: p.Name, by: p.Partition, limiter: l, obs: obs}
	}
	return m, nil
}

// Handler returns h behind the policy named policy, for one route:
//
//	mux.Handle("POST /work", m.Handler("per-client", work))
//
// Each request has its edge headers read (unless Edge or another policy of
// this package read them already), is put in its partition, and asks that
// partition's limiter for a permit on the request's context: without a
// queue it is admitted or refused at once, with one it waits no longer
// than that context, which the timeout header may have shortened. Admitted,
// it runs h holding the permit, released when h returns; otherwise the
// Reject hook answers it. Nest Handlers to apply several policies.
//
// Handler panics if there is no such policy, as http.ServeMux.Handle does
// for a bad pattern: a route wired to a policy that is not there is a
// mistake to catch at start-up, not a request to refuse at run time.
func (m *Middleware) Handler(policy string, h http.Handler) http.Handler {
	p := m.policies[policy]
	if p == nil {
		panic("serve: no policy named " + strconv.Quote(policy) + " (have " + m.names() + ")")
	}
	if h == nil {
		panic("serve: Handler(" + strconv.Quote(policy) + ", nil)")
	}
	return &limited{p: p, next: h}
}

// Edge returns h with the edge headers of every request read into its
// context (criticality, deadline), for a server that wants them on every
// route, policy or not: wrap the whole mux. Requests that go on through a
// policy are not read again.
func (m *Middleware) Edge(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		r, cancel := m.edge(r)
		defer cancel()
		h.ServeHTTP(w, r)
	})
}

// Partitions returns how many partitions the policy named policy holds,
// and false if there is no such policy.
func (m *Middleware) Partitions(policy string) (int, bool) {
	p := m.policies[policy]
	if p == nil {
		return 0, false
	}
	return p.limiter.Len(), true
}

func (m *Middleware) names() string {
	if len(m.policies) == 0 {
		return "none"
	}
	names := slices.Sorted(maps.Keys(m.policies))
	for i, n := range names {
		names[i] = strconv.Quote(n)
	}
	return strings.Join(names, ", ")
}

// limited is a route behind a policy.
type limited struct {
	p    *policy
	next http.Handler
}

func (l *limited) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	p := l.p
	r, cancel := p.m.edge(r)
	defer cancel()
	var key string
	if p.by != nil {
		key = p.by(r)
	}
	start := time.Now()
	lease, err := p.limiter.Acquire(r.Context(), key)
	took := time.Since(start)
	if err != nil {
		rej := rejection(p.name, key, r, err)
		if p.obs != nil {
			p.obs.OnRequest(rej.Outcome, took)
		}
		p.m.reject(w, r, rej)
		return
	}
	defer lease.Release()
	if p.obs != nil {
		p.obs.OnRequest(Admitted, took)
	}
	l.next.ServeHTTP(w, r)
}

// PolicyLimiter makes p's partitioned limiter, whose count of partitions
// obs hears (and p's own OnCount); it returns obs's observer of p, nil
// when obs is. The HTTP middleware and servegrpc's interceptors make
// their limiters with it.
func PolicyLimiter(p Policy, obs Observer) (*partition.Partitioned, PolicyObserver, error) {
	lo := p.LimiterOptions()
	var po PolicyObserver
	if obs != nil {
		po = obs.Policy(p.Name)
		user := lo.OnCount
		lo.OnCount = func(n int) {
			if user != nil {
				user(n)
			}
			po.OnPartitions(n)
		}
	}
	l, err := partition.New(lo)
	return l, po, err
}
