package daemon

import (
	"context"
	"errors"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/egressd/egressd/pkg/policy"
)

// kubeRule is a rule an EgressLimit of source makes for the pod whose
// cgroup is /kubepods/pod<pod>.
func kubeRule(t *testing.T, source, pod, dest string) (policy.Rule, string) {
	t.Helper()
	r := parse(t, "rules:\n  - {name: x, destination: "+dest+", port: 5432, cgroup: /kubepods/pod"+pod+", concurrency: 2}\n").Rules[0]
	r.Name = source + "/" + pod
	return r, source
}

func kubeSet(t *testing.T, rules ...func() (policy.Rule, string)) kubeRules {
	var k kubeRules
	for _, f := range rules {
		r, s := f()
		k.rules, k.sources = append(k.rules, r), append(k.sources, s)
	}
	return k
}

func ruleNames(td *testDaemon) []string {
	var out []string
	for name := range td.state() {
		out = append(out, name)
	}
	slices.Sort(out)
	return out
}

// The Kubernetes rules merge after the file's: an object whose rules
// clash with the file's is left out whole and told why, comes in once a
// reload takes the clash away, is saved for a restart, and cannot be
// removed from the CLI.
func TestKubeRulesMerge(t *testing.T) {
	td := newTestDaemon(t)
	ctx := context.Background()
	file := "rules:\n  - {name: file-db, destination: 10.0.0.1, port: 5432, cgroup: /kubepods/podu1, concurrency: 5}\n"
	writeFile(t, td.cfg.PolicyFile, file)
	if err := td.table.install(ctx, parse(t, file), time.Now()); err != nil {
		t.Fatal(err)
	}
	k := kubeSet(t,
		func() (policy.Rule, string) { return kubeRule(t, "k8s:shop/a", "u1", "10.0.0.1") },
		func() (policy.Rule, string) { return kubeRule(t, "k8s:shop/a", "u2", "10.0.0.1") },
		func() (policy.Rule, string) { return kubeRule(t, "k8s:shop/b", "u2", "10.0.0.2") },
	)
	refused, err := td.table.setKube(ctx, k, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	want := "rule k8s:shop/a/u1: same scope, destination and port as rule file-db; the kernel takes one rule for the same traffic"
	if len(refused) != 1 || refused["k8s:shop/a"] != want {
		t.Errorf("refused %v, want k8s:shop/a: %s", refused, want)
	}
	if got := ruleNames(td); !slices.Equal(got, []string{"file-db", "k8s:shop/b/u2"}) {
		t.Errorf("rules %v, want file-db and b's alone", got)
	}
	saved, err := loadKube(kubePath(td.cfg.StateDir))
	if err != nil || len(saved.rules) != 1 || saved.rules[0] != k.rules[2] || saved.sources[0] != "k8s:shop/b" {
		t.Errorf("saved %+v, %v; want b's rule alone, as it was", saved, err)
	}
	select {
	case <-td.table.kubeChanged: // the refusal
	default:
		t.Error("a change that refused an object did not say so")
	}

	// The file's rule goes: the object left out comes in.
	writeFile(t, td.cfg.PolicyFile, "rules: []\n")
	if _, err := td.reloadPolicy(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case <-td.table.kubeChanged:
	default:
		t.Error("a reload that ended a refusal did not say so")
	}
	if r := td.table.kubeRefused(); len(r) != 0 {
		t.Errorf("refused after the reload: %v", r)
	}
	if got := ruleNames(td); !slices.Equal(got, []string{"k8s:shop/a/u1", "k8s:shop/a/u2", "k8s:shop/b/u2"}) {
		t.Errorf("rules after the reload %v, want every Kubernetes rule", got)
	}
	if err := td.table.remove(ctx, "k8s:shop/a/u1", time.Now()); !errors.Is(err, errKubeRule) || !strings.Contains(err.Error(), "shop/a") {
		t.Errorf("remove of a Kubernetes rule: %v, want errKubeRule naming shop/a", err)
	}
}

// A saved file that does not read is set aside, and the daemon starts
// without Kubernetes rules until the API server gives them.
func TestKubeRulesUnreadable(t *testing.T) {
	td := newTestDaemon(t)
	if err := os.MkdirAll(td.cfg.StateDir, 0o755); err != nil {
		t.Fatal(err)
	}
	writeFile(t, kubePath(td.cfg.StateDir), `{"limits": [{"source": "k8s:a/b", "rule": "rules: [{name: x}]", "pods": [{"name": "k8s:a/b/p", "cgroup": "/p"}]}]}`)
	if err := td.table.restoreKube(); err != nil {
		t.Fatal(err)
	}
	if len(td.table.kube.rules) != 0 {
		t.Errorf("rules restored from an unreadable file: %v", td.table.kube.rules)
	}
	if _, err := os.Stat(kubePath(td.cfg.StateDir) + ".unreadable"); err != nil {
		t.Errorf("not set aside: %v", err)
	}
}
