package kube

import (
	"cmp"
	"errors"
	"fmt"
	"hash/fnv"
	"slices"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"

	"github.com/egressd/egressd/pkg/kernelrule"
	"github.com/egressd/egressd/pkg/policy"
)

// Limit is an EgressLimit as the daemon reads it: its rule, checked as
// the policy file's are, without a name or scope (its pods give those), or
// the problem that keeps it from being applied.
type Limit struct {
	Namespace, Name string
	Created         time.Time
	Selector        labels.Selector
	Rule            policy.Rule
	Problem         string
}

// Source is what a limit's rules are listed as coming from.
func (l *Limit) Source() string { return policy.KubePrefix + l.Namespace + "/" + l.Name }

// ReadLimit reads an EgressLimit. Its spec, less the pod selector, is a
// rule of a policy file, and is checked by the same parser, so that an
// object is refused for what a file would be, in the same words.
func ReadLimit(u *unstructured.Unstructured) Limit {
	l := Limit{Namespace: u.GetNamespace(), Name: u.GetName(), Created: u.GetCreationTimestamp().Time}
	spec, ok := u.Object["spec"].(map[string]any)
	if !ok {
		l.Problem = "spec is missing"
		return l
	}
	var sel metav1.LabelSelector
	raw, _ := spec["podSelector"].(map[string]any)
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(raw, &sel); err != nil {
		l.Problem = fmt.Sprintf("podSelector: %v", err)
		return l
	}
	s, err := metav1.LabelSelectorAsSelector(&sel)
	if err != nil {
		l.Problem = fmt.Sprintf("podSelector: %v", err)
		return l
	}
	l.Selector = s
	rule := map[string]any{"name": "limit"}
	for k, v := range spec {
		switch k {
		case "podSelector":
		case "name", "unit", "cgroup":
			l.Problem = fmt.Sprintf("%s: a limit's rules are named and scoped by the pods it selects", k)
			return l
		default:
			rule[k] = v
		}
	}
	text, err := yaml.Marshal(map[string]any{"rules": []any{rule}})
	if err != nil {
		l.Problem = err.Error()
		return l
	}
	p, err := policy.Parse(text)
	if e, ok := err.(*policy.Error); ok {
		msgs := make([]string, len(e.Problems))
		for i, p := range e.Problems {
			msgs[i] = p.Msg
		}
		l.Problem = strings.Join(msgs, "; ")
		return l
	}
	if err != nil {
		l.Problem = err.Error()
		return l
	}
	l.Rule = p.Rules[0]
	return l
}

// Layout is how the kubelet of this node lays out pods' cgroups.
type Layout struct {
	Driver Driver
	Root   string // its --cgroup-root
}

// Rule is one of the rules the limits make: a limit's rule for one pod.
type Rule struct {
	policy.Rule
	Source string // the limit's: k8s:NAMESPACE/NAME
}

// Rules are the rules limits make for pods, the pods of this node: one per
// limit and pod it selects in its namespace, scoped to the pod's cgroup,
// ordered by the limits' creation (an older limit wins a clash), then by
// pod. Limits with a problem make none; pods that have ended (Succeeded,
// Failed) have no cgroup left to limit. A pod whose cgroup cannot be named
// is left out, and said so in the error, which does not stop the rest.
func Rules(limits []Limit, pods []*corev1.Pod, layout Layout) ([]Rule, error) {
	limits = slices.Clone(limits)
	slices.SortFunc(limits, func(a, b Limit) int {
		return cmp.Or(a.Created.Compare(b.Created), cmp.Compare(a.Namespace, b.Namespace), cmp.Compare(a.Name, b.Name))
	})
	// The pods that can be limited, each with its cgroup, in order.
	type podDir struct {
		*corev1.Pod
		dir string
	}
	var live []podDir
	var errs []error
	for _, p := range pods {
		if p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed {
			continue
		}
		dir, err := PodCgroup(layout.Driver, layout.Root, qosOf(p), string(p.UID))
		if err != nil {
			errs = append(errs, fmt.Errorf("pod %s/%s: %w", p.Namespace, p.Name, err))
			continue
		}
		live = append(live, podDir{p, "/" + dir})
	}
	slices.SortFunc(live, func(a, b podDir) int {
		return cmp.Or(cmp.Compare(a.Namespace, b.Namespace), cmp.Compare(a.Name, b.Name))
	})
	var out []Rule
	for _, l := range limits {
		if l.Problem != "" {
			continue
		}
		for _, p := range live {
			if p.Namespace != l.Namespace || !l.Selector.Matches(labels.Set(p.Labels)) {
				continue
			}
			r := l.Rule
			r.Name = RuleName(l.Namespace, l.Name, p.Name)
			r.Scope = policy.Scope{Cgroup: p.dir}
			out = append(out, Rule{Rule: r, Source: l.Source()})
		}
	}
	return out, errors.Join(errs...)
}

// selectsHere reports whether l selects one of pods, the pods of this
// node; a limit whose selector does not read, any pod of its namespace.
func selectsHere(l Limit, pods []*corev1.Pod) bool {
	return slices.ContainsFunc(pods, func(p *corev1.Pod) bool {
		return p.Namespace == l.Namespace && (l.Selector == nil || l.Selector.Matches(labels.Set(p.Labels)))
	})
}

// RuleName names the rule of limit name in namespace for pod:
// k8s:NAMESPACE/NAME/POD, or, when that is longer than a rule's name may
// be, as much of it as fits with a hash of the whole after a '~'.
func RuleName(namespace, name, pod string) string {
	whole := policy.KubePrefix + namespace + "/" + name + "/" + pod
	if len(whole) <= kernelrule.MaxNameLen {
		return whole
	}
	h := fnv.New64a()
	h.Write([]byte(whole))
	sum := fmt.Sprintf("~%012x", h.Sum64()&(1<<48-1))
	return whole[:kernelrule.MaxNameLen-len(sum)] + sum
}

// qosOf is the pod's QoS class: the API server sets it at creation; a pod
// without it is classed from its containers' resources as the kubelet
// does.
func qosOf(p *corev1.Pod) QoS {
	if p.Status.QOSClass != "" {
		return QoS(p.Status.QOSClass)
	}
	requests, limits, guaranteed := false, false, true
	for _, c := range append(slices.Clone(p.Spec.InitContainers), p.Spec.Containers...) {
		for _, r := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory} {
			req, hasReq := c.Resources.Requests[r]
			lim, hasLim := c.Resources.Limits[r]
			requests = requests || hasReq && !req.IsZero()
			limits = limits || hasLim && !lim.IsZero()
			if !hasLim || lim.IsZero() || hasReq && req.Cmp(lim) != 0 {
				guaranteed = false
			}
		}
	}
	switch {
	case !requests && !limits:
		return BestEffort
	case guaranteed:
		return Guaranteed
	}
	return Burstable
}
