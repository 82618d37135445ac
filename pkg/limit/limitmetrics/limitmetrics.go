// Package limitmetrics reports what package limit's limiters do as Prometheus
// metrics. It is the only part of the limiter that knows Prometheus: a
// limiter is told about an [limit.Observer], and this package implements one.
//
//	m := limitmetrics.New()
//	reg.MustRegister(m) // the application's registry, not the global one
//	l, err := limit.New(limit.Options{
//		Name:        "payments",
//		Concurrency: 20,
//		Observer:    m.Observer("payments"),
//	})
//
// Three families, one series (or set) per limiter:
//
//   - egressd_sdk_limiter_leases_total{limiter, outcome}: permits asked for,
//     by outcome, acquired or denied.
//   - egressd_sdk_limiter_wait_seconds{limiter}: how long callers of a
//     limiter with a queue waited (zero when they did not).
//   - egressd_sdk_limiter_limit{limiter}: the limit an adaptive limiter has
//     settled on, which drain probes do not move. Watching it fall is
//     watching the dependency queue.
package limitmetrics

import (
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/egressd/egressd/pkg/limit"
)

// Metrics holds the three families. It is a prometheus.Collector: register it
// once, on the application's registry.
type Metrics struct {
	leases *prometheus.CounterVec
	wait   *prometheus.HistogramVec
	limit  *prometheus.GaugeVec
}

// waitBuckets run from well under a millisecond to the attempt timeouts a
// queued call is bounded by.
var waitBuckets = []float64{.0001, .0005, .001, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30}

// New returns the instruments, unregistered.
func New() *Metrics {
	limiter := []string{"limiter"}
	return &Metrics{
		leases: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "egressd_sdk_limiter_leases_total",
			Help: "Permits asked of an in-process limiter, by outcome: acquired, or denied (refused, or the caller's context ended while it waited).",
		}, []string{"limiter", "outcome"}),
		wait: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "egressd_sdk_limiter_wait_seconds",
			Help:    "How long callers of an in-process limiter with a queue waited for a permit or a refusal; zero when they did not wait.",
			Buckets: waitBuckets,
		}, limiter),
		limit: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "egressd_sdk_limiter_limit",
			Help: "The concurrency limit an adaptive in-process limiter has settled on.",
		}, limiter),
	}
}

// Describe implements prometheus.Collector.
func (m *Metrics) Describe(ch chan<- *prometheus.Desc) {
	m.leases.Describe(ch)
	m.wait.Describe(ch)
	m.limit.Describe(ch)
}

// Collect implements prometheus.Collector.
func (m *Metrics) Collect(ch chan<- prometheus.Metric) {
	m.leases.Collect(ch)
	m.wait.Collect(ch)
	m.limit.Collect(ch)
}

// Observer returns the observer for the limiter named limiter: pass it in
// that limiter's limit.Options, with the same Name. Its lease counters are
// made now, so that a limiter that has refused nothing shows a zero rather
// than no series; the wait histogram when the limiter first waits (only a
// limiter with a queue does), and the limit gauge when it first reports (only
// an adaptive one does), so that no other shape shows a limit of zero.
func (m *Metrics) Observer(limiter string) limit.Observer {
	o := &observer{m: m, limiter: limiter}
	for out := limit.Outcome(0); out.Valid(); out++ {
		o.leases = append(o.leases, m.leases.WithLabelValues(limiter, out.String()))
	}
	return o
}

// Forget deletes the limiter's series, for a limiter that is gone (one per
// host, say, when the host is). What its observer is told afterwards is lost.
func (m *Metrics) Forget(limiter string) {
	for out := limit.Outcome(0); out.Valid(); out++ {
		m.leases.DeleteLabelValues(limiter, out.String())
	}
	m.wait.DeleteLabelValues(limiter)
	m.limit.DeleteLabelValues(limiter)
}

// observer is one limiter's series, looked up once: OnLease and OnWait are
// on every acquire's path.
type observer struct {
	m        *Metrics
	limiter  string
	leases   []prometheus.Counter // by outcome
	waitOnce sync.Once
	wait     prometheus.Observer
}

func (o *observer) OnLease(out limit.Outcome) {
	if int(out) < len(o.leases) {
		o.leases[out].Inc()
	}
}

func (o *observer) OnWait(d time.Duration) {
	o.waitOnce.Do(o.resolveWait)
	o.wait.Observe(d.Seconds())
}

func (o *observer) resolveWait() { o.wait = o.m.wait.WithLabelValues(o.limiter) }

// OnLimit is called when an adaptive limit moves, rarely enough to look the
// gauge up each time.
func (o *observer) OnLimit(n int) { o.m.limit.WithLabelValues(o.limiter).Set(float64(n)) }
