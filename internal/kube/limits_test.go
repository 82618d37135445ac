package kube

import (
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"

	"github.com/egressd/egressd/pkg/policy"
)

func limitObject(ns, name string, created time.Time, spec map[string]any) *unstructured.Unstructured {
	u := &unstructured.Unstructured{Object: map[string]any{"apiVersion": "egressd.io/v1alpha1", "kind": "EgressLimit", "spec": spec}}
	u.SetNamespace(ns)
	u.SetName(name)
	u.SetCreationTimestamp(metav1.NewTime(created))
	return u
}

// An object's spec is checked by the policy file's parser: what a file
// refuses, an object is refused for, in the same words.
func TestReadLimit(t *testing.T) {
	sel := map[string]any{"matchLabels": map[string]any{"app": "web"}}
	for _, tc := range []struct {
		name    string
		spec    map[string]any
		want    string // the rule as a file writes it, or
		problem string // why there is none
	}{
		{"concurrency", map[string]any{"podSelector": sel, "destination": "10.0.0.0/8", "port": int64(5432), "concurrency": int64(4)}, "concurrency: 4", ""},
		{"per second", map[string]any{"podSelector": sel, "destination": "db.internal", "perSecond": map[string]any{"permits": int64(10), "burst": int64(20)}}, "perSecond: {permits: 10, burst: 20}", ""},
		{"udp", map[string]any{"podSelector": sel, "destination": "10.0.0.53", "protocols": []any{"udp"}, "udpIdle": "30s", "concurrency": int64(2)}, "udpIdle: 30s", ""},
		{"adaptive options", map[string]any{"podSelector": sel, "destination": "10.0.0.1", "adaptive": map[string]any{"minimum": int64(2), "maximum": int64(50)}}, "maximum: 50", ""},
		{"no selector is every pod", map[string]any{"destination": "10.0.0.1", "concurrency": int64(1)}, "concurrency: 1", ""},
		{"bad destination", map[string]any{"podSelector": sel, "destination": "10.0.0.0/33", "concurrency": int64(1)}, "", `destination "10.0.0.0/33"`},
		{"two shapes", map[string]any{"podSelector": sel, "destination": "10.0.0.1", "concurrency": int64(1), "perSecond": map[string]any{"permits": int64(1)}}, "", "concurrency and perSecond are both given; a rule has one limit"},
		{"unknown adaptive field", map[string]any{"podSelector": sel, "destination": "10.0.0.1", "adaptive": map[string]any{"maximun": int64(5)}}, "", "maximun"},
		{"scope in the spec", map[string]any{"podSelector": sel, "destination": "10.0.0.1", "unit": "x.service", "concurrency": int64(1)}, "", "unit: a limit's rules are named and scoped by the pods it selects"},
		{"bad selector", map[string]any{"podSelector": map[string]any{"matchExpressions": []any{map[string]any{"key": "app", "operator": "In"}}}, "destination": "10.0.0.1", "concurrency": int64(1)}, "", "podSelector: "},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := ReadLimit(limitObject("shop", "db", time.Unix(0, 0), tc.spec))
			if tc.problem != "" {
				if !strings.Contains(l.Problem, tc.problem) {
					t.Fatalf("problem %q, want one containing %q", l.Problem, tc.problem)
				}
				return
			}
			if l.Problem != "" {
				t.Fatalf("problem %q", l.Problem)
			}
			l.Rule.Name = "x"
			text, err := policy.Format(&policy.Policy{Rules: []policy.Rule{l.Rule}})
			if err != nil || !strings.Contains(string(text), tc.want) {
				t.Fatalf("rule\n%s(%v), want it to contain %q", text, err, tc.want)
			}
		})
	}
}

// The file's own wording, for the same mistake.
func TestReadLimitSameWordsAsFile(t *testing.T) {
	_, err := policy.Parse([]byte("rules:\n  - {name: x, destination: 10.0.0.1, concurrency: 0}\n"))
	e := err.(*policy.Error)
	l := ReadLimit(limitObject("shop", "db", time.Unix(0, 0), map[string]any{"destination": "10.0.0.1", "concurrency": int64(0)}))
	if l.Problem != e.Problems[0].Msg {
		t.Fatalf("object's problem %q, file's %q", l.Problem, e.Problems[0].Msg)
	}
}

func pod(ns, name, uid string, labels map[string]string, qos corev1.PodQOSClass, phase corev1.PodPhase) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, UID: types.UID(uid), Labels: labels},
		Status:     corev1.PodStatus{QOSClass: qos, Phase: phase},
	}
}

// Each limit makes one rule per pod it selects, in its namespace, scoped
// to the pod's cgroup, older limits first.
func TestRules(t *testing.T) {
	web := map[string]string{"app": "web"}
	older := ReadLimit(limitObject("shop", "older", time.Unix(10, 0), map[string]any{"podSelector": map[string]any{"matchLabels": map[string]any{"app": "web"}}, "destination": "10.0.0.1", "concurrency": int64(2)}))
	newer := ReadLimit(limitObject("shop", "newer", time.Unix(20, 0), map[string]any{"destination": "10.0.0.2", "concurrency": int64(3)}))
	bad := ReadLimit(limitObject("shop", "bad", time.Unix(5, 0), map[string]any{"destination": "10.0.0.3", "concurrency": int64(0)}))
	pods := []*corev1.Pod{
		pod("shop", "web-2", "u2", web, corev1.PodQOSBestEffort, corev1.PodRunning),
		pod("shop", "web-1", "u1", web, corev1.PodQOSBurstable, corev1.PodPending),
		pod("shop", "db-0", "u3", map[string]string{"app": "db"}, corev1.PodQOSGuaranteed, corev1.PodRunning),
		pod("shop", "job", "u4", web, corev1.PodQOSBurstable, corev1.PodSucceeded),
		pod("other", "web-9", "u5", web, corev1.PodQOSBurstable, corev1.PodRunning),
		pod("shop", "odd", "../u6", web, corev1.PodQOSBurstable, corev1.PodRunning),
	}
	got, err := Rules([]Limit{newer, bad, older}, pods, Layout{Driver: Cgroupfs})
	// A pod whose cgroup cannot be named is left out, once, and the rest
	// stand.
	if err == nil || err.Error() != `pod shop/odd: pod cgroup: uid "../u6"` {
		t.Errorf("error %v, want one for pod shop/odd", err)
	}
	want := []string{
		"k8s:shop/older/web-1 /kubepods/burstable/podu1 k8s:shop/older",
		"k8s:shop/older/web-2 /kubepods/besteffort/podu2 k8s:shop/older",
		"k8s:shop/newer/db-0 /kubepods/podu3 k8s:shop/newer",
		"k8s:shop/newer/web-1 /kubepods/burstable/podu1 k8s:shop/newer",
		"k8s:shop/newer/web-2 /kubepods/besteffort/podu2 k8s:shop/newer",
	}
	var gotText []string
	for _, r := range got {
		gotText = append(gotText, r.Name+" "+r.Scope.Cgroup+" "+r.Source)
	}
	if strings.Join(gotText, "\n") != strings.Join(want, "\n") {
		t.Fatalf("rules\n%s\nwant\n%s", strings.Join(gotText, "\n"), strings.Join(want, "\n"))
	}
	// Every rule the limits make passes the checks a rule made in code
	// gets, scope included.
	rules := make([]policy.Rule, len(got))
	for i, r := range got {
		rules[i] = r.Rule
	}
	if err := (&policy.Policy{Rules: rules}).Validate(); err != nil {
		t.Fatal(err)
	}
}

func TestRuleName(t *testing.T) {
	if got := RuleName("shop", "db", "web-1"); got != "k8s:shop/db/web-1" {
		t.Errorf("short: %q", got)
	}
	long := strings.Repeat("n", 40)
	a, b := RuleName(long, long, "web-1"), RuleName(long, long, "web-2")
	if len(a) != 63 || a == b || !strings.HasPrefix(a, "k8s:"+long+"/") || a[50] != '~' {
		t.Errorf("long names %q and %q: want 63 bytes, a hash after '~', different", a, b)
	}
	if RuleName(long, long, "web-1") != a {
		t.Error("a long name is not the same twice")
	}
}

func TestQoSOf(t *testing.T) {
	res := func(req, lim string) corev1.ResourceRequirements {
		r := corev1.ResourceRequirements{Requests: corev1.ResourceList{}, Limits: corev1.ResourceList{}}
		for _, name := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory} {
			if req != "" {
				r.Requests[name] = resource.MustParse(req)
			}
			if lim != "" {
				r.Limits[name] = resource.MustParse(lim)
			}
		}
		return r
	}
	for _, tc := range []struct {
		res  corev1.ResourceRequirements
		want QoS
	}{
		{corev1.ResourceRequirements{}, BestEffort},
		{res("1", ""), Burstable},
		{res("1", "2"), Burstable},
		{res("", "1"), Guaranteed}, // requests default to limits
		{res("1", "1"), Guaranteed},
	} {
		p := &corev1.Pod{Spec: corev1.PodSpec{Containers: []corev1.Container{{Resources: tc.res}}}}
		if got := qosOf(p); got != tc.want {
			t.Errorf("%v: %s, want %s", tc.res, got, tc.want)
		}
	}
	if got := qosOf(pod("a", "b", "c", nil, corev1.PodQOSBurstable, "")); got != Burstable {
		t.Errorf("status says Burstable, got %s", got)
	}
}
