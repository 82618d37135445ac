package tests

import (
	"context"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/egressd/egressd/deploy"
	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/internal/k8stest"
	"github.com/egressd/egressd/internal/kube"
	"github.com/egressd/egressd/internal/privtest"
	"github.com/egressd/egressd/pkg/cgroups"
	"github.com/egressd/egressd/pkg/control"
)

// cluster is a real API server with the EgressLimit CRD, and clients of it.
type cluster struct {
	*k8stest.Server
	client kubernetes.Interface
	limits dynamic.NamespaceableResourceInterface
}

func startCluster(t testing.TB) *cluster {
	t.Helper()
	s := k8stest.Start(t)
	if out, err := s.Kubectl("apply", "--server-side", "-f", "../deploy/kubernetes/crd.yaml"); err != nil {
		t.Fatalf("apply the CRD: %v\n%s", err, out)
	}
	if out, err := s.Kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/egresslimits.egressd.io"); err != nil {
		t.Fatalf("CRD established: %v\n%s", err, out)
	}
	rc, err := clientcmd.BuildConfigFromFlags("", s.Kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	c := &cluster{Server: s}
	if c.client, err = kubernetes.NewForConfig(rc); err != nil {
		t.Fatal(err)
	}
	dyn, err := dynamic.NewForConfig(rc)
	if err != nil {
		t.Fatal(err)
	}
	c.limits = dyn.Resource(kube.Resource)
	return c
}

// namespace makes a namespace and its default service account, which the
// API server's admission wants of every pod (no controller manager runs
// here to make it).
func (c *cluster) namespace(t testing.TB, name string) {
	t.Helper()
	ctx := context.Background()
	if _, err := c.client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.client.CoreV1().ServiceAccounts(name).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// pod makes a pod bound to node, of QoS class qos by its resources.
func (c *cluster) pod(t testing.TB, ns, name, node string, labels map[string]string, qos corev1.PodQOSClass) *corev1.Pod {
	t.Helper()
	res := corev1.ResourceRequirements{}
	switch qos {
	case corev1.PodQOSGuaranteed:
		r := corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("100m"), corev1.ResourceMemory: resource.MustParse("64Mi")}
		res.Requests, res.Limits = r, r
	case corev1.PodQOSBurstable:
		res.Requests = corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("100m")}
	}
	no := false
	p, err := c.client.CoreV1().Pods(ns).Create(context.Background(), &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels},
		Spec: corev1.PodSpec{NodeName: node, AutomountServiceAccountToken: &no,
			Containers: []corev1.Container{{Name: "app", Image: "example.invalid/app", Resources: res}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if p.Status.QOSClass != qos {
		t.Fatalf("pod %s: QoS class %q, want %q", name, p.Status.QOSClass, qos)
	}
	return p
}

func (c *cluster) deletePod(t testing.TB, ns, name string) {
	t.Helper()
	zero := int64(0)
	if err := c.client.CoreV1().Pods(ns).Delete(context.Background(), name, metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil {
		t.Fatal(err)
	}
}

// limit makes or replaces an EgressLimit.
func (c *cluster) limit(t testing.TB, ns, name string, spec map[string]any) {
	t.Helper()
	u := &unstructured.Unstructured{Object: map[string]any{"apiVersion": "egressd.io/v1alpha1", "kind": "EgressLimit", "metadata": map[string]any{"name": name, "namespace": ns}, "spec": spec}}
	ctx := context.Background()
	old, err := c.limits.Namespace(ns).Get(ctx, name, metav1.GetOptions{})
	if err == nil {
		u.SetResourceVersion(old.GetResourceVersion())
		_, err = c.limits.Namespace(ns).Update(ctx, u, metav1.UpdateOptions{})
	} else {
		_, err = c.limits.Namespace(ns).Create(ctx, u, metav1.CreateOptions{})
	}
	if err != nil {
		t.Fatal(err)
	}
}

// events are the messages of the Events about an object.
func (c *cluster) events(t testing.TB, ns, name string) []string {
	t.Helper()
	l, err := c.client.CoreV1().Events(ns).List(context.Background(), metav1.ListOptions{FieldSelector: "involvedObject.name=" + name})
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range l.Items {
		out = append(out, e.Reason+": "+e.Message)
	}
	return out
}

// node is a kubelet's cgroup tree under a test cgroup, for one driver.
type node struct {
	name   string
	top    string // the test cgroup, the kubelet's --cgroup-root
	layout kube.Layout
	mount  string
}

// newNode makes the test cgroup the kubelet's root and its QoS cgroups,
// as the kubelet does at its start. With the systemd driver the root is a
// slice, as systemd would have it.
func newNode(t testing.TB, name string, driver kube.Driver) *node {
	t.Helper()
	mount, err := cgroups.Mount()
	if err != nil {
		t.Fatal(err)
	}
	n := &node{name: name, mount: mount}
	n.top = privtest.Cgroup(t, "kube")
	if driver == kube.Systemd {
		n.top = privtest.Slice(t, "kube")
	}
	rel, _ := filepath.Rel(mount, n.top)
	n.layout = kube.Layout{Driver: driver, Root: "/" + rel}
	for _, q := range []kube.QoS{kube.Guaranteed, kube.Burstable} { // besteffort's parent is burstable's
		dir, err := kube.PodCgroup(driver, n.layout.Root, q, "x")
		if err != nil {
			t.Fatal(err)
		}
		n.mkdirs(t, filepath.Dir(dir))
	}
	be, _ := kube.PodCgroup(driver, n.layout.Root, kube.BestEffort, "x")
	n.mkdirs(t, filepath.Dir(be))
	return n
}

// mkdirs makes each missing level of rel, a path below the mount, each
// removed when the test ends, deepest first.
func (n *node) mkdirs(t testing.TB, rel string) string {
	t.Helper()
	dir := n.mount
	for _, part := range strings.Split(rel, "/") {
		next := filepath.Join(dir, part)
		if _, err := os.Stat(next); err != nil {
			privtest.SubCgroup(t, dir, part)
		}
		dir = next
	}
	return dir
}

// start makes a pod's cgroup and a container's in it, as the kubelet
// does when it starts the pod, and runs an agent in the container's.
func (n *node) start(t *testing.T, p *corev1.Pod) (*pyProc, time.Time) {
	t.Helper()
	rel, err := kube.PodCgroup(n.layout.Driver, n.layout.Root, kube.QoS(p.Status.QOSClass), string(p.UID))
	if err != nil {
		t.Fatal(err)
	}
	made := time.Now()
	dir := n.mkdirs(t, rel)
	ctr := privtest.SubCgroup(t, dir, "ctr-app")
	py := startPythonIn(t, nil, ctr, agentScript)
	if got, want := py.line(t), fmt.Sprintf("ready %d", py.pid); got != want {
		t.Fatalf("agent: %q, want %q", got, want)
	}
	return py, made
}

// hostPaths are a test's stand-ins for the paths the DaemonSet gives,
// which are the host's.
type hostPaths struct{ policy, state, socket, pins, metrics string }

// daemonSetArgs is the DaemonSet's command line for node n, with the
// test's paths for the host's, and three flags more: the test's cgroup
// cg to attach to, a kubeconfig (in-cluster configuration needs a pod's
// service account token), and a log for the test to show.
func daemonSetArgs(t testing.TB, n *node, p hostPaths, cg, kubeconfig string) []string {
	t.Helper()
	argv, err := deploy.DaemonSetArgs(map[string]string{"NODE_NAME": n.name, "CGROUP_DRIVER": string(n.layout.Driver), "CGROUP_ROOT": n.layout.Root})
	if err != nil {
		t.Fatal(err)
	}
	if len(argv) < 2 || argv[0] != "egressd" || argv[1] != "run" {
		t.Fatalf("the DaemonSet runs %q, not egressd run", argv)
	}
	host := map[string]string{"--policy": p.policy, "--state-dir": p.state, "--socket": p.socket, "--bpffs": p.pins, "--metrics": p.metrics}
	for i := 2; i+1 < len(argv); i++ {
		if v, ok := host[argv[i]]; ok {
			argv[i+1] = v
			delete(host, argv[i])
		}
	}
	if len(host) > 0 {
		t.Fatalf("the DaemonSet's command line %q has no %v to give the test's paths", argv, slices.Collect(maps.Keys(host)))
	}
	return append(argv[1:], "--cgroup", cg, "--kubeconfig", kubeconfig, "--log-level", "debug")
}

// waitRules waits until the daemon's Kubernetes rules are want, by name,
// each installed, and returns them.
func waitRules(t *testing.T, e *env, want ...string) map[string]control.Limit {
	t.Helper()
	slices.Sort(want)
	var got map[string]control.Limit
	clocktest.Eventually(t, fmt.Sprintf("Kubernetes rules %v installed", want), func() bool {
		var ls []control.Limit
		e.json(t, &ls, "limit", "ls", "--source", "k8s")
		got = map[string]control.Limit{}
		var names []string
		for _, l := range ls {
			if l.Pending != "" {
				return false
			}
			got[l.Name] = l
			names = append(names, l.Name)
		}
		slices.Sort(names)
		return slices.Equal(names, want)
	})
	return got
}

// waitLong is clocktest.Eventually for what client-go's backoff delays:
// up to a minute.
func waitLong(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("still waiting after a minute for %s", what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// dials dials port n times and returns the outcomes.
func dials(t *testing.T, py *pyProc, port, n int) []string {
	t.Helper()
	var out []string
	for range n {
		out = append(out, strings.Fields(py.dial(t, port))[0])
	}
	return out
}

// TestKubernetesPods runs the daemon with the DaemonSet's command line on
// a node of each cgroup driver, against a real API server: EgressLimits select pods
// by namespace and labels, each selected pod is limited on its own, in
// the cgroup the kubelet gives it, and the rules follow pods and limits
// as they come, change and go, the API server going away, and the daemon
// killed -9 and restarted.
func TestKubernetesPods(t *testing.T) {
	privtest.RequireRoot(t)
	c := startCluster(t)
	for _, driver := range []kube.Driver{kube.Systemd, kube.Cgroupfs} {
		t.Run(string(driver), func(t *testing.T) { testKubernetesNode(t, c, driver) })
	}
}

func testKubernetesNode(t *testing.T, c *cluster, driver kube.Driver) {
	n := newNode(t, "node-"+string(driver), driver)
	ns := "shop-" + string(driver)
	c.namespace(t, ns)
	port, other := listen(t), listen(t)
	web := map[string]string{"app": "web"}
	web1 := c.pod(t, ns, "web-1", n.name, web, corev1.PodQOSBurstable)
	web2 := c.pod(t, ns, "web-2", n.name, web, corev1.PodQOSBestEffort)
	db := c.pod(t, ns, "db-0", n.name, map[string]string{"app": "db"}, corev1.PodQOSGuaranteed)
	c.pod(t, ns, "web-elsewhere", "another-node", web, corev1.PodQOSBurstable)
	c.limit(t, ns, "to-db", map[string]any{"podSelector": map[string]any{"matchLabels": map[string]any{"app": "web"}},
		"destination": "127.0.0.1", "port": int64(port), "concurrency": int64(2)})

	e := newEnvOn(t, n.top)
	e.writePolicy(t, "rules: []\n")
	e.argv = daemonSetArgs(t, n, hostPaths{e.policy, e.state, e.socket, e.pins, e.metrics}, e.cg, c.Kubeconfig)
	d := e.start(t)
	py1, _ := n.start(t, web1)
	py2, _ := n.start(t, web2)
	pyDB, _ := n.start(t, db)
	rules := waitRules(t, e, "k8s:"+ns+"/to-db/web-1", "k8s:"+ns+"/to-db/web-2")
	for name, l := range rules {
		if l.Source != "k8s:"+ns+"/to-db" || l.Limit != 2 {
			t.Errorf("rule %s: source %q limit %d, want k8s:%s/to-db and 2", name, l.Source, l.Limit, ns)
		}
	}
	// Each selected pod has the limit to itself; a pod it does not
	// select, and another port, are not limited.
	want := []string{"ok", "ok", "err"}
	for _, py := range []*pyProc{py1, py2} {
		if got := dials(t, py, port, 3); !slices.Equal(got, want) {
			t.Errorf("a web pod's connects: %q, want %q", got, want)
		}
	}
	if got := dials(t, pyDB, port, 3); !slices.Equal(got, []string{"ok", "ok", "ok"}) {
		t.Errorf("the db pod's connects: %q, want all admitted", got)
	}
	if got := dials(t, py1, other, 1); got[0] != "ok" {
		t.Errorf("a web pod's connect to another port: %q", got)
	}
	if out := e.ok(t, "limit", "ls", "--source", "k8s:"+ns+"/to-db"); !strings.Contains(out, "k8s:"+ns+"/to-db/web-1") {
		t.Errorf("limit ls --source k8s:%s/to-db:\n%s", ns, out)
	}
	if r := e.cli(t, "limit", "rm", "k8s:"+ns+"/to-db/web-1"); r.code == 0 || !strings.Contains(r.stderr, "made for a Kubernetes EgressLimit: change or delete the object "+ns+"/to-db") {
		t.Errorf("limit rm of a Kubernetes rule: exit %d\n%s", r.code, r.stderr)
	}

	// A pod that starts is limited once its cgroup is there; one that
	// goes is forgotten.
	web3 := c.pod(t, ns, "web-3", n.name, web, corev1.PodQOSBurstable)
	py3, made := n.start(t, web3)
	waitRules(t, e, "k8s:"+ns+"/to-db/web-1", "k8s:"+ns+"/to-db/web-2", "k8s:"+ns+"/to-db/web-3")
	t.Logf("%s: pod cgroup made to its rule installed, as limit ls saw it: %v", driver, time.Since(made).Round(time.Millisecond))
	if got := dials(t, py3, port, 3); !slices.Equal(got, want) {
		t.Errorf("the new pod's connects: %q, want %q", got, want)
	}
	c.deletePod(t, ns, "web-3")
	waitRules(t, e, "k8s:"+ns+"/to-db/web-1", "k8s:"+ns+"/to-db/web-2")

	// A limit edited applies to the pods at once; one that clashes with
	// another, or that the schema cannot refuse, is reported on the object
	// with this node's name, and changes nothing.
	c.limit(t, ns, "to-db", map[string]any{"podSelector": map[string]any{"matchLabels": map[string]any{"app": "web"}},
		"destination": "127.0.0.1", "port": int64(port), "concurrency": int64(3)})
	clocktest.Eventually(t, "the edited limit", func() bool { return e.limit(t, "k8s:"+ns+"/to-db/web-1").Limit == 3 })
	if got := dials(t, py1, port, 2); !slices.Equal(got, []string{"ok", "err"}) {
		t.Errorf("connects after the edit to 3: %q, want one more admitted", got)
	}
	c.limit(t, ns, "to-db-again", map[string]any{"podSelector": map[string]any{}, "destination": "127.0.0.1", "port": int64(port), "concurrency": int64(9)})
	c.limit(t, ns, "bad-prefix", map[string]any{"podSelector": map[string]any{}, "destination": "10.0.0.0/33", "concurrency": int64(1)})
	for name, words := range map[string]string{
		"to-db-again": "node " + n.name + ": rule k8s:" + ns + "/to-db-again/web-1: same scope, destination and port as rule k8s:" + ns + "/to-db/web-1",
		"bad-prefix":  "node " + n.name + `: destination "10.0.0.0/33"`,
	} {
		clocktest.Eventually(t, "an Event on "+name, func() bool {
			return slices.ContainsFunc(c.events(t, ns, name), func(m string) bool { return strings.HasPrefix(m, "NotApplied: "+words) })
		})
	}
	waitRules(t, e, "k8s:"+ns+"/to-db/web-1", "k8s:"+ns+"/to-db/web-2")
	var st control.Status
	e.json(t, &st, "status")
	if k := st.Kube; k == nil || !k.Connected || k.Node != n.name || k.Limits != 3 || k.Refused != 2 || k.Rules != 5 || k.Pods != 3 {
		t.Errorf("status: %+v, want connected, 3 limits of which 2 refused, 3 pods, 5 rules made (3 of them left out)", k)
	}

	// The API server goes: the node keeps enforcing, says so, and takes
	// up changes once it is back.
	c.StopAPI()
	clocktest.Eventually(t, "status to say the API server is unreachable", func() bool {
		e.json(t, &st, "status")
		return st.Kube != nil && !st.Kube.Connected
	})
	if v, ok := e.scrape(t).value("egressd_kube_connected", map[string]string{}); !ok || v != 0 {
		t.Errorf("egressd_kube_connected %v (%v) with the API server down, want 0", v, ok)
	}
	if got := dials(t, py2, port, 2); !slices.Equal(got, []string{"ok", "err"}) {
		t.Errorf("connects with the API server down: %q, want the limit of 3 held", got)
	}
	// Killed -9 and restarted while the API server is away: the rules
	// saved at the last change are enforced, their counts adopted.
	d.kill(t)
	e.start(t)
	got := waitRules(t, e, "k8s:"+ns+"/to-db/web-1", "k8s:"+ns+"/to-db/web-2")
	if l := got["k8s:"+ns+"/to-db/web-1"]; l.Live != 3 || l.Limit != 3 {
		t.Errorf("web-1's rule after the restart: live %d limit %d, want 3 and 3 (adopted)", l.Live, l.Limit)
	}
	if got := dials(t, py1, port, 1); got[0] != "err" {
		t.Errorf("connect over the limit after the restart: %q", got)
	}
	c.StartAPI(t)
	c.limit(t, ns, "to-db", map[string]any{"podSelector": map[string]any{"matchLabels": map[string]any{"app": "web"}},
		"destination": "127.0.0.1", "port": int64(port), "concurrency": int64(4)})
	// client-go's watches retry with a backoff that doubles from 0.8 s
	// to 30 s, with as much jitter again: a change may wait that long.
	back := time.Now()
	waitLong(t, "the limit edited after the API server came back", func() bool { return e.limit(t, "k8s:"+ns+"/to-db/web-2").Limit == 4 })
	e.json(t, &st, "status")
	if st.Kube == nil || !st.Kube.Connected {
		t.Errorf("status once a change came through: %+v, want connected", st.Kube)
	}
	t.Logf("%s: API server ready to the change applied: %v", driver, time.Since(back).Round(time.Millisecond))

	// A deleted limit leaves the pods unlimited.
	if err := c.limits.Namespace(ns).Delete(context.Background(), "to-db", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	// The clashing limit, refused until now, takes its place.
	waitRules(t, e, "k8s:"+ns+"/to-db-again/db-0", "k8s:"+ns+"/to-db-again/web-1", "k8s:"+ns+"/to-db-again/web-2")
}
