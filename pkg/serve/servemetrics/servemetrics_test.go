package servemetrics_test

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/egressd/egressd/internal/docstest"
	"github.com/egressd/egressd/pkg/limit"
	"github.com/egressd/egressd/pkg/partition"
	"github.com/egressd/egressd/pkg/sdk"
	"github.com/egressd/egressd/pkg/serve"
	"github.com/egressd/egressd/pkg/serve/servemetrics"
)

func TestLint(t *testing.T) {
	m := servemetrics.New()
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

// use serves six requests through two policies, so that every family has
// series: "per-client" admits one request per tenant per hour, "status" is
// never used.
func use(t *testing.T, m *servemetrics.Metrics) {
	t.Helper()
	mw, err := serve.New(serve.Options{
		Policies: []serve.Policy{
			{Name: "per-client", Partition: serve.ByHeader("X-Tenant"), Limiter: partition.Options{
				Local: &limit.Options{PerWindow: &limit.PerWindowOptions{Permits: 1, Window: time.Hour}},
			}},
			{Name: "status", Limiter: partition.Options{Local: &limit.Options{Concurrency: 1}}},
		},
		Observer: m,
	})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw.Handler("per-client", http.HandlerFunc(func(http.ResponseWriter, *http.Request) {})))
	t.Cleanup(srv.Close)
	for _, h := range [][]string{
		{"X-Tenant", "acme"},
		{"X-Tenant", "acme", sdk.CriticalityHeader, "Sheddable"},
		{"X-Tenant", "acme", sdk.CriticalityHeader, "CriticalPlus"},
		{"X-Tenant", "globex", sdk.TimeoutHeader, "5000"},
		{"X-Tenant", "globex", sdk.TimeoutHeader, "soon"},
		{"X-Tenant", "initech", sdk.CriticalityHeader, "Urgent"},
	} {
		req, _ := http.NewRequest(http.MethodGet, srv.URL, nil)
		for i := 0; i+1 < len(h); i += 2 {
			req.Header.Set(h[i], h[i+1])
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
}

func TestSeries(t *testing.T) {
	m := servemetrics.New()
	reg := prometheus.NewPedanticRegistry() // never the global one
	reg.MustRegister(m)
	use(t, m)
	want := `
# HELP egressd_sdk_serve_edge_headers_total Criticality and timeout headers of requests served, by what became of them: missing, accepted, capped (above the criticality ceiling, or later than the request's own deadline) or malformed (ignored).
# TYPE egressd_sdk_serve_edge_headers_total counter
egressd_sdk_serve_edge_headers_total{header="criticality",result="accepted"} 1
egressd_sdk_serve_edge_headers_total{header="criticality",result="capped"} 1
egressd_sdk_serve_edge_headers_total{header="criticality",result="malformed"} 1
egressd_sdk_serve_edge_headers_total{header="criticality",result="missing"} 3
egressd_sdk_serve_edge_headers_total{header="timeout",result="accepted"} 1
egressd_sdk_serve_edge_headers_total{header="timeout",result="capped"} 0
egressd_sdk_serve_edge_headers_total{header="timeout",result="malformed"} 1
egressd_sdk_serve_edge_headers_total{header="timeout",result="missing"} 4
# HELP egressd_sdk_serve_partitions Partitions (clients, tenants, identities) a serving policy holds a limiter for now.
# TYPE egressd_sdk_serve_partitions gauge
egressd_sdk_serve_partitions{policy="per-client"} 3
egressd_sdk_serve_partitions{policy="status"} 0
# HELP egressd_sdk_serve_requests_total Requests a serving policy handled, by outcome: admitted, refused (429), cancelled (the request's context ended while it waited for a permit) or failed (the limiter could not decide; 503).
# TYPE egressd_sdk_serve_requests_total counter
egressd_sdk_serve_requests_total{outcome="admitted",policy="per-client"} 3
egressd_sdk_serve_requests_total{outcome="admitted",policy="status"} 0
egressd_sdk_serve_requests_total{outcome="cancelled",policy="per-client"} 0
egressd_sdk_serve_requests_total{outcome="cancelled",policy="status"} 0
egressd_sdk_serve_requests_total{outcome="failed",policy="per-client"} 0
egressd_sdk_serve_requests_total{outcome="failed",policy="status"} 0
egressd_sdk_serve_requests_total{outcome="refused",policy="per-client"} 3
egressd_sdk_serve_requests_total{outcome="refused",policy="status"} 0
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want),
		"egressd_sdk_serve_edge_headers_total", "egressd_sdk_serve_partitions", "egressd_sdk_serve_requests_total"); err != nil {
		t.Fatal(err)
	}
	// Admission times vary; their count does not: six requests to
	// per-client, none to status.
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	counts := map[string]uint64{}
	for _, mf := range mfs {
		if mf.GetName() != "egressd_sdk_serve_admission_seconds" {
			continue
		}
		for _, metric := range mf.GetMetric() {
			counts[metric.GetLabel()[0].GetValue()] = metric.GetHistogram().GetSampleCount()
		}
	}
	if counts["per-client"] != 6 || counts["status"] != 0 || len(counts) != 2 {
		t.Errorf("admission samples by policy %v; want per-client 6, status 0", counts)
	}
}

// BenchmarkObserved is what the instruments add to a request's admission:
// a counter increment and a histogram observation.
func BenchmarkObserved(b *testing.B) {
	o := servemetrics.New().Policy("api")
	b.ReportAllocs()
	for b.Loop() {
		o.OnRequest(serve.Admitted, time.Millisecond)
	}
}
