package daemon

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
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

// kubeFile is kubeRules as saved: a policy file of the rules, each name
// without policy.KubePrefix, which a file cannot give.
type kubeFile struct {
	Rules   string   `json:"rules"`
	Sources []string `json:"sources"`
}

// save writes k less the objects refused, which clash with other rules,
// atomically and durably, as overrides.save does.
func (k kubeRules) save(dir string, refused map[string]string) error {
	var f kubeFile
	var rules []policy.Rule
	for i, r := range k.rules {
		if _, ok := refused[k.sources[i]]; ok {
			continue
		}
		r.Name = strings.TrimPrefix(r.Name, policy.KubePrefix)
		rules = append(rules, r)
		f.Sources = append(f.Sources, k.sources[i])
	}
	text, err := policy.Format(&policy.Policy{Rules: rules})
	if err != nil {
		return err
	}
	f.Rules = string(text)
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
		aside := path + ".unreadable"
		if rerr := os.Rename(path, aside); rerr != nil {
			return errors.Join(err, fmt.Errorf("setting it aside: %w", rerr))
		}
		t.log.Error("saved Kubernetes rules not read; set aside, and they come from the API server", "err", err, "aside", aside)
		k, err = kubeRules{}, nil
	}
	t.kube = k
	return err
}

func loadKube(path string) (kubeRules, error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return kubeRules{}, nil
	}
	if err != nil {
		return kubeRules{}, fmt.Errorf("state: %w", err)
	}
	var f kubeFile
	if err := json.Unmarshal(b, &f); err != nil {
		return kubeRules{}, fmt.Errorf("state %s: %w: %w", path, errUnreadable, err)
	}
	p, err := policy.Parse([]byte(f.Rules))
	if err == nil && len(p.Rules) != len(f.Sources) {
		err = fmt.Errorf("%d rules and %d sources", len(p.Rules), len(f.Sources))
	}
	if err != nil {
		return kubeRules{}, fmt.Errorf("state %s: %w: %w", path, errUnreadable, err)
	}
	for i := range p.Rules {
		p.Rules[i].Name = policy.KubePrefix + p.Rules[i].Name
	}
	return kubeRules{rules: p.Rules, sources: f.Sources}, nil
}
