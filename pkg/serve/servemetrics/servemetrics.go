// Package servemetrics reports what package serve's middleware does as
// Prometheus metrics. It is the only part of the serving side that knows
// Prometheus: the middleware is given a [serve.Observer], and this package
// implements one.
//
//	m := servemetrics.New()
//	reg.MustRegister(m) // the application's registry, not the global one
//	mw, err := serve.New(serve.Options{Policies: policies, Observer: m})
//
// Four families:
//
//   - egressd_sdk_serve_requests_total{policy, outcome}: requests a policy
//     handled, by outcome: admitted, refused, cancelled (the request's
//     context ended while it waited) or failed (no decision could be had).
//   - egressd_sdk_serve_admission_seconds{policy}: how long admission took:
//     time queued, and for a shared limiter the round trip to Redis.
//   - egressd_sdk_serve_partitions{policy}: partitions the policy holds.
//   - egressd_sdk_serve_edge_headers_total{header, result}: what became of
//     each edge header (criticality, timeout) of each request read: missing,
//     accepted, capped or malformed.
package servemetrics

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/egressd/egressd/pkg/serve"
)

// Metrics holds the four families. It is a prometheus.Collector: register
// it once, on the application's registry. It is a serve.Observer: pass it
// in serve.Options.
type Metrics struct {
	requests   *prometheus.CounterVec
	admission  *prometheus.HistogramVec
	partitions *prometheus.GaugeVec
	headers    [][]prometheus.Counter // by header, by result
	headerVec  *prometheus.CounterVec
}

var _ serve.Observer = (*Metrics)(nil)

// admissionBuckets run from an in-process decision, well under a
// millisecond, through a Redis round trip, to the waits a queue is bounded
// by.
var admissionBuckets = []float64{.0001, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30}

// New returns the instruments, unregistered.
func New() *Metrics {
	policy := []string{"policy"}
	m := &Metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "egressd_sdk_serve_requests_total",
			Help: "Requests a serving policy handled, by outcome: admitted, refused (429), cancelled (the request's context ended while it waited for a permit) or failed (the limiter could not decide; 503).",
		}, []string{"policy", "outcome"}),
		admission: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "egressd_sdk_serve_admission_seconds",
			Help:    "How long a serving policy took to admit or turn away a request: time queued, and for a shared limiter the round trip to Redis.",
			Buckets: admissionBuckets,
		}, policy),
		partitions: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "egressd_sdk_serve_partitions",
			Help: "Partitions (clients, tenants, identities) a serving policy holds a limiter for now.",
		}, policy),
		headerVec: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "egressd_sdk_serve_edge_headers_total",
			Help: "Criticality and timeout headers of requests served, by what became of them: missing, accepted, capped (above the criticality ceiling, or later than the request's own deadline) or malformed (ignored).",
		}, []string{"header", "result"}),
	}
	// Every header's series exist from the start, so that a header nobody
	// has yet sent malformed shows a zero rather than no series.
	for h := serve.Header(0); h.Valid(); h++ {
		var byResult []prometheus.Counter
		for r := serve.HeaderResult(0); r.Valid(); r++ {
			byResult = append(byResult, m.headerVec.WithLabelValues(h.String(), r.String()))
		}
		m.headers = append(m.headers, byResult)
	}
	return m
}

// Describe implements prometheus.Collector.
func (m *Metrics) Describe(ch chan<- *prometheus.Desc) {
	m.requests.Describe(ch)
	m.admission.Describe(ch)
	m.partitions.Describe(ch)
	m.headerVec.Describe(ch)
}

// Collect implements prometheus.Collector.
func (m *Metrics) Collect(ch chan<- prometheus.Metric) {
	m.requests.Collect(ch)
	m.admission.Collect(ch)
	m.partitions.Collect(ch)
	m.headerVec.Collect(ch)
}

// Policy implements serve.Observer: serve.New calls it once per policy. The
// policy's request counters, its admission histogram and its partitions
// gauge are made now, so that a policy that has refused nothing shows a
// zero rather than no series.
func (m *Metrics) Policy(policy string) serve.PolicyObserver {
	o := &observer{
		admission:  m.admission.WithLabelValues(policy),
		partitions: m.partitions.WithLabelValues(policy),
	}
	for out := serve.Outcome(0); out.Valid(); out++ {
		o.requests = append(o.requests, m.requests.WithLabelValues(policy, out.String()))
	}
	return o
}

// OnHeader implements serve.Observer.
func (m *Metrics) OnHeader(h serve.Header, r serve.HeaderResult) {
	if h.Valid() && r.Valid() {
		m.headers[h][r].Inc()
	}
}

// observer is one policy's series, looked up once: OnRequest is on every
// request's path.
type observer struct {
	requests   []prometheus.Counter // by outcome
	admission  prometheus.Observer
	partitions prometheus.Gauge
}

func (o *observer) OnRequest(out serve.Outcome, admission time.Duration) {
	if out.Valid() {
		o.requests[out].Inc()
	}
	o.admission.Observe(admission.Seconds())
}

func (o *observer) OnPartitions(n int) { o.partitions.Set(float64(n)) }
