package daemon

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"time"

	"github.com/egressd/egressd/pkg/policy"
)

// sourceKube, as a listing's source, picks every rule made for a
// Kubernetes EgressLimit; each such rule's own source is
// "k8s:NAMESPACE/NAME", the object's.
const sourceKube = "k8s"

// kubeRules are the rules made for the EgressLimits that select pods of
// this node, in the order their objects were created: one per limit and
// pod, named policy.KubePrefix+…, with the object each came from.
type kubeRules struct {
	rules   []policy.Rule
	sources []string // "k8s:NAMESPACE/NAME", for each of rules
}

// errKubeRule is a change asked of a rule that a Kubernetes object makes:
// the object is where it changes.
var errKubeRule = errors.New("made for a Kubernetes EgressLimit: change or delete the object")

// merge sets c's rules in force: the policy's with the overrides, then the
// Kubernetes rules. The rules of an EgressLimit that clash with the
// others (the same pod, destination and port as another rule) are left
// out whole, the object's in c.refused with the first problem: a node's
// file and CLI win over objects, and an older object over a newer one.
func (c *tableChange) merge() error {
	c.merged, c.rules = effective(c.p, c.o, c.k, nil), c.p.Rules
	if len(c.o.Set) == 0 && len(c.o.Removed) == 0 && len(c.k.rules) == 0 {
		return nil
	}
	c.rules = specs(c.merged)
	if len(c.o.Set) == 0 && len(c.k.rules) == 0 {
		return nil // removing rules cannot make a clash
	}
	err := (&policy.Policy{Rules: c.rules}).Validate()
	e, ok := errors.AsType[*policy.Error](err)
	if err == nil || !ok || len(c.k.rules) == 0 {
		return err
	}
	source := make(map[string]string, len(c.k.rules))
	for i, r := range c.k.rules {
		source[r.Name] = c.k.sources[i]
	}
	refused := map[string]string{}
	var others []policy.Problem
	for _, p := range e.Problems {
		s, ok := source[p.Rule]
		if !ok {
			others = append(others, p)
		} else if _, seen := refused[s]; !seen {
			refused[s] = fmt.Sprintf("rule %s: %s", p.Rule, p.Msg)
		}
	}
	if len(others) > 0 {
		return &policy.Error{Problems: others}
	}
	c.refused = refused
	c.merged = effective(c.p, c.o, c.k, refused)
	c.rules = specs(c.merged)
	return (&policy.Policy{Rules: c.rules}).Validate()
}

// setKube makes k the table's Kubernetes rules at now and keeps them in
// the state directory, for a restart that cannot reach the API server to
// enforce them. It returns the EgressLimits left out, with why.
func (t *table) setKube(ctx context.Context, k kubeRules, now time.Time) (map[string]string, error) {
	var refused map[string]string
	err := t.change(ctx, t.prepare(ctx, now, k.rules...), func(f found) ([]retired, error) {
		c, err := t.planLocked(t.policy, t.applied, k, f)
		if err != nil {
			return nil, err
		}
		gone, err := t.writeLocked(c)
		refused = c.refused
		return gone, err
	})
	if err != nil {
		return nil, err
	}
	if err := k.save(t.cfg.StateDir, refused); err != nil {
		t.log.Error("saving the Kubernetes rules; a restart without the API server starts without those that changed", "err", err)
	}
	return refused, nil
}

// kubeRefused is what the table leaves out of the Kubernetes rules now:
// the objects, with why. A reload that adds a clashing rule changes it.
func (t *table) kubeRefused() map[string]string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.refused
}

func kubePath(dir string) string { return filepath.Join(dir, "kubernetes.json") }

// kubeFile is kubeRules as saved: each EgressLimit's rule once, with the
// pods it makes it for, so that a node of 100 limits over 100 pods
// writes 100 rules, not 10,000.
type kubeFile struct {
	Limits []kubeLimit `json:"limits"`
}

type kubeLimit struct {
	Source string `json:"source"`
	// Rule is a policy file of the limit's one rule, without its name and
	// scope (a file cannot give a name beginning policy.KubePrefix).
	Rule string    `json:"rule"`
	Pods []kubePod `json:"pods"`
}

// kubePod is a rule a limit makes: its name and its pod's cgroup.
type kubePod struct {
	Name   string `json:"name"`
	Cgroup string `json:"cgroup"`
}

// save writes k less the objects refused, which clash with other rules,
// atomically and durably, as overrides.save does.
func (k kubeRules) save(dir string, refused map[string]string) error {
	var f kubeFile
	at := map[string]int{}
	for i, r := range k.rules {
		src := k.sources[i]
		if _, ok := refused[src]; ok {
			continue
		}
		n, ok := at[src]
		if !ok {
			one := r
			one.Name, one.Scope = "limit", policy.Scope{}
			text, err := policy.Format(&policy.Policy{Rules: []policy.Rule{one}})
			if err != nil {
				return err
			}
			n, at[src] = len(f.Limits), len(f.Limits)
			f.Limits = append(f.Limits, kubeLimit{Source: src, Rule: string(text)})
		}
		f.Limits[n].Pods = append(f.Limits[n].Pods, kubePod{Name: r.Name, Cgroup: r.Scope.Cgroup})
	}
	b, err := json.MarshalIndent(f, "", "  ")
	if err != nil {
		return err
	}
	if err := makeDir(dir); err != nil {
		return fmt.Errorf("state: %w", err)
	}
	return writeAtomic(dir, kubePath(dir), b)
}

// restoreKube takes the Kubernetes rules saved in the state directory as
// the table's, before its first change, so that a daemon restarted while
// the API server is away enforces what it last knew. A file that does not
// read is set aside, as the run-time limits' is.
func (t *table) restoreKube() error {
	path := kubePath(t.cfg.StateDir)
	k, err := loadKube(path)
	if errors.Is(err, errUnreadable) {
		aside, serr := setAside(path, err)
		if serr != nil {
			return serr
		}
		t.log.Error("saved Kubernetes rules not read; set aside, and they come from the API server", "err", err, "aside", aside)
		k, err = kubeRules{}, nil
	}
	t.kube = k
	return err
}

func loadKube(path string) (kubeRules, error) {
	var f kubeFile
	if found, err := readState(path, &f); !found || err != nil {
		return kubeRules{}, err
	}
	var k kubeRules
	for _, l := range f.Limits {
		p, err := policy.Parse([]byte(l.Rule))
		if err == nil && len(p.Rules) != 1 {
			err = fmt.Errorf("%d rules for one limit", len(p.Rules))
		}
		if err != nil {
			return kubeRules{}, fmt.Errorf("state %s: %s: %w: %w", path, l.Source, errUnreadable, err)
		}
		for _, pod := range l.Pods {
			r := p.Rules[0]
			r.Name, r.Scope = pod.Name, policy.Scope{Cgroup: pod.Cgroup}
			k.rules, k.sources = append(k.rules, r), append(k.sources, l.Source)
		}
	}
	// What the file says is checked as every rule is, so that an edited
	// file cannot bring in a rule no object could make.
	if err := (&policy.Policy{Rules: k.rules}).Validate(); err != nil {
		return kubeRules{}, fmt.Errorf("state %s: %w: %w", path, errUnreadable, err)
	}
	return k, nil
}
