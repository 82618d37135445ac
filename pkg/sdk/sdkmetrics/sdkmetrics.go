// Package sdkmetrics reports what the SDK executor's hedges do as
// Prometheus metrics. It is the only part of the executor that knows
// Prometheus: a Hedge is given an [sdk.HedgeObserver], and this package
// implements one.
//
//	m := sdkmetrics.New()
//	reg.MustRegister(m) // the application's registry, not the global one
//	p := sdkhttp.Defaults()
//	p.Hedge = sdk.NewHedge(sdk.HedgeOptions{Percentile: 0.95, Observer: m.Hedge("search")})
//	v, err := sdk.RunHedged(ctx, p, call) // or an sdkhttp stack, an sdkgrpc client
//
// Three families, one set of series per hedge:
//
//   - egressd_sdk_hedges_sent_total{hedge}: hedges sent - past the gate,
//     their attempt started (Admit or a limiter may still refuse it).
//   - egressd_sdk_hedges_won_total{hedge}: hedges whose answer was the
//     call's. Won over sent is how often hedging paid.
//   - egressd_sdk_hedges_suppressed_total{hedge, reason}: hedges that came
//     due and that the gate held back: criticality, refused, attempts,
//     breaker or budget.
package sdkmetrics

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/egressd/egressd/pkg/sdk"
	"github.com/egressd/egressd/pkg/verdict"
)

// Metrics holds the three families. It is a prometheus.Collector: register
// it once, on the application's registry.
type Metrics struct {
	sent, won  *prometheus.CounterVec
	suppressed *prometheus.CounterVec
}

// New returns the instruments, unregistered.
func New() *Metrics {
	hedge := []string{"hedge"}
	return &Metrics{
		sent: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "egressd_sdk_hedges_sent_total",
			Help: "Hedged attempts sent: copies of an attempt started beside it when it ran past the hedge delay, after the hedge gate let them through.",
		}, hedge),
		won: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "egressd_sdk_hedges_won_total",
			Help: "Hedged attempts whose answer was the call's: the attempt they raced was cancelled.",
		}, hedge),
		suppressed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "egressd_sdk_hedges_suppressed_total",
			Help: "Hedges that came due and that the hedge gate held back, by reason: criticality (work below Critical), refused (this process or host refused an attempt of the round), attempts (MaxAttempts reached), breaker (not closed) or budget (retry budget down to half).",
		}, []string{"hedge", "reason"}),
	}
}

// Describe implements prometheus.Collector.
func (m *Metrics) Describe(ch chan<- *prometheus.Desc) {
	m.sent.Describe(ch)
	m.won.Describe(ch)
	m.suppressed.Describe(ch)
}

// Collect implements prometheus.Collector.
func (m *Metrics) Collect(ch chan<- prometheus.Metric) {
	m.sent.Collect(ch)
	m.won.Collect(ch)
	m.suppressed.Collect(ch)
}

// Hedge returns the observer for the hedge named hedge (the dependency it
// calls, say): pass it in that hedge's sdk.HedgeOptions. Its series are made
// now, so that a hedge that has sent nothing shows zeros rather than no
// series.
func (m *Metrics) Hedge(hedge string) sdk.HedgeObserver {
	o := &observer{
		sent: m.sent.WithLabelValues(hedge),
		won:  m.won.WithLabelValues(hedge),
	}
	for r := verdict.Suppression(1); r.Valid(); r++ {
		o.suppressed = append(o.suppressed, m.suppressed.WithLabelValues(hedge, r.String()))
	}
	return o
}

// observer is one hedge's series, looked up once.
type observer struct {
	sent, won  prometheus.Counter
	suppressed []prometheus.Counter // by reason, SuppressedNone left out
}

func (o *observer) OnHedgeSent() { o.sent.Inc() }
func (o *observer) OnHedgeWon()  { o.won.Inc() }

func (o *observer) OnHedgeSuppressed(r verdict.Suppression) {
	if r > verdict.SuppressedNone && int(r) <= len(o.suppressed) {
		o.suppressed[r-1].Inc()
	}
}
