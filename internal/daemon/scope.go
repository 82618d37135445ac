package daemon

import (
	"fmt"
	"io/fs"
	"path/filepath"
	"strings"

	"github.com/egressd/egressd/pkg/cgroups"
	"github.com/egressd/egressd/pkg/loader"
	"github.com/egressd/egressd/pkg/policy"
)

// scoped is a rule's scope as found in the cgroup tree: the kernel's
// scope, or why there is none now (the unit is not running, the cgroup
// does not exist).
type scoped struct {
	scope   loader.Scope
	pending string
}

// scopes finds the cgroup of each scope the rules name. It reads the
// cgroup tree, so it runs before the table's lock is taken.
func scopes(rules ...[]policy.Rule) map[policy.Scope]scoped {
	out := map[policy.Scope]scoped{}
	for _, rs := range rules {
		for _, r := range rs {
			if _, ok := out[r.Scope]; !ok {
				s, why := scopeOf(r.Scope)
				out[r.Scope] = scoped{s, why}
			}
		}
	}
	return out
}

// scopeOf finds a rule's cgroup; a non-empty reason means it has none now.
func scopeOf(s policy.Scope) (loader.Scope, string) {
	var dir string
	switch {
	case s.Unit != "":
		found, err := findUnit(s.Unit)
		if err != nil {
			return loader.Scope{}, fmt.Sprintf("unit %s: %v", s.Unit, err)
		}
		dir = found
	case s.Cgroup != "":
		var err error
		if dir, err = cgroups.Resolve(s.Cgroup); err != nil {
			return loader.Scope{}, err.Error()
		}
	default:
		return loader.Scope{}, ""
	}
	id, err := cgroups.ID(dir)
	if err != nil {
		return loader.Scope{}, fmt.Sprintf("cgroup %s does not exist", dir)
	}
	level, err := cgroups.Level(dir)
	if err != nil {
		return loader.Scope{}, err.Error()
	}
	return loader.Scope{CgroupID: id, Level: uint32(level)}, ""
}

// errNoUnit means no cgroup the daemon looks at carries the unit's name:
// it is not running, or its cgroup is deeper than the daemon looks.
var errNoUnit = fmt.Errorf("no cgroup at most %d levels deep (is it running?)", policy.UnitDepth)

// findUnit finds the cgroup systemd made for a unit: the directory of that
// name in the cgroup2 tree (system.slice/x.service, user.slice/…).
func findUnit(unit string) (string, error) {
	root, err := cgroups.Mount()
	if err != nil {
		return "", err
	}
	var found []string
	err = filepath.WalkDir(root, func(path string, de fs.DirEntry, err error) error {
		if err != nil || !de.IsDir() {
			return nil
		}
		if strings.Count(strings.TrimPrefix(path, root), "/") > policy.UnitDepth {
			return fs.SkipDir
		}
		if de.Name() == unit {
			found = append(found, path)
			return fs.SkipDir
		}
		return nil
	})
	switch {
	case err != nil:
		return "", err
	case len(found) == 0:
		return "", errNoUnit
	case len(found) > 1:
		return "", fmt.Errorf("several cgroups are named so: %s", strings.Join(found, ", "))
	}
	return found[0], nil
}
