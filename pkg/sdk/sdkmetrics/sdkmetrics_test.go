package sdkmetrics_test

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/egressd/egressd/internal/docstest"
	"github.com/egressd/egressd/pkg/sdk"
	"github.com/egressd/egressd/pkg/sdk/sdkmetrics"
	"github.com/egressd/egressd/pkg/verdict"
)

// use makes two hedged calls: one whose hedge wins, one whose hedge the
// gate suppresses, as Sheddable work.
func use(t *testing.T, m *sdkmetrics.Metrics) {
	t.Helper()
	p := sdk.Defaults()
	obs := &signalling{HedgeObserver: m.Hedge("search"), suppressed: make(chan struct{}, 1)}
	p.Hedge = sdk.NewHedge(sdk.HedgeOptions{Delay: time.Millisecond, Observer: obs})
	// The hedge waits in Admit until the first attempt has started, so
	// that the first callback call is the first attempt's however late the
	// loaded machine runs it.
	started := make(chan struct{})
	p.Admit = func(_ context.Context, next sdk.NextAttempt) verdict.Verdict {
		if next.Hedge {
			<-started
		}
		return verdict.Verdict{}
	}
	var calls atomic.Int64
	slowFirst := func(ctx context.Context) (int, error) {
		if calls.Add(1) == 1 {
			close(started)
			<-ctx.Done() // the hedge answers and cancels this one
			return 0, ctx.Err()
		}
		return 1, nil
	}
	if r := sdk.TryHedged(context.Background(), p, slowFirst); r.Err != nil || !r.Attempts[1].Hedge() {
		t.Fatalf("hedged call: %v, %v", r.Err, r.Attempts)
	}
	shed := sdk.WithCriticality(context.Background(), sdk.Sheddable)
	wait := func(context.Context) (int, error) { <-obs.suppressed; return 1, nil } // until the gate has said no
	if r := sdk.TryHedged(shed, p, wait); r.Suppressed.String() != "criticality" {
		t.Fatalf("sheddable call: suppressed %v, want criticality", r.Suppressed)
	}
	_ = m.Hedge("idle")
}

// signalling passes what it is told on, and says when a hedge was
// suppressed.
type signalling struct {
	sdk.HedgeObserver
	suppressed chan struct{}
}

func (o *signalling) OnHedgeSuppressed(r verdict.Suppression) {
	o.HedgeObserver.OnHedgeSuppressed(r)
	o.suppressed <- struct{}{}
}

func TestLint(t *testing.T) {
	m := sdkmetrics.New()
	use(t, m)
	problems, err := testutil.CollectAndLint(m)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Errorf("%s: %s", p.Metric, p.Text)
	}
	docstest.Mentions(t, "../../../docs/metrics.md", docstest.Families(t, m)...)
}

func TestSeries(t *testing.T) {
	m := sdkmetrics.New()
	reg := prometheus.NewPedanticRegistry() // never the global one
	reg.MustRegister(m)
	use(t, m)
	want := `
# HELP egressd_sdk_hedges_sent_total Hedged attempts sent: copies of an attempt started beside it when it ran past the hedge delay, after the hedge gate let them through.
# TYPE egressd_sdk_hedges_sent_total counter
egressd_sdk_hedges_sent_total{hedge="idle"} 0
egressd_sdk_hedges_sent_total{hedge="search"} 1
# HELP egressd_sdk_hedges_won_total Hedged attempts whose answer was the call's: the attempt they raced was cancelled.
# TYPE egressd_sdk_hedges_won_total counter
egressd_sdk_hedges_won_total{hedge="idle"} 0
egressd_sdk_hedges_won_total{hedge="search"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "egressd_sdk_hedges_sent_total", "egressd_sdk_hedges_won_total"); err != nil {
		t.Fatal(err)
	}
	for reason, n := range map[string]float64{"criticality": 1, "refused": 0, "attempts": 0, "breaker": 0, "budget": 0} {
		c, err := suppressed(reg, reason)
		if err != nil || c != n {
			t.Errorf("suppressed{reason=%q} = %v, %v; want %v", reason, c, err, n)
		}
	}
}

// suppressed reads the search hedge's suppressed counter for reason.
func suppressed(reg *prometheus.Registry, reason string) (float64, error) {
	mfs, err := reg.Gather()
	if err != nil {
		return 0, err
	}
	for _, mf := range mfs {
		if mf.GetName() != "egressd_sdk_hedges_suppressed_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if labels["hedge"] == "search" && labels["reason"] == reason {
				return m.GetCounter().GetValue(), nil
			}
		}
	}
	return -1, nil
}
