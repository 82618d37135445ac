package deploy

import (
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"

	"github.com/egressd/egressd/internal/daemon"
	"github.com/egressd/egressd/internal/k8stest"
	"github.com/egressd/egressd/internal/kube"
	"github.com/egressd/egressd/pkg/control"
	"github.com/egressd/egressd/pkg/loader"
	"github.com/egressd/egressd/pkg/policy"
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

// The kubelet's reading of $(VAR) in a command line: references
// expanded, $$ escaped, a $ that begins none kept.
func TestExpand(t *testing.T) {
	vars := map[string]string{"A": "a", "EMPTY": "", "B": "$(A)"}
	lookup := func(name string) (string, error) {
		v, ok := vars[name]
		if !ok {
			return "", fmt.Errorf("no %s", name)
		}
		return v, nil
	}
	for _, tt := range []struct{ in, want string }{
		{"plain", "plain"},
		{"$(A)", "a"},
		{"x$(A)y$(A)", "xaya"},
		{"$(EMPTY)", ""},
		{"$(B)", "$(A)"}, // a value is not expanded again
		{"$$(A)", "$(A)"},
		{"$$", "$"},
		{"$$$(A)", "$a"},
		{"a$", "a$"},
		{"$x", "$x"},
		{"$(A", "$(A"},
		{"$(A $$", "$(A $"},
	} {
		got, err := expand(tt.in, lookup)
		if err != nil || got != tt.want {
			t.Errorf("expand(%q) = %q, %v; want %q", tt.in, got, err, tt.want)
		}
	}
	for _, in := range []string{"$(C)", "$(A)$(C)", "$()"} {
		if got, err := expand(in, lookup); err == nil {
			t.Errorf("expand(%q) = %q, want an error for the unknown variable", in, got)
		}
	}
}

// A command line may name only the container's env vars, each given a
// value.
func TestContainerCommandExpand(t *testing.T) {
	c := containerCommand{argv: []string{"egressd", "--kube-node", "$(NODE_NAME)"}, env: []string{"NODE_NAME", "UNUSED"}}
	got, err := c.expand(map[string]string{"NODE_NAME": "node-a"})
	if want := []string{"egressd", "--kube-node", "node-a"}; err != nil || !slices.Equal(got, want) {
		t.Errorf("expand = %q, %v; want %q", got, err, want)
	}
	for _, tt := range []struct {
		c    containerCommand
		says string
	}{
		{containerCommand{argv: []string{"egressd", "$(NODE_NAME)"}, env: []string{"NODE_NAME"}}, "$(NODE_NAME): no value given"},
		{containerCommand{argv: []string{"egressd", "$(NODE)"}, env: []string{"NODE_NAME"}}, "$(NODE) is not an env var"},
	} {
		_, err := tt.c.expand(map[string]string{"NODE": "node-a"})
		if err == nil || !strings.Contains(err.Error(), tt.says) {
			t.Errorf("%q: err %v, want one saying %q", tt.c.argv, err, tt.says)
		}
	}
}

// The DaemonSet runs `egressd run` with the daemon's default paths, those
// the unit's daemon takes: the CLI on the node (`egressd status`,
// `egressd uninstall`) reaches the pod's daemon without flags. The node's
// settings come from the environment.
func TestDaemonSetArgs(t *testing.T) {
	argv, err := DaemonSetArgs(map[string]string{"NODE_NAME": "node-a", "CGROUP_DRIVER": "cgroupfs", "CGROUP_ROOT": "/kubelet"})
	if err != nil {
		t.Fatal(err)
	}
	if len(argv) < 2 || argv[0] != "egressd" || argv[1] != "run" || len(argv)%2 != 0 {
		t.Fatalf("command line %q, want egressd run and flags with their values", argv)
	}
	flags := map[string]string{}
	for i := 2; i < len(argv); i += 2 {
		flags[argv[i]] = argv[i+1]
	}
	want := map[string]string{
		"--policy":             daemon.DefaultPolicyFile,
		"--state-dir":          daemon.DefaultStateDir,
		"--socket":             control.DefaultSocket,
		"--bpffs":              loader.DefaultPinDir,
		"--metrics":            ":9090",
		"--kube-node":          "node-a",
		"--kube-cgroup-driver": "cgroupfs",
		"--kube-cgroup-root":   "/kubelet",
	}
	if !maps.Equal(flags, want) {
		t.Errorf("flags %q, want %q", flags, want)
	}
	if _, err := DaemonSetArgs(map[string]string{"NODE_NAME": "node-a", "CGROUP_DRIVER": "systemd"}); err == nil || !strings.Contains(err.Error(), "CGROUP_ROOT") {
		t.Errorf("without CGROUP_ROOT: err %v, want one naming it", err)
	}
}

// The ConfigMap's settings are ones the daemon takes: a policy file that
// loads, a cgroup driver and root that name pods' cgroups.
func TestConfigMapSettings(t *testing.T) {
	var cm struct {
		Kind string            `yaml:"kind"`
		Data map[string]string `yaml:"data"`
	}
	b, err := os.ReadFile("kubernetes/20-config.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(b, &cm); err != nil || cm.Kind != "ConfigMap" {
		t.Fatalf("20-config.yaml: kind %q, %v", cm.Kind, err)
	}
	p, err := policy.Parse([]byte(cm.Data["policy.yaml"]))
	if err != nil || len(p.Rules) != 0 {
		t.Errorf("policy.yaml: %v; want a policy of no rules", err)
	}
	if _, err := kube.PodCgroup(kube.Driver(cm.Data["cgroup-driver"]), cm.Data["cgroup-root"], kube.Burstable, "0f3c5a51-5ac8-4e5c-9f26-4d8c1f3b2a10"); err != nil {
		t.Errorf("cgroup-driver %q, cgroup-root %q: %v", cm.Data["cgroup-driver"], cm.Data["cgroup-root"], err)
	}
}
