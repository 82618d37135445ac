package daemon

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/prometheus/client_golang/prometheus/testutil/promlint"
	"github.com/redis/go-redis/v9"

	"github.com/egressd/egressd/internal/docstest"
	"github.com/egressd/egressd/internal/privtest"
	"github.com/egressd/egressd/internal/redistest"
	"github.com/egressd/egressd/pkg/loader"
	"github.com/egressd/egressd/pkg/policy"
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

// newTestDaemon builds a Daemon as Run does, with a real datapath on a
// cgroup and pins of the test's own, and applies policy text.
func newTestDaemon(t *testing.T, text string) *Daemon {
	t.Helper()
	privtest.RequireRoot(t)
	cg := privtest.Cgroup(t, "metrics")
	pins := privtest.PinDir(t)
	cfg := (&Config{Cgroup: cg, PinDir: pins, StateDir: t.TempDir(), Version: "test", Logger: slog.New(slog.DiscardHandler)}).withDefaults()
	d := &Daemon{cfg: cfg, log: cfg.Logger, started: time.Now(), entries: map[string]*entry{}, redis: map[string]redis.UniversalClient{}, stop: make(chan struct{})}
	d.events = newEventLog()
	d.metrics = newMetrics(d)
	dp, err := loader.Open(&loader.Config{Cgroup: cg, PinDir: pins})
	if err != nil {
		t.Fatalf("datapath: %v", err)
	}
	d.dp = dp
	t.Cleanup(func() {
		if err := dp.Uninstall(); err != nil {
			t.Errorf("uninstall: %v", err)
		}
	})
	p, err := policy.Parse([]byte(text))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.endShares(true) })
	if err := d.install(context.Background(), p); err != nil {
		t.Fatalf("install: %v", err)
	}
	return d
}

// TestMetricsLint lints the daemon's collector with every family present,
// on a pedantic registry that also checks samples against descriptions.
func TestMetricsLint(t *testing.T) {
	rds := redistest.Start(t)
	d := newTestDaemon(t, everyShape+fmt.Sprintf(`  - name: shared-pool
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
	ctrl := d.entries["adapt"].ctrl
	for range 20 {
		ctrl.Sample(time.Now(), 5*time.Millisecond)
	}
	if _, ok := ctrl.Baseline(); !ok {
		t.Fatal("adaptive rule has no baseline after 20 samples")
	}
	d.metrics.recount()

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
		"egressd_connect_failures_total",
		"egressd_connect_latency_seconds",
		"egressd_events_lost_total",
		"egressd_in_flight_requests",
		"egressd_leases_total",
		"egressd_limit",
		"egressd_live_connections",
		"egressd_policy_reloads_total",
		"egressd_recount_drift",
		"egressd_request_latency_seconds",
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
}

// TestMetricsEndpointLint runs the daemon and lints what /metrics serves.
func TestMetricsEndpointLint(t *testing.T) {
	privtest.RequireRoot(t)
	cg := privtest.Cgroup(t, "metrics-run")
	pins := privtest.PinDir(t)
	dir := t.TempDir()
	pol := filepath.Join(dir, "policy.yaml")
	if err := os.WriteFile(pol, []byte(everyShape), 0o644); err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- Run(ctx, Config{
			PolicyFile: pol, Cgroup: cg, PinDir: pins, Socket: filepath.Join(dir, "sock"), MetricsAddr: addr,
			StateDir: filepath.Join(dir, "state"), DetachOnExit: true, Version: "test",
			Logger: slog.New(slog.DiscardHandler),
		})
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("run: %v", err)
		}
	})

	// Scrape as soon as the daemon serves.
	hc := &http.Client{Timeout: 5 * time.Second}
	var resp *http.Response
	for deadline := time.Now().Add(10 * time.Second); ; {
		if resp, err = hc.Get("http://" + addr + "/metrics"); err == nil {
			break
		}
		select {
		case err := <-done:
			done <- err
			t.Fatalf("run: %v", err)
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("GET /metrics: %v", err)
		}
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
