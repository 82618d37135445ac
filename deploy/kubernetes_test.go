package deploy

import (
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
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
		"--metrics":            ":9464",
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

// Every manifest in kubernetes/ is applied to a real API server, in the
// order `kubectl apply -f kubernetes/` takes them, first as a server-side
// dry run and then for real. What the server then holds runs the daemon
// as the unit does, on the host paths the node's CLI uses, with the
// unit's three capabilities and no more; a pod made from it is admitted;
// and the service account may do what the daemon does and nothing else.
func TestManifests(t *testing.T) {
	s := k8stest.Start(t)
	files, err := filepath.Glob("kubernetes/*.yaml") // sorted, as kubectl walks a directory
	if err != nil || len(files) == 0 {
		t.Fatalf("manifests: %v %v", files, err)
	}
	for _, f := range files {
		// kubectl 1.20 (Debian 12's kubernetes-client) has server-side
		// apply, as beta, and takes --dry-run=server with it.
		if out, err := s.Kubectl("apply", "--server-side", "--dry-run=server", "-f", f); err != nil {
			t.Fatalf("dry run of %s: %v\n%s", f, err, out)
		}
		if out, err := s.Kubectl("apply", "--server-side", "-f", f); err != nil {
			t.Fatalf("apply %s: %v\n%s", f, err, out)
		}
	}
	if out, err := s.Kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/egresslimits.egressd.io"); err != nil {
		t.Fatalf("CRD not established: %v\n%s", err, out)
	}
	raw := getJSON(t, s, "daemonset", "-n", "egressd", "egressd")
	t.Run("daemonset", func(t *testing.T) { checkDaemonSet(t, s, raw) })
	t.Run("pod", func(t *testing.T) { checkPodAdmitted(t, s, raw) })
	t.Run("rbac", func(t *testing.T) { checkRBAC(t, s) })
}

// getJSON returns an object the server holds.
func getJSON(t *testing.T, s *k8stest.Server, args ...string) []byte {
	t.Helper()
	out, err := s.Kubectl(append([]string{"get", "-o", "json"}, args...)...)
	if err != nil || !json.Valid([]byte(out)) {
		t.Fatalf("kubectl get %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return []byte(out)
}

// daemonSet is what the tests read of a DaemonSet.
type daemonSet struct {
	Spec struct {
		UpdateStrategy struct {
			Type          string
			RollingUpdate struct{ MaxUnavailable, MaxSurge int }
		}
		Template struct {
			Metadata struct{ Annotations map[string]string }
			Spec     struct {
				ServiceAccountName string
				HostNetwork        bool
				DNSPolicy          string
				PriorityClassName  string
				Tolerations        []struct{ Key, Operator, Effect string }
				Containers         []container
				Volumes            []volume
			}
		}
	}
}

type container struct {
	Name    string
	Command []string
	Args    []string
	Env     []struct {
		Name      string
		ValueFrom struct {
			FieldRef        *struct{ FieldPath string }
			ConfigMapKeyRef *struct{ Name, Key string }
		}
	}
	Ports []struct {
		Name          string
		ContainerPort int
	}
	SecurityContext struct {
		RunAsUser                *int64
		Privileged               *bool
		AllowPrivilegeEscalation *bool
		ReadOnlyRootFilesystem   *bool
		Capabilities             struct{ Add, Drop []string }
	}
	VolumeMounts []struct {
		Name, MountPath, MountPropagation string
		ReadOnly                          bool
	}
	StartupProbe, ReadinessProbe, LivenessProbe struct {
		Exec struct{ Command []string }
	}
}

type volume struct {
	Name      string
	HostPath  *struct{ Path, Type string }
	ConfigMap *struct {
		Name  string
		Items []struct{ Key, Path string }
	}
}

// mount is where a path the daemon uses comes from.
type mount struct {
	MountPath, Propagation string
	ReadOnly               bool
	HostPath, HostType     string
	ConfigMap, Key         string
}

// mountOf finds the volume mount that holds path in c, the deepest.
func mountOf(c container, volumes []volume, path string) mount {
	var m mount
	for _, vm := range c.VolumeMounts {
		if !strings.HasPrefix(path+"/", vm.MountPath+"/") || len(vm.MountPath) <= len(m.MountPath) {
			continue
		}
		m = mount{MountPath: vm.MountPath, Propagation: vm.MountPropagation, ReadOnly: vm.ReadOnly}
		for _, v := range volumes {
			switch {
			case v.Name != vm.Name:
			case v.HostPath != nil:
				m.HostPath, m.HostType = v.HostPath.Path, v.HostPath.Type
			case v.ConfigMap != nil:
				m.ConfigMap = v.ConfigMap.Name
				for _, item := range v.ConfigMap.Items {
					if filepath.Join(vm.MountPath, item.Path) == path {
						m.Key = item.Key
					}
				}
			}
		}
	}
	return m
}

func checkDaemonSet(t *testing.T, s *k8stest.Server, raw []byte) {
	var ds daemonSet
	if err := json.Unmarshal(raw, &ds); err != nil {
		t.Fatal(err)
	}
	pod := ds.Spec.Template.Spec
	if len(pod.Containers) != 1 || pod.Containers[0].Name != daemonSetContainer {
		t.Fatalf("containers %+v, want one, %q", pod.Containers, daemonSetContainer)
	}
	c := pod.Containers[0]

	// The server keeps the command line DaemonSetArgs reads.
	refs := map[string]string{}
	for _, e := range c.Env {
		refs[e.Name] = "$(" + e.Name + ")"
	}
	argv, err := DaemonSetArgs(refs)
	if err != nil || !slices.Equal(argv, append(slices.Clone(c.Command), c.Args...)) {
		t.Errorf("the server's command line %q %q, DaemonSetArgs' %q (%v)", c.Command, c.Args, argv, err)
	}
	flags := map[string]string{}
	for i := 1; i+1 < len(c.Args); i += 2 {
		flags[c.Args[i]] = c.Args[i+1]
	}

	// The node's settings: its name, and the ConfigMap's.
	env := map[string]string{}
	for _, e := range c.Env {
		switch v := e.ValueFrom; {
		case v.FieldRef != nil:
			env[e.Name] = "field " + v.FieldRef.FieldPath
		case v.ConfigMapKeyRef != nil:
			env[e.Name] = "configmap " + v.ConfigMapKeyRef.Name + " " + v.ConfigMapKeyRef.Key
		}
	}
	wantEnv := map[string]string{
		"NODE_NAME":     "field spec.nodeName",
		"CGROUP_DRIVER": "configmap egressd cgroup-driver",
		"CGROUP_ROOT":   "configmap egressd cgroup-root",
	}
	if !maps.Equal(env, wantEnv) || len(c.Env) != len(wantEnv) {
		t.Errorf("env %q, want %q", env, wantEnv)
	}
	var cm struct{ Data map[string]string }
	if err := json.Unmarshal(getJSON(t, s, "configmap", "-n", "egressd", "egressd"), &cm); err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{"cgroup-driver", "cgroup-root", "policy.yaml"} {
		if _, ok := cm.Data[key]; !ok {
			t.Errorf("the ConfigMap has no %s", key)
		}
	}

	// The unit's capabilities, and only them.
	unit, err := os.ReadFile("../systemd/egressd.service")
	if err != nil {
		t.Fatal(err)
	}
	var unitCaps []string
	for line := range strings.Lines(string(unit)) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "CapabilityBoundingSet="); ok {
			for _, name := range strings.Fields(v) {
				unitCaps = append(unitCaps, strings.TrimPrefix(name, "CAP_"))
			}
		}
	}
	sc := c.SecurityContext
	if add := slices.Sorted(slices.Values(sc.Capabilities.Add)); len(unitCaps) == 0 || !slices.Equal(add, slices.Sorted(slices.Values(unitCaps))) {
		t.Errorf("capabilities added %q, want the unit's %q", sc.Capabilities.Add, unitCaps)
	}
	if !slices.Equal(sc.Capabilities.Drop, []string{"ALL"}) {
		t.Errorf("capabilities dropped %q, want ALL", sc.Capabilities.Drop)
	}
	is := func(b *bool, want bool) bool { return b != nil && *b == want }
	if !is(sc.Privileged, false) || !is(sc.AllowPrivilegeEscalation, false) || !is(sc.ReadOnlyRootFilesystem, true) {
		t.Errorf("securityContext privileged %v, allowPrivilegeEscalation %v, readOnlyRootFilesystem %v; want false, false, true",
			sc.Privileged, sc.AllowPrivilegeEscalation, sc.ReadOnlyRootFilesystem)
	}
	if sc.RunAsUser == nil || *sc.RunAsUser != 0 {
		t.Error("securityContext.runAsUser is not 0: the host paths are root's")
	}

	// Each path of the command line is the host's, at the same path,
	// where the CLI on the node finds it; the pins' bpffs shows through
	// a mount the host makes later. Nothing else of the host's is
	// writable.
	writable := map[string]bool{}
	for _, tt := range []struct {
		path string
		want mount
	}{
		{flags["--bpffs"], mount{MountPath: "/sys/fs/bpf", Propagation: "HostToContainer", HostPath: "/sys/fs/bpf", HostType: "Directory"}},
		{flags["--socket"], mount{MountPath: "/run/egressd", HostPath: "/run/egressd", HostType: "DirectoryOrCreate"}},
		{flags["--state-dir"], mount{MountPath: "/var/lib/egressd", HostPath: "/var/lib/egressd", HostType: "DirectoryOrCreate"}},
		{"/sys/fs/cgroup/kubepods.slice", mount{MountPath: "/sys/fs/cgroup", ReadOnly: true, HostPath: "/sys/fs/cgroup", HostType: "Directory"}},
		{flags["--policy"], mount{MountPath: "/etc/egressd", ReadOnly: true, ConfigMap: "egressd", Key: "policy.yaml"}},
	} {
		if got := mountOf(c, pod.Volumes, tt.path); got != tt.want {
			t.Errorf("%q is on %+v, want %+v", tt.path, got, tt.want)
		}
		writable[tt.want.MountPath] = !tt.want.ReadOnly
	}
	for _, vm := range c.VolumeMounts {
		if !vm.ReadOnly && !writable[vm.MountPath] {
			t.Errorf("%s is mounted writable, and the daemon writes nothing there", vm.MountPath)
		}
	}

	// On every node, in the host's network, before other pods.
	if pod.ServiceAccountName != "egressd" || !pod.HostNetwork || pod.DNSPolicy != "ClusterFirstWithHostNet" || pod.PriorityClassName != "system-node-critical" {
		t.Errorf("pod spec: serviceAccountName %q, hostNetwork %v, dnsPolicy %q, priorityClassName %q",
			pod.ServiceAccountName, pod.HostNetwork, pod.DNSPolicy, pod.PriorityClassName)
	}
	if !slices.Contains(pod.Tolerations, struct{ Key, Operator, Effect string }{Operator: "Exists"}) {
		t.Errorf("tolerations %+v: none tolerates every taint", pod.Tolerations)
	}
	if u := ds.Spec.UpdateStrategy; u.Type != "RollingUpdate" || u.RollingUpdate.MaxUnavailable != 1 || u.RollingUpdate.MaxSurge != 0 {
		t.Errorf("updateStrategy %+v, want RollingUpdate, one node at a time, no surge", u)
	}

	// Prometheus finds the port the daemon serves metrics on.
	_, port, _ := strings.Cut(flags["--metrics"], ":")
	ann := ds.Spec.Template.Metadata.Annotations
	if i := slices.IndexFunc(c.Ports, func(p struct {
		Name          string
		ContainerPort int
	}) bool {
		return p.Name == "metrics" && strconv.Itoa(p.ContainerPort) == port
	}); i < 0 || ann["prometheus.io/scrape"] != "true" || ann["prometheus.io/port"] != port {
		t.Errorf("--metrics %q; ports %+v, annotations %q", flags["--metrics"], c.Ports, ann)
	}

	// The probes ask the daemon on its socket.
	for name, probe := range map[string][]string{"startup": c.StartupProbe.Exec.Command, "readiness": c.ReadinessProbe.Exec.Command, "liveness": c.LivenessProbe.Exec.Command} {
		i := slices.Index(probe, "--socket")
		if i < 0 || i+1 == len(probe) || probe[i+1] != flags["--socket"] || probe[len(probe)-1] != "status" {
			t.Errorf("%s probe %q, want `egressd --socket %s ... status`", name, probe, flags["--socket"])
		}
	}
}

// checkPodAdmitted: a pod of the DaemonSet's template, on a node, passes
// the admission a pod gets and a DaemonSet does not: its service account
// and priority class must exist, and the namespace's Pod Security level
// must admit it.
func checkPodAdmitted(t *testing.T, s *k8stest.Server, raw []byte) {
	var ds struct {
		Spec struct{ Template struct{ Spec map[string]any } }
	}
	if err := json.Unmarshal(raw, &ds); err != nil {
		t.Fatal(err)
	}
	spec := ds.Spec.Template.Spec
	spec["nodeName"] = "node-a"
	pod, err := json.Marshal(map[string]any{
		"apiVersion": "v1",
		"kind":       "Pod",
		"metadata":   map[string]any{"name": "egressd-node-a", "namespace": "egressd"},
		"spec":       spec,
	})
	if err != nil {
		t.Fatal(err)
	}
	f := filepath.Join(t.TempDir(), "pod.json")
	if err := os.WriteFile(f, pod, 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := s.Kubectl("create", "--dry-run=server", "-f", f); err != nil {
		t.Errorf("a pod of the DaemonSet refused: %v\n%s", err, out)
	}
}

// checkRBAC: the service account may read pods and limits everywhere and
// write events, and nothing else: what it may do beyond any service
// account is exactly that.
func checkRBAC(t *testing.T, s *k8stest.Server) {
	const sa = "system:serviceaccount:egressd:egressd"
	canI := func(query string) string {
		out, _ := s.Kubectl(append([]string{"auth", "can-i", "--as=" + sa}, strings.Fields(query)...)...)
		lines := strings.Fields(out)
		if len(lines) == 0 {
			return out
		}
		return lines[len(lines)-1]
	}
	for _, tt := range []struct{ query, want string }{
		{"list pods -A", "yes"},
		{"watch pods -A", "yes"},
		{"get pods -n kube-system", "yes"},
		{"list egresslimits.egressd.io -A", "yes"},
		{"watch egresslimits.egressd.io -A", "yes"},
		{"create events -n default", "yes"},
		{"patch events -n kube-system", "yes"},
		{"get secrets -A", "no"},
		{"get configmaps -n egressd", "no"},
		{"create pods -n egressd", "no"},
		{"update pods -n default", "no"},
		{"delete pods -n default", "no"},
		{"create pods --subresource=exec -n default", "no"},
		{"update egresslimits.egressd.io -n default", "no"},
		{"delete egresslimits.egressd.io -n default", "no"},
		{"update egresslimits.egressd.io --subresource=status -n default", "no"},
		{"update events -n default", "no"},
		{"delete events -n default", "no"},
		{"create events.events.k8s.io -n default", "no"},
		{"list nodes", "no"},
	} {
		if got := canI(tt.query); got != tt.want {
			t.Errorf("can %s %s? %q, want %q", sa, tt.query, got, tt.want)
		}
	}

	// `auth can-i --list` of another service account is what every one
	// may do (discovery, reviews of itself); the rest is the manifests'.
	rules := func(user, ns string) map[string]bool {
		out, err := s.Kubectl("auth", "can-i", "--list", "--as="+user, "-n", ns)
		if err != nil {
			t.Fatalf("can-i --list as %s: %v\n%s", user, err, out)
		}
		set := map[string]bool{}
		for line := range strings.Lines(out) {
			set[strings.Join(strings.Fields(line), " ")] = true
		}
		return set
	}
	want := []string{
		"egresslimits.egressd.io [] [] [get list watch]",
		"events [] [] [create patch]",
		"pods [] [] [get list watch]",
	}
	for _, ns := range []string{"egressd", "default"} {
		others := rules("system:serviceaccount:default:someone-else", ns)
		var extra []string
		for rule := range rules(sa, ns) {
			if !others[rule] {
				extra = append(extra, rule)
			}
		}
		if slices.Sort(extra); !slices.Equal(extra, want) {
			t.Errorf("in namespace %s, the service account may, beyond any other:\n%s\nwant:\n%s", ns, strings.Join(extra, "\n"), strings.Join(want, "\n"))
		}
	}
}
