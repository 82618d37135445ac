package daemon

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"

	"github.com/egressd/egressd/pkg/policy"
)

// Where a rule comes from. A rule set at run time wins over the policy
// file's rule of the same name, and a rule removed at run time stays
// removed across reloads until it is set again.
const (
	sourcePolicy = "policy"
	sourceCLI    = "cli"
)

// overrides are the changes made at run time, kept in the state directory
// so that they survive restarts.
type overrides struct {
	Set     []policy.Rule
	Removed []string
}

// with returns o with r set: it replaces a rule of its name, and undoes
// that name's removal.
func (o overrides) with(r policy.Rule) overrides {
	return overrides{
		Set:     append(slices.DeleteFunc(slices.Clone(o.Set), func(x policy.Rule) bool { return x.Name == r.Name }), r),
		Removed: slices.DeleteFunc(slices.Clone(o.Removed), func(n string) bool { return n == r.Name }),
	}
}

// without returns o with the rule named name gone: its run-time setting
// dropped and, when the policy file has one of that name, that one
// removed too.
func (o overrides) without(name string, inPolicy bool) overrides {
	out := overrides{
		Set:     slices.DeleteFunc(slices.Clone(o.Set), func(x policy.Rule) bool { return x.Name == name }),
		Removed: slices.DeleteFunc(slices.Clone(o.Removed), func(n string) bool { return n == name }),
	}
	if inPolicy {
		out.Removed = append(out.Removed, name)
	}
	return out
}

// effective merges the policy file with the overrides, then the
// Kubernetes rules less those of the objects refused: the rules in force
// and where each comes from.
func effective(p *policy.Policy, o overrides, k kubeRules, refused map[string]string) []*entry {
	removed := map[string]bool{}
	for _, n := range o.Removed {
		removed[n] = true
	}
	set := map[string]*policy.Rule{}
	for i := range o.Set {
		set[o.Set[i].Name] = &o.Set[i]
	}
	out := make([]*entry, 0, len(p.Rules)+len(o.Set)+len(k.rules))
	for i := range p.Rules {
		r := &p.Rules[i]
		if removed[r.Name] {
			continue
		}
		if o, ok := set[r.Name]; ok {
			out = append(out, &entry{spec: o, source: sourceCLI})
			delete(set, r.Name)
			continue
		}
		out = append(out, &entry{spec: r, source: sourcePolicy})
	}
	for i := range o.Set {
		r := &o.Set[i]
		if _, ok := set[r.Name]; ok && !removed[r.Name] {
			out = append(out, &entry{spec: r, source: sourceCLI})
		}
	}
	for i := range k.rules {
		if _, ok := refused[k.sources[i]]; !ok {
			out = append(out, &entry{spec: &k.rules[i], source: k.sources[i]})
		}
	}
	return out
}

type overridesFile struct {
	// Rules is a policy file of the rules set at run time.
	Rules   string   `json:"rules"`
	Removed []string `json:"removed"`
}

func overridesPath(dir string) string { return filepath.Join(dir, "overrides.json") }

func loadOverrides(dir string) (overrides, error) {
	var f overridesFile
	if found, err := readState(overridesPath(dir), &f); !found || err != nil {
		return overrides{}, err
	}
	p, err := policy.Parse([]byte(f.Rules))
	if err != nil {
		return overrides{}, fmt.Errorf("state %s: %w: %w", overridesPath(dir), errUnreadable, err)
	}
	return overrides{Set: p.Rules, Removed: f.Removed}, nil
}

// errUnreadable is a saved file that was read but does not parse (edited
// by hand, written by a newer egressd, damaged).
var errUnreadable = errors.New("unreadable")

// readState reads the JSON file of the state directory at path into f;
// found is false when there is none. A file that is not JSON of f's shape
// is errUnreadable.
func readState(path string, f any) (found bool, err error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("state: %w", err)
	}
	if err := json.Unmarshal(b, f); err != nil {
		return true, fmt.Errorf("state %s: %w: %w", path, errUnreadable, err)
	}
	return true, nil
}

// setAside moves an unreadable state file out of the way, so that the
// next save does not write over what a person may want to read, and says
// where to.
func setAside(path string, unreadable error) (string, error) {
	aside := path + ".unreadable"
	if err := os.Rename(path, aside); err != nil {
		return "", errors.Join(unreadable, fmt.Errorf("setting it aside: %w", err))
	}
	return aside, nil
}

// restoreOverrides takes the run-time limits saved in the state
// directory as the table's, before its first change. A file that does not
// parse is moved aside, so that the next `limit set` does not write over
// it, and the table starts with the policy alone, as the last load says:
// not starting would leave a rebooted host with no limits at all. Only a
// failed move stops the start.
func (t *table) restoreOverrides() error {
	o, err := loadOverrides(t.cfg.StateDir)
	if errors.Is(err, errUnreadable) {
		aside, serr := setAside(overridesPath(t.cfg.StateDir), err)
		if serr != nil {
			return serr
		}
		t.log.Error("run-time limits not read; set aside, and the daemon starts with the policy alone", "err", err, "aside", aside)
		t.startProblem(fmt.Sprintf("run-time limits not read (%v): set aside as %s", err, aside))
		o, err = overrides{}, nil
	}
	t.overrides = o
	return err
}

// save writes the overrides atomically and durably: a crash leaves the
// old file or the new one, never half of one, and once save returns, the
// new one.
func (o overrides) save(dir string) error {
	text, err := policy.Format(&policy.Policy{Rules: o.Set})
	if err != nil {
		return err
	}
	b, err := json.MarshalIndent(overridesFile{Rules: string(text), Removed: o.Removed}, "", "  ")
	if err != nil {
		return err
	}
	if err := makeDir(dir); err != nil {
		return fmt.Errorf("state: %w", err)
	}
	return writeAtomic(dir, overridesPath(dir), b)
}

// makeDir makes dir if it is missing, and syncs its parent, so that a
// crash does not lose the directory with the file written into it.
func makeDir(dir string) error {
	if _, err := os.Stat(dir); err == nil {
		return nil
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	return syncDir(filepath.Dir(dir))
}

// writeAtomic writes path through a temporary file in dir, synced and
// renamed over it, then syncs dir: until then a crash may undo the rename.
func writeAtomic(dir, path string, b []byte) (err error) {
	tmp, err := os.CreateTemp(dir, "."+filepath.Base(path)+"-*")
	if err != nil {
		return fmt.Errorf("state: %w", err)
	}
	defer os.Remove(tmp.Name())
	_, err = tmp.Write(b)
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), path)
	}
	if err != nil {
		return fmt.Errorf("state: %w", err)
	}
	if err := syncDir(dir); err != nil {
		return fmt.Errorf("state: %w: %w", errUnsynced, err)
	}
	return nil
}

// errUnsynced is a save that failed after its rename: the file holds what
// was refused until the old one is saved back.
var errUnsynced = errors.New("saved but not synced")

// syncDir makes dir's entries durable. A variable, so that a test can see
// when it runs.
var syncDir = func(dir string) error {
	f, err := os.Open(dir)
	if err != nil {
		return err
	}
	err = f.Sync()
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}
