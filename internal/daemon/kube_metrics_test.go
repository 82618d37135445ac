package daemon

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/egressd/egressd/internal/docstest"
	"github.com/egressd/egressd/internal/kube"
)

// The Kubernetes gauges pass promlint, register on a pedantic registry,
// and each is in docs/metrics.md. A source that has not run yet reads
// as not connected.
func TestKubeMetrics(t *testing.T) {
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(kubeconfig, []byte(`apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: c, context: {cluster: c, user: u}}]
current-context: c
`), 0o600); err != nil {
		t.Fatal(err)
	}
	src, err := kube.New(kube.Config{Node: "n", Kubeconfig: kubeconfig, Layout: kube.Layout{Driver: kube.Systemd}})
	if err != nil {
		t.Fatal(err)
	}
	m := newKubeMetrics(src)
	problems, err := testutil.CollectAndLint(m)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Errorf("promlint: %s: %s", p.Metric, p.Text)
	}
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(m)
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, f := range fams {
		if f.GetName() == "egressd_kube_connected" {
			found = true
			if v := f.GetMetric()[0].GetGauge().GetValue(); v != 0 {
				t.Errorf("egressd_kube_connected %v before the source ran, want 0", v)
			}
		}
	}
	if !found {
		t.Error("no egressd_kube_connected")
	}
	docstest.Mentions(t, "../../docs/metrics.md", docstest.Families(t, m)...)
}
