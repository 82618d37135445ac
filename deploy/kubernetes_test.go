package deploy

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/egressd/egressd/internal/k8stest"
)

// The EgressLimit CRD installs on a real API server, which then refuses
// at admission what its schema can say is wrong, each with the schema's
// message, and takes a good object.
func TestEgressLimitCRD(t *testing.T) {
	s := k8stest.Start(t)
	if out, err := s.Kubectl("apply", "--server-side", "-f", "kubernetes/crd.yaml"); err != nil {
		t.Fatalf("apply the CRD: %v\n%s", err, out)
	}
	if out, err := s.Kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/egresslimits.egressd.io"); err != nil {
		t.Fatalf("CRD not established: %v\n%s", err, out)
	}
	dir := t.TempDir()
	apply := func(name, spec string) (string, error) {
		obj := "apiVersion: egressd.io/v1alpha1\nkind: EgressLimit\nmetadata: {name: " + name + ", namespace: default}\nspec:\n" + spec
		f := filepath.Join(dir, name+".yaml")
		if err := os.WriteFile(f, []byte(obj), 0o644); err != nil {
			t.Fatal(err)
		}
		// The API server is to refuse them, with its own words: kubectl
		// 1.20 (Debian 12's kubernetes-client) first checks an object
		// against the schema itself, and would refuse some in words of
		// its own.
		return s.Kubectl("apply", "--validate=false", "-f", f)
	}
	for _, bad := range []struct{ name, spec, says string }{
		{"two-shapes", "  podSelector: {}\n  destination: 10.0.0.1\n  concurrency: 5\n  perSecond: {permits: 5}\n", "exactly one of concurrency, perSecond, perWindow and adaptive"},
		{"no-shape", "  podSelector: {}\n  destination: 10.0.0.1\n", "exactly one of concurrency"},
		{"udp-adaptive", "  podSelector: {}\n  destination: 10.0.0.1\n  protocols: [udp]\n  adaptive: {maximum: 50}\n", "adaptive limits take TCP only"},
		{"idle-tcp", "  podSelector: {}\n  destination: 10.0.0.1\n  udpIdle: 30s\n  concurrency: 5\n", "udpIdle only with udp"},
		{"sctp", "  podSelector: {}\n  destination: 10.0.0.1\n  protocols: [sctp]\n  concurrency: 5\n", "Unsupported value: \"sctp\""},
		{"port-zero", "  podSelector: {}\n  destination: 10.0.0.1\n  port: 0\n  concurrency: 5\n", "spec.port"},
		{"no-selector", "  destination: 10.0.0.1\n  concurrency: 5\n", "spec.podSelector: Required value"},
	} {
		out, err := apply(bad.name, bad.spec)
		if err == nil || !strings.Contains(out, bad.says) {
			t.Errorf("%s: kubectl apply: %v\n%s\nwant it refused, saying %q", bad.name, err, out, bad.says)
		}
	}
	if out, err := apply("payments", "  podSelector: {matchLabels: {app: checkout}}\n  destination: 10.0.0.1\n  port: 443\n  protocols: [tcp, udp]\n  concurrency: 50\n"); err != nil {
		t.Fatalf("a good limit refused: %v\n%s", err, out)
	}
	out, err := s.Kubectl("get", "egl", "-n", "default")
	if err != nil || !strings.Contains(out, "payments") || !strings.Contains(out, "10.0.0.1") {
		t.Fatalf("kubectl get egl: %v\n%s", err, out)
	}
}
