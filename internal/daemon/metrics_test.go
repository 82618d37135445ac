package daemon

import (
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/prometheus/client_golang/prometheus/testutil/promlint"

	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/internal/docstest"
	"github.com/egressd/egressd/internal/redistest"
	"github.com/egressd/egressd/pkg/control"
	"github.com/egressd/egressd/pkg/loader"
)

// everyShape has a rule of each shape, a shadow rule and a rule whose unit
// is not running, so that every metric family has samples.
const everyShape = `rules:
  - name: conc
    destination: 127.0.0.1
    port: 9
    concurrency: 2
  - name: rate
    destination: 127.0.0.1
    port: 7
    perSecond: {permits: 10, burst: 20}
  - name: window
    destination: 127.0.0.1
    port: 13
    perWindow: {permits: 100, window: 1m}
  - name: adapt
    destination: 127.0.0.1
    port: 19
    adaptive: {minimum: 2, maximum: 50, initial: 4}
  - name: shadow
    destination: 127.0.0.2
    concurrency: 1
    shadow: true
  - name: absent
    destination: 127.0.0.3
    unit: egressd-test-absent.service
    concurrency: 1
`

// TestMetricsLint lints the daemon's collector with every family present,
// on a pedantic registry that also checks samples against descriptions.
func TestMetricsLint(t *testing.T) {
	rds := redistest.Start(t)
	d := newTestDaemon(t)
	d.apply(t, everyShape+fmt.Sprintf(`  - name: shared-pool
    destination: 127.0.0.4
    concurrency: 5
    shared: {redis: %[1]q, key: pool}
  - name: shared-rate
    destination: 127.0.0.5
    perSecond: {permits: 100}
    shared: {redis: %[1]q, key: rate, failureMode: deny}
`, rds.URL()))
	// Give the adaptive rule a baseline and take a recount, the two
	// families that need them.
	ctrl := d.table.entries["adapt"].ctrl
	for range 20 {
		ctrl.Sample(time.Now(), 5*time.Millisecond)
	}
	if _, ok := ctrl.Baseline(); !ok {
		t.Fatal("adaptive rule has no baseline after 20 samples")
	}
	d.recount()

	problems, err := testutil.CollectAndLint(d.metrics)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Errorf("promlint: %s: %s", p.Metric, p.Text)
	}

	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(d.metrics)
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, f := range fams {
		names = append(names, f.GetName())
	}
	want := []string{
		"egressd_adaptive_probes_total",
		"egressd_adaptive_probing",
		"egressd_adaptive_settled_limit",
		"egressd_baseline_latency_seconds",
		"egressd_build_info",
		"egressd_class_connect_failures_total",
		"egressd_class_in_flight_requests",
		"egressd_class_leases_total",
		"egressd_class_live_connections",
		"egressd_class_recount_drifting_rules",
		"egressd_class_recount_released_total",
		"egressd_class_recount_remarked_total",
		"egressd_class_rules",
		"egressd_class_shared_unreachable_rules",
		"egressd_connect_failures_total",
		"egressd_connect_latency_seconds",
		"egressd_events_lost_total",
		"egressd_in_flight_requests",
		"egressd_leases_total",
		"egressd_limit",
		"egressd_limit_window_seconds",
		"egressd_live_connections",
		"egressd_per_rule_series_max_rules",
		"egressd_per_rule_series_rules",
		"egressd_policy_last_load_ok",
		"egressd_policy_reloads_total",
		"egressd_recount_drift",
		"egressd_recount_released_total",
		"egressd_recount_remarked_total",
		"egressd_request_latency_seconds",
		"egressd_rule_info",
		"egressd_rules",
		"egressd_shared_expired",
		"egressd_shared_failure_mode_info",
		"egressd_shared_fair_share_slots",
		"egressd_shared_frozen",
		"egressd_shared_granted_permits_total",
		"egressd_shared_returned_permits_total",
		"egressd_shared_slots",
		"egressd_shared_state_lost_total",
		"egressd_shared_store_errors_total",
		"egressd_shared_store_up",
		"egressd_shared_unconfirmed_growths_total",
		"egressd_shared_unconfirmed_permits_total",
	}
	docstest.Mentions(t, "../../docs/metrics.md", names...)
	if !slices.Equal(names, want) {
		t.Errorf("families:\n got %q\nwant %q", names, want)
	}
	if n := testutil.CollectAndCount(d.metrics, "egressd_leases_total"); n != 3*7 {
		t.Errorf("egressd_leases_total has %d samples, want 3 outcomes × 7 installed rules", n)
	}
	// What egressd_limit counts, as the policy says it: a shared rate's
	// kernel rule grants permits, but the rule is perSecond.
	if err := testutil.CollectAndCompare(d.metrics, strings.NewReader(`
# HELP egressd_limit_window_seconds The window a perWindow rule's egressd_limit is per.
# TYPE egressd_limit_window_seconds gauge
egressd_limit_window_seconds{rule="window"} 60
# HELP egressd_rule_info Always 1; shape says what egressd_limit counts: concurrency, adaptive, perSecond or perWindow, as in the policy; protocols what the rule counts: tcp, udp or tcp,udp.
# TYPE egressd_rule_info gauge
egressd_rule_info{protocols="tcp",rule="adapt",shape="adaptive"} 1
egressd_rule_info{protocols="tcp",rule="conc",shape="concurrency"} 1
egressd_rule_info{protocols="tcp",rule="rate",shape="perSecond"} 1
egressd_rule_info{protocols="tcp",rule="shadow",shape="concurrency"} 1
egressd_rule_info{protocols="tcp",rule="shared-pool",shape="concurrency"} 1
egressd_rule_info{protocols="tcp",rule="shared-rate",shape="perSecond"} 1
egressd_rule_info{protocols="tcp",rule="window",shape="perWindow"} 1
`), "egressd_rule_info", "egressd_limit_window_seconds"); err != nil {
		t.Error(err)
	}
}

// TestMetricsEndpointLint runs the daemon and lints what /metrics serves.
func TestMetricsEndpointLint(t *testing.T) {
	td := newTestDaemon(t)
	writeFile(t, td.cfg.PolicyFile, everyShape)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	td.cfg.MetricsAddr = ln.Addr().String()
	ln.Close()
	td.start(t)

	resp, err := (&http.Client{Timeout: 5 * time.Second}).Get("http://" + td.cfg.MetricsAddr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /metrics: %s", resp.Status)
	}
	problems, err := promlint.New(resp.Body).Lint()
	if err != nil {
		t.Fatalf("promlint: %v", err)
	}
	for _, p := range problems {
		t.Errorf("promlint: %s: %s", p.Metric, p.Text)
	}
}

// TestPendingSharedRuleMetrics: a pending rule has no per-rule series but
// its shared budget's, which are reported whether or not the
// kernel has the rule (docs/metrics.md says so).
func TestPendingSharedRuleMetrics(t *testing.T) {
	rds := redistest.Start(t)
	td := newTestDaemon(t)
	td.apply(t, fmt.Sprintf("rules:\n  - {name: pool, destination: api.test, concurrency: 5, shared: {redis: %q, key: pool}}\n", rds.URL()))
	if p := td.table.entries["pool"].pending; p == "" {
		t.Fatal("rule pool is installed; want it pending on its host name")
	}
	tests := []struct {
		metric string
		want   int
	}{
		{"egressd_limit", 0},
		{"egressd_live_connections", 0},
		{"egressd_shared_store_up", 1},
	}
	for _, tt := range tests {
		if n := testutil.CollectAndCount(td.metrics, tt.metric); n != tt.want {
			t.Errorf("%s: %d series for a pending shared rule, want %d", tt.metric, n, tt.want)
		}
	}
}

// TestDriftOfRemovedRule: a rule removed since the last recount has no
// egressd_recount_drift series, as it has no other per-rule series; the
// rules kept keep theirs.
func TestDriftOfRemovedRule(t *testing.T) {
	td := newTestDaemon(t)
	td.apply(t, "rules:\n  - {name: gone, destination: 10.0.0.1, concurrency: 5}\n  - {name: kept, destination: 10.0.0.2, concurrency: 5}\n")
	td.recount()
	td.apply(t, "rules:\n  - {name: kept, destination: 10.0.0.2, concurrency: 5}\n")
	want := `
# HELP egressd_recount_drift How far the live sockets' states counted at the last recount fall outside what the kernel's live count and the connections opened and closed during the walk allow; a positive drift is given back by the next recount that sees it too, so nonzero for long means accounting the recount cannot repair.
# TYPE egressd_recount_drift gauge
egressd_recount_drift{rule="kept"} 0
`
	if err := testutil.CollectAndCompare(td.metrics, strings.NewReader(want), "egressd_recount_drift"); err != nil {
		t.Error(err)
	}
}

// TestPolicyLastLoadOK: egressd_policy_last_load_ok says whether the last
// load of the policy file was applied, and stays 0 after a refused reload
// for as long as the file is not fixed (a restart would refuse it), where
// the count of failed reloads only grows once.
func TestPolicyLastLoadOK(t *testing.T) {
	td := newTestDaemon(t)
	steps := []struct {
		name, file string
		want       string
	}{
		{"a good file", "rules:\n  - {name: db, destination: 10.0.0.1, concurrency: 5}\n", "1"},
		{"a broken one", "rules:\n  - {name: db, destination: 10.0.0.1}\n", "0"},
		{"still broken, reloaded again", "rules:\n  - {name: db, destination: 10.0.0.1}\n", "0"},
		{"fixed", "rules:\n  - {name: db, destination: 10.0.0.1, concurrency: 6}\n", "1"},
	}
	for _, s := range steps {
		writeFile(t, td.cfg.PolicyFile, s.file)
		td.reloadPolicy(context.Background())
		want := `
# HELP egressd_policy_last_load_ok 1 when the last load of the policy file (the start's or a reload) was applied whole; 0 when it was refused and the rules before it stay, or the run-time limits conflicted with it at start (until a run-time change puts them in force).
# TYPE egressd_policy_last_load_ok gauge
egressd_policy_last_load_ok ` + s.want + "\n"
		if err := testutil.CollectAndCompare(td.metrics, strings.NewReader(want), "egressd_policy_last_load_ok"); err != nil {
			t.Errorf("%s: %v", s.name, err)
		}
	}
}

// TestRecountGaveBack: what recounts gave back and put back adds up in
// egressd_recount_released_total (by cause) and
// egressd_recount_remarked_total, and each recount that gave slots back
// lists an event of the rule's.
func TestRecountGaveBack(t *testing.T) {
	td := newTestDaemon(t)
	td.start(t)
	td.apply(t, "rules:\n  - {name: db, destination: 10.0.0.1, concurrency: 5}\n  - {name: web, destination: 10.0.0.2, concurrency: 5}\n")
	for _, r := range []map[string]loader.Recount{
		{"db": {Freed: 1, GivenBack: 2, Remarked: 4}},
		{},
		{"db": {GivenBack: 1}, "web": {Remarked: 1}},
	} {
		td.fake.mu.Lock()
		td.fake.recounted = r
		td.fake.mu.Unlock()
		td.recount()
	}
	want := `
# HELP egressd_recount_released_total Slots the recounts gave back, by cause: freed_socket (held by a socket freed without giving it back) or drift (counted by the kernel and held by no socket at two recounts in a row).
# TYPE egressd_recount_released_total counter
egressd_recount_released_total{cause="drift",rule="db"} 3
egressd_recount_released_total{cause="drift",rule="web"} 0
egressd_recount_released_total{cause="freed_socket",rule="db"} 1
egressd_recount_released_total{cause="freed_socket",rule="web"} 0
# HELP egressd_recount_remarked_total Sockets holding a slot whose marks another program had taken off, put back by the recounts.
# TYPE egressd_recount_remarked_total counter
egressd_recount_remarked_total{rule="db"} 4
egressd_recount_remarked_total{rule="web"} 1
`
	if err := testutil.CollectAndCompare(td.metrics, strings.NewReader(want), "egressd_recount_released_total", "egressd_recount_remarked_total"); err != nil {
		t.Error(err)
	}
	var listed []control.Event
	if err := td.client().Events(context.Background(), false, func(e control.Event) error { listed = append(listed, e); return nil }); err != nil {
		t.Fatal(err)
	}
	wantEvents := []control.Event{
		{Kind: control.EventRecount, Rule: "db", Shape: "concurrency", Count: 3, Freed: 1, GivenBack: 2},
		{Kind: control.EventRecount, Rule: "db", Shape: "concurrency", Count: 1, GivenBack: 1},
	}
	for i := range listed {
		listed[i].Time = time.Time{}
	}
	if !slices.Equal(listed, wantEvents) {
		t.Errorf("events %+v, want %+v", listed, wantEvents)
	}
}

// TestPerRuleSeriesBounded: with more rules than the bound, the rules the
// policy names and then the busiest have series of their own, every rule
// is in its class's sums, and the daemon says so in the metrics and the
// log, once.
func TestPerRuleSeriesBounded(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		td := newTestDaemon(t)
		var log bytes.Buffer
		td.logTo(slog.New(slog.NewTextHandler(&log, nil)))
		td.metrics.maxRules = 2
		td.apply(t, `metrics: {rules: [keep]}
rules:
  - {name: keep, destination: 10.0.0.1, concurrency: 5}
  - {name: webhook, destination: 10.0.0.2, concurrency: 5}
  - {name: a-idle, destination: 10.0.0.3, concurrency: 5}
  - {name: b-idle, destination: 10.0.0.4, concurrency: 5}
  - {name: trial, destination: 10.0.0.5, perSecond: {permits: 5}, shadow: true}
`)
		td.fake.set("webhook", loader.Stats{Admitted: 10, Refused: 100})
		td.fake.set("trial", loader.Stats{Admitted: 50, ShadowRefused: 20})
		// The first read: counts from here; no rule has refused yet, so the
		// first by name after the named one has series of its own.
		if n := testutil.CollectAndCount(td.metrics, "egressd_live_connections"); n != 2 {
			t.Fatalf("%d egressd_live_connections series, want 2", n)
		}
		clocktest.Advance(10 * time.Second) // the bubble's clock
		td.fake.set("webhook", loader.Stats{Admitted: 12, Refused: 400})
		td.fake.set("trial", loader.Stats{Admitted: 53, ShadowRefused: 21})
		want := `
# HELP egressd_class_leases_total Connections and UDP flows the class's rules were asked for, by outcome (as egressd_leases_total), since the daemon started.
# TYPE egressd_class_leases_total counter
egressd_class_leases_total{outcome="acquired",scope="host",shadow="false",shape="concurrency",shared="false"} 2
egressd_class_leases_total{outcome="acquired",scope="host",shadow="true",shape="perSecond",shared="false"} 3
egressd_class_leases_total{outcome="denied",scope="host",shadow="false",shape="concurrency",shared="false"} 300
egressd_class_leases_total{outcome="denied",scope="host",shadow="true",shape="perSecond",shared="false"} 0
egressd_class_leases_total{outcome="shadow_denied",scope="host",shadow="false",shape="concurrency",shared="false"} 0
egressd_class_leases_total{outcome="shadow_denied",scope="host",shadow="true",shape="perSecond",shared="false"} 1
# HELP egressd_class_rules Rules of the class, by state: installed in the kernel or pending.
# TYPE egressd_class_rules gauge
egressd_class_rules{scope="host",shadow="false",shape="concurrency",shared="false",state="installed"} 4
egressd_class_rules{scope="host",shadow="false",shape="concurrency",shared="false",state="pending"} 0
egressd_class_rules{scope="host",shadow="true",shape="perSecond",shared="false",state="installed"} 1
egressd_class_rules{scope="host",shadow="true",shape="perSecond",shared="false",state="pending"} 0
# HELP egressd_live_connections Connections and UDP flows holding a slot of the rule now.
# TYPE egressd_live_connections gauge
egressd_live_connections{rule="webhook"} 0
egressd_live_connections{rule="keep"} 0
# HELP egressd_per_rule_series_max_rules The most rules the metrics serve series of their own for (egressd run --metrics-rules); every rule is in the egressd_class_* sums.
# TYPE egressd_per_rule_series_max_rules gauge
egressd_per_rule_series_max_rules 2
# HELP egressd_per_rule_series_rules Rules with series of their own in this scrape, by why: all (there are no more rules than the bound), named (by the policy's metrics.rules), trouble (drift at the last recount, or a shared budget's Redis out of reach) or busiest (refusals a second lately, then live connections).
# TYPE egressd_per_rule_series_rules gauge
egressd_per_rule_series_rules{reason="all"} 0
egressd_per_rule_series_rules{reason="busiest"} 1
egressd_per_rule_series_rules{reason="named"} 1
egressd_per_rule_series_rules{reason="trouble"} 0
`
		families := []string{"egressd_class_leases_total", "egressd_class_rules", "egressd_live_connections", "egressd_per_rule_series_max_rules", "egressd_per_rule_series_rules"}
		if err := testutil.CollectAndCompare(td.metrics, strings.NewReader(want), families...); err != nil {
			t.Error(err)
		}
		if n := strings.Count(log.String(), "more rules than --metrics-rules"); n != 1 {
			t.Errorf("the log says %d times that rules are left out, want once:\n%s", n, log.String())
		}
		// Back under the bound: every rule's series, and the log says so.
		td.apply(t, "rules:\n  - {name: keep, destination: 10.0.0.1, concurrency: 5}\n")
		if n := testutil.CollectAndCount(td.metrics, "egressd_live_connections"); n != 1 {
			t.Errorf("%d egressd_live_connections series for one rule", n)
		}
		if !strings.Contains(log.String(), "every rule has series of its own again") {
			t.Errorf("the log does not say every rule has its series again:\n%s", log.String())
		}
	})
}

// TestMetricsGzip: the metrics are gzipped when the scraper takes gzip
// and only then, the same text either way, and an error goes as text.
func TestMetricsGzip(t *testing.T) {
	reg := prometheus.NewRegistry()
	reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "egressd_test", Help: "A test."}, func() float64 { return 1 }))
	serve := func(g prometheus.Gatherer, accept string) *httptest.ResponseRecorder {
		w := httptest.NewRecorder()
		r := httptest.NewRequest("GET", "/metrics", nil)
		if accept != "" {
			r.Header.Set("Accept-Encoding", accept)
		}
		metricsHandler(g).ServeHTTP(w, r)
		return w
	}
	want := serve(reg, "").Body.String()
	if !strings.Contains(want, "egressd_test 1") {
		t.Fatalf("plain answer %q", want)
	}
	for _, tt := range []struct {
		accept string
		gzip   bool
	}{
		{"", false},
		{"gzip", true},
		{"deflate, gzip;q=0.5", true},
		{"gzip;q=0", false},
		{"identity", false},
		{"x-gzip", false},
	} {
		w := serve(reg, tt.accept)
		body := w.Body.String()
		if enc := w.Header().Get("Content-Encoding"); (enc == "gzip") != tt.gzip {
			t.Errorf("Accept-Encoding %q: Content-Encoding %q, want gzip %v", tt.accept, enc, tt.gzip)
			continue
		}
		if tt.gzip {
			z, err := gzip.NewReader(w.Body)
			if err != nil {
				t.Fatal(err)
			}
			b, err := io.ReadAll(z)
			if err != nil {
				t.Fatal(err)
			}
			body = string(b)
		}
		if body != want {
			t.Errorf("Accept-Encoding %q: body %q, want %q", tt.accept, body, want)
		}
	}
	failing := prometheus.NewRegistry()
	failing.MustRegister(failingCollector{})
	w := serve(failing, "gzip")
	if w.Code != http.StatusInternalServerError || w.Header().Get("Content-Encoding") != "" || !strings.Contains(w.Body.String(), "maps unreadable") {
		t.Errorf("error: %d, Content-Encoding %q, body %q; want a 500 in text", w.Code, w.Header().Get("Content-Encoding"), w.Body.String())
	}
}

// failingCollector's every scrape fails.
type failingCollector struct{}

var failingDesc = prometheus.NewDesc("egressd_test_failing", "Never read.", nil, nil)

func (failingCollector) Describe(ch chan<- *prometheus.Desc) { ch <- failingDesc }

func (failingCollector) Collect(ch chan<- prometheus.Metric) {
	ch <- prometheus.NewInvalidMetric(failingDesc, errors.New("maps unreadable"))
}
