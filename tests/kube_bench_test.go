package tests

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/egressd/egressd/internal/kube"
	"github.com/egressd/egressd/internal/privtest"
	"github.com/egressd/egressd/pkg/control"
)

// BenchmarkKubeNode measures a node of 100 pods under 100 EgressLimits
// that each select every pod (10,000 rules), with the DaemonSet's command
// line against a real API server (cgroupfs layout):
//   - apply-s: from the last limit created to every rule installed;
//   - rss-MB, rss-anon-MB: the daemon's resident memory then, and the
//     anonymous part of it (the rest is mostly the binary's pages; its
//     BPF maps are kernel memory, in neither);
//   - pod-to-refusal-ms: from a new pod's cgroup made (its object known to
//     the daemon) to the first connect() its rule refuses, seen by a
//     process in the pod's container cgroup that connects and closes
//     until refused (perSecond 1, burst 1: the second connect after the
//     rule is in is refused), median and slowest of 10 pods;
//   - edit-to-refusal-ms: from a limit's update (concurrency 10 to 3, 3
//     connections held) returned by the API server to the first connect()
//     refused, median and slowest of 10 edits.
func BenchmarkKubeNode(b *testing.B) {
	privtest.RequireRoot(b)
	c := startCluster(b)
	var apply, rss, anon float64
	var starts, edits []time.Duration
	for i := 0; b.Loop(); i++ {
		k := newKubeBench(b, c, fmt.Sprint("bench", i))
		a, r, an := k.fill(b)
		apply, rss, anon = apply+a.Seconds(), rss+r, anon+an
		starts = append(starts, k.podStarts(b, 10)...)
		edits = append(edits, k.edits(b, 10)...)
		k.stop()
	}
	n := float64(b.N)
	b.ReportMetric(apply/n, "apply-s")
	b.ReportMetric(rss/n, "rss-MB")
	b.ReportMetric(anon/n, "rss-anon-MB")
	ms := func(d time.Duration) float64 { return float64(d) / 1e6 }
	slices.Sort(starts)
	slices.Sort(edits)
	b.ReportMetric(ms(starts[len(starts)/2]), "pod-to-refusal-ms")
	b.ReportMetric(ms(starts[len(starts)-1]), "pod-to-refusal-max-ms")
	b.ReportMetric(ms(edits[len(edits)/2]), "edit-to-refusal-ms")
	b.ReportMetric(ms(edits[len(edits)-1]), "edit-to-refusal-max-ms")
}

// kubeBench is one node's daemon and namespace of BenchmarkKubeNode.
type kubeBench struct {
	c    *cluster
	n    *node
	ns   string
	cmd  *exec.Cmd
	ctl  *control.Client
	port int // a listener the limits that connect name
}

func newKubeBench(b *testing.B, c *cluster, ns string) *kubeBench {
	k := &kubeBench{c: c, ns: ns, n: newNode(b, "node-"+ns, kube.Cgroupfs), port: listen(b)}
	c.namespace(b, ns)
	dir := b.TempDir()
	p := hostPaths{policy: filepath.Join(dir, "policy.yaml"), state: filepath.Join(dir, "state"), socket: filepath.Join(dir, "sock"),
		pins: privtest.PinDir(b), metrics: freeLoopbackAddr(b)}
	if err := os.WriteFile(p.policy, []byte("rules: []\n"), 0o644); err != nil {
		b.Fatal(err)
	}
	argv := daemonSetArgs(b, k.n, p, k.n.top, c.Kubeconfig)
	argv = slices.DeleteFunc(argv, func(s string) bool { return s == "--log-level" || s == "debug" })
	k.cmd = exec.Command(egressd, argv...)
	k.cmd.Stderr = os.Stderr
	if err := k.cmd.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(k.stop)
	k.ctl = &control.Client{Socket: p.socket, Timeout: time.Minute}
	k.wait(b, time.Minute, "the daemon to answer", func(*control.Status) bool { return true })
	return k
}

func (k *kubeBench) stop() {
	if k.cmd.ProcessState == nil {
		k.cmd.Process.Signal(syscall.SIGTERM)
		k.cmd.Wait()
	}
}

// wait polls the daemon's status until cond holds.
func (k *kubeBench) wait(b *testing.B, within time.Duration, what string, cond func(*control.Status) bool) {
	b.Helper()
	for deadline := time.Now().Add(within); ; time.Sleep(5 * time.Millisecond) {
		s, err := k.ctl.Status(context.Background())
		if err == nil && cond(&s) {
			return
		}
		if time.Now().After(deadline) {
			b.Fatalf("still waiting after %v for %s: %+v, %v", within, what, s.Kube, err)
		}
	}
}

// fill makes 100 pods with their cgroups and 100 limits selecting them
// all, and returns the time from the last limit to every rule in, and the
// daemon's resident memory then (MB), all and anonymous (the rest is
// mostly the binary's pages).
func (k *kubeBench) fill(b *testing.B) (took time.Duration, rss, anon float64) {
	for i := range 100 {
		p := k.c.pod(b, k.ns, fmt.Sprint("web-", i), k.n.name, map[string]string{"tier": "web"}, corev1.PodQOSBurstable)
		rel, err := kube.PodCgroup(k.n.layout.Driver, k.n.layout.Root, kube.Burstable, string(p.UID))
		if err != nil {
			b.Fatal(err)
		}
		k.n.mkdirs(b, rel)
	}
	for i := range 100 {
		k.c.limit(b, k.ns, fmt.Sprint("limit-", i), map[string]any{"podSelector": map[string]any{"matchLabels": map[string]any{"tier": "web"}},
			"destination": "10.0.0.1", "port": int64(1000 + i), "concurrency": int64(100)})
	}
	t0 := time.Now()
	k.wait(b, 5*time.Minute, "10,000 rules installed", func(s *control.Status) bool {
		return s.Kube != nil && s.Kube.Rules == 10_000 && s.Rules == 10_000 && s.Pending == 0
	})
	took = time.Since(t0)
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", k.cmd.Process.Pid))
	if err != nil {
		b.Fatal(err)
	}
	mb := map[string]float64{}
	for line := range strings.Lines(string(status)) {
		if key, v, ok := strings.Cut(line, ":"); ok && (key == "VmRSS" || key == "RssAnon") {
			kb, err := strconv.Atoi(strings.TrimSuffix(strings.TrimSpace(v), " kB"))
			if err != nil {
				b.Fatal(err)
			}
			mb[key] = float64(kb) / 1024
		}
	}
	if len(mb) != 2 {
		b.Fatalf("VmRSS and RssAnon not both in /proc/PID/status: %v", mb)
	}
	return took, mb["VmRSS"], mb["RssAnon"]
}

// podStarts starts n pods one at a time under a limit of one connection
// a second, and returns for each the time from its cgroup made to a
// connect() refused in it.
func (k *kubeBench) podStarts(b *testing.B, n int) []time.Duration {
	k.c.limit(b, k.ns, "rate", map[string]any{"podSelector": map[string]any{"matchLabels": map[string]any{"app": "new"}},
		"destination": "127.0.0.1", "port": int64(k.port), "perSecond": map[string]any{"permits": int64(1), "burst": int64(1)}})
	var out []time.Duration
	for i := range n {
		p := k.c.pod(b, k.ns, fmt.Sprint("new-", i), k.n.name, map[string]string{"app": "new"}, corev1.PodQOSBestEffort)
		want := 10_000 + i + 1
		k.wait(b, time.Minute, "the new pod's rule", func(s *control.Status) bool { return s.Kube != nil && s.Kube.Rules == want })
		rel, err := kube.PodCgroup(k.n.layout.Driver, k.n.layout.Root, kube.BestEffort, string(p.UID))
		if err != nil {
			b.Fatal(err)
		}
		t0 := time.Now()
		ctr := privtest.SubCgroup(b, k.n.mkdirs(b, rel), "ctr")
		agent := privtest.Spawn(b, ctr, "agent")
		if reply := agent.Call(b, "until-refused 127.0.0.1:%d 30s", k.port); reply != "ok" {
			b.Fatalf("pod %d: until-refused: %q", i, reply)
		}
		out = append(out, time.Since(t0))
	}
	return out
}

// edits holds 3 connections in a pod under a limit of 10 and, n times,
// edits it to 3 and times the first connect() refused, then back to 10.
func (k *kubeBench) edits(b *testing.B, n int) []time.Duration {
	p := k.c.pod(b, k.ns, "held", k.n.name, map[string]string{"app": "held"}, corev1.PodQOSBestEffort)
	rel, err := kube.PodCgroup(k.n.layout.Driver, k.n.layout.Root, kube.BestEffort, string(p.UID))
	if err != nil {
		b.Fatal(err)
	}
	agent := privtest.Spawn(b, privtest.SubCgroup(b, k.n.mkdirs(b, rel), "ctr"), "agent")
	set := func(limit int) {
		k.c.limit(b, k.ns, "edited", map[string]any{"podSelector": map[string]any{"matchLabels": map[string]any{"app": "held"}},
			"destination": "127.0.0.1", "port": int64(k.port), "concurrency": int64(limit)})
	}
	name := kube.RuleName(k.ns, "edited", "held")
	shows := func(limit uint32) func(*control.Status) bool {
		return func(*control.Status) bool {
			l, err := k.ctl.Limit(context.Background(), name)
			return err == nil && l.Limit == limit && l.Pending == ""
		}
	}
	set(10)
	k.wait(b, time.Minute, "the limit of 10", shows(10))
	for i := range 3 {
		if reply := agent.Call(b, "dial 127.0.0.1:%d 5s", k.port); reply != fmt.Sprint("ok ", i) {
			b.Fatalf("dial %d: %q", i, reply)
		}
	}
	var out []time.Duration
	for range n {
		set(3)
		t0 := time.Now()
		if reply := agent.Call(b, "until-refused 127.0.0.1:%d 30s", k.port); reply != "ok" {
			b.Fatalf("until-refused: %q", reply)
		}
		out = append(out, time.Since(t0))
		set(10)
		k.wait(b, time.Minute, "the limit back at 10", shows(10))
	}
	return out
}
