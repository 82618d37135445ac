package limitmetrics_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/egressd/egressd/internal/docstest"
	"github.com/egressd/egressd/pkg/adaptive"
	"github.com/egressd/egressd/pkg/limit"
	"github.com/egressd/egressd/pkg/limit/limitmetrics"
)

func TestLint(t *testing.T) {
	m := limitmetrics.New()
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

// use drives three limiters, so that every family has series.
func use(t *testing.T, m *limitmetrics.Metrics) {
	t.Helper()
	ctx := context.Background()
	bulkhead, err := limit.New(limit.Options{Name: "payments", Concurrency: 1, QueueLimit: 1, Observer: m.Observer("payments")})
	if err != nil {
		t.Fatal(err)
	}
	held, _ := bulkhead.Acquire(ctx)
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	_, _ = bulkhead.Acquire(cancelled) // denied: its context is done
	held.Release()

	quota, err := limit.New(limit.Options{Name: "search", PerSecond: &limit.PerSecondOptions{Permits: 1}, Observer: m.Observer("search")})
	if err != nil {
		t.Fatal(err)
	}
	_, _ = quota.Acquire(ctx)
	_, _ = quota.Acquire(ctx) // denied

	if _, err := limit.New(limit.Options{Name: "ledger", Adaptive: &adaptive.Options{Maximum: 50}, Observer: m.Observer("ledger")}); err != nil {
		t.Fatal(err)
	}
}

func TestSeries(t *testing.T) {
	m := limitmetrics.New()
	reg := prometheus.NewPedanticRegistry() // never the global one
	reg.MustRegister(m)
	use(t, m)
	want := `
# HELP egressd_sdk_limiter_leases_total Permits asked of an in-process limiter, by outcome: acquired, or denied (refused, or the caller's context ended while it waited).
# TYPE egressd_sdk_limiter_leases_total counter
egressd_sdk_limiter_leases_total{limiter="ledger",outcome="acquired"} 0
egressd_sdk_limiter_leases_total{limiter="ledger",outcome="denied"} 0
egressd_sdk_limiter_leases_total{limiter="payments",outcome="acquired"} 1
egressd_sdk_limiter_leases_total{limiter="payments",outcome="denied"} 1
egressd_sdk_limiter_leases_total{limiter="search",outcome="acquired"} 1
egressd_sdk_limiter_leases_total{limiter="search",outcome="denied"} 1
# HELP egressd_sdk_limiter_limit The concurrency limit an adaptive in-process limiter has settled on.
# TYPE egressd_sdk_limiter_limit gauge
egressd_sdk_limiter_limit{limiter="ledger"} 20
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "egressd_sdk_limiter_leases_total", "egressd_sdk_limiter_limit"); err != nil {
		t.Fatal(err)
	}
	// Both of payments' acquires went through its queue; neither waited.
	// The others have no queue, and no wait series.
	if n := testutil.CollectAndCount(m, "egressd_sdk_limiter_wait_seconds"); n != 1 {
		t.Fatalf("%d wait series; want one, for the limiter with a queue", n)
	}
	o := m.Observer("payments")
	o.OnWait(2 * time.Second)
	if err := testutil.GatherAndCompare(reg, strings.NewReader(waitWant), "egressd_sdk_limiter_wait_seconds"); err != nil {
		t.Fatal(err)
	}

	m.Forget("payments")
	if n := testutil.CollectAndCount(m); n != 5 {
		t.Fatalf("%d series after forgetting payments; want 5: two lease counters each for search and ledger, ledger's limit", n)
	}
}

// waitWant is payments' histogram after two zero waits and one of 2s.
const waitWant = `
# HELP egressd_sdk_limiter_wait_seconds How long callers of an in-process limiter with a queue waited for a permit or a refusal; zero when they did not wait.
# TYPE egressd_sdk_limiter_wait_seconds histogram
egressd_sdk_limiter_wait_seconds_bucket{limiter="payments",le="0.0001"} 2
egressd_sdk_limiter_wait_seconds_bucket{limiter="payments",le="0.0005"} 2
egressd_sdk_limiter_wait_seconds_bucket{limiter="payments",le="0.001"} 2
egressd_sdk_limiter_wait_seconds_bucket{limiter="payments",le="0.005"} 2
egressd_sdk_limiter_wait_seconds_bucket{limiter="payments",le="0.01"} 2
egressd_sdk_limiter_wait_seconds_bucket{limiter="payments",le="0.025"} 2
egressd_sdk_limiter_wait_seconds_bucket{limiter="payments",le="0.05"} 2
egressd_sdk_limiter_wait_seconds_bucket{limiter="payments",le="0.1"} 2
egressd_sdk_limiter_wait_seconds_bucket{limiter="payments",le="0.25"} 2
egressd_sdk_limiter_wait_seconds_bucket{limiter="payments",le="0.5"} 2
egressd_sdk_limiter_wait_seconds_bucket{limiter="payments",le="1"} 2
egressd_sdk_limiter_wait_seconds_bucket{limiter="payments",le="2.5"} 3
egressd_sdk_limiter_wait_seconds_bucket{limiter="payments",le="5"} 3
egressd_sdk_limiter_wait_seconds_bucket{limiter="payments",le="10"} 3
egressd_sdk_limiter_wait_seconds_bucket{limiter="payments",le="30"} 3
egressd_sdk_limiter_wait_seconds_bucket{limiter="payments",le="+Inf"} 3
egressd_sdk_limiter_wait_seconds_sum{limiter="payments"} 2
egressd_sdk_limiter_wait_seconds_count{limiter="payments"} 3
`

// BenchmarkObserved is what the instruments add to an acquire: a counter
// increment, and with a queue a histogram observation.
func BenchmarkObserved(b *testing.B) {
	m := limitmetrics.New()
	opts := func(name string, queue int, obs bool) limit.Options {
		o := limit.Options{Name: name, PerSecond: &limit.PerSecondOptions{Permits: limit.MaxRate}, QueueLimit: queue}
		if obs {
			o.Observer = m.Observer(name)
		}
		return o
	}
	ctx := context.Background()
	for _, o := range []limit.Options{opts("bare", 0, false), opts("observed", 0, true), opts("queue", 1, false), opts("queue+observed", 1, true)} {
		l, err := limit.New(o)
		if err != nil {
			b.Fatal(err)
		}
		bm := struct {
			name string
			l    *limit.Local
		}{o.Name, l}
		b.Run(bm.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				lease, _ := bm.l.Acquire(ctx)
				lease.Release()
			}
		})
	}
}
