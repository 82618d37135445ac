package daemon

import (
	"fmt"
	"io/fs"
	"os"
	"path"
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

// scopes finds the cgroup of each scope the rules name; attach is the
// cgroup the datapath is attached to (empty: the root), enforced is the
// table's, what it enforces the rules in now. It reads the cgroup tree, so
// it runs before the table's lock is taken.
func scopes(attach string, enforced map[policy.Scope]scoped, rules ...[]policy.Rule) map[policy.Scope]scoped {
	return mountedTree(attach).scopes(enforced, rules...)
}

// scopeOf finds one scope's cgroup; a non-empty reason means it has none
// now.
func scopeOf(attach string, s policy.Scope, enforced map[policy.Scope]scoped) (loader.Scope, string) {
	sc := scopes(attach, enforced, []policy.Rule{{Scope: s}})[s]
	return sc.scope, sc.pending
}

// cgroupTree is the cgroup2 hierarchy, where units' cgroups are looked for.
type cgroupTree struct {
	root string // its mount point
	fs   fs.FS  // the same, to walk
	err  error  // why there is none
	// attach is the directory of the cgroup the datapath is attached to,
	// "" for the root: the programs never see a socket of a cgroup
	// outside it.
	attach string
}

func mountedTree(attach string) cgroupTree {
	root, err := cgroups.Mount()
	t := cgroupTree{root: root, fs: os.DirFS(root), err: err}
	if attach != "" && err == nil {
		// The datapath resolved it the same way to attach: it exists.
		t.attach, _ = cgroups.Resolve(attach)
	}
	return t
}

// scopes finds the cgroup of each scope the rules name, walking the tree
// once for all their units rather than once per unit, which every change
// of a table of many units' rules would pay for again.
func (t cgroupTree) scopes(enforced map[policy.Scope]scoped, rules ...[]policy.Rule) map[policy.Scope]scoped {
	units := map[string]*unitDirs{}
	for _, rs := range rules {
		for _, r := range rs {
			if r.Scope.Unit != "" {
				units[r.Scope.Unit] = &unitDirs{}
			}
		}
	}
	if len(units) > 0 && t.err == nil {
		t.findUnits(units)
	}
	out := map[policy.Scope]scoped{}
	for _, rs := range rules {
		for _, r := range rs {
			if _, ok := out[r.Scope]; !ok {
				var named []string
				if u := units[r.Scope.Unit]; u != nil {
					named = u.candidates()
				}
				s, why := t.scopeOf(r.Scope, named, enforced[r.Scope])
				out[r.Scope] = scoped{s, why}
			}
		}
	}
	return out
}

// scopeOf finds a rule's cgroup, given the directories its unit's cgroup
// is taken from if it names one, and the scope the table has for it now;
// a non-empty reason means it has none now.
func (t cgroupTree) scopeOf(s policy.Scope, named []string, now scoped) (loader.Scope, string) {
	var dir string
	switch {
	case s.Unit != "" && t.err != nil:
		return loader.Scope{}, fmt.Sprintf("unit %s: %v", s.Unit, t.err)
	case s.Unit != "" && len(named) == 0:
		return loader.Scope{}, fmt.Sprintf("unit %s: %v", s.Unit, errNoUnit)
	case s.Unit != "" && len(named) > 1:
		// A cgroup of the unit's name made later (by a container's
		// systemd) does not take the limit off the one in force.
		if dir = enforcedDir(named, now); dir == "" {
			return loader.Scope{}, fmt.Sprintf("unit %s: several cgroups are named so: %s", s.Unit, strings.Join(named, ", "))
		}
	case s.Unit != "":
		dir = named[0]
	case s.Cgroup != "":
		var err error
		if dir, err = cgroups.Resolve(s.Cgroup); err != nil {
			return loader.Scope{}, err.Error()
		}
	default:
		return loader.Scope{}, ""
	}
	if t.attach != "" && dir != t.attach && !strings.HasPrefix(dir, t.attach+"/") {
		// Installed, the rule would look enforced and match nothing.
		return loader.Scope{}, fmt.Sprintf("cgroup %s is outside %s, the cgroup egressd is attached to", dir, t.attach)
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

// adoptedScopes is, for the first table of a daemon that adopted a
// pinned datapath, the scopes the previous daemon's kernel rules enforce
// the rules' units in: what the table enforces them in now, so that a
// unit with several cgroups of its name keeps the one its limit is in
// force in rather than go pending across the restart. Rules are matched
// to kernel rules by name, and a unit takes the first rule's it finds.
func (t *table) adoptedScopes(rules ...[]policy.Rule) map[policy.Scope]scoped {
	out := map[policy.Scope]scoped{}
	for _, rs := range rules {
		for _, r := range rs {
			if _, ok := out[r.Scope]; ok || r.Scope.Unit == "" {
				continue
			}
			if kr, err := t.dp.Rule(r.Name); err == nil && !kr.Scope.HostWide() {
				out[r.Scope] = scoped{scope: kr.Scope}
			}
		}
	}
	return out
}

// errNoUnit means no cgroup the daemon looks at carries the unit's name:
// it is not running, or its cgroup is deeper than the daemon looks.
var errNoUnit = fmt.Errorf("no cgroup at most %d levels deep (is it running?)", policy.UnitDepth)

// enforcedDir is the one of dirs whose cgroup the table enforces rules in
// now, or "".
func enforcedDir(dirs []string, now scoped) string {
	if now.pending != "" || now.scope.CgroupID == 0 {
		return ""
	}
	for _, dir := range dirs {
		if id, err := cgroups.ID(dir); err == nil && id == now.scope.CgroupID {
			return dir
		}
	}
	return ""
}

// unitDirs are the directories named as a unit, outside and inside the
// trees systemd delegates to users' managers (user@UID.service), where
// any user can make a cgroup of any name.
type unitDirs struct{ outside, delegated []string }

// candidates are the directories the unit's cgroup is taken from: a
// user's cgroup does not shadow a system unit's, but a user unit is
// found where no other has its name.
func (u *unitDirs) candidates() []string {
	if len(u.outside) > 0 {
		return u.outside
	}
	return u.delegated
}

// findUnits finds the cgroups systemd made for the units that are keys of
// units: the directories of their names in the tree (system.slice/x.service,
// user.slice/…), at most policy.UnitDepth levels deep.
func (t cgroupTree) findUnits(units map[string]*unitDirs) {
	fs.WalkDir(t.fs, ".", func(path string, de fs.DirEntry, err error) error {
		if err != nil || !de.IsDir() {
			return nil
		}
		if strings.Count(path, "/") >= policy.UnitDepth {
			return fs.SkipDir
		}
		if u := units[de.Name()]; u != nil {
			dir := filepath.Join(t.root, filepath.FromSlash(path))
			if delegated(path) {
				u.delegated = append(u.delegated, dir)
			} else {
				u.outside = append(u.outside, dir)
			}
			return fs.SkipDir
		}
		return nil
	})
}

// delegated is whether the cgroup at rel (slash-separated, from the root)
// is below a user's manager, user@UID.service.
func delegated(rel string) bool {
	parents, _ := path.Split(rel)
	for _, p := range strings.Split(parents, "/") {
		if strings.HasPrefix(p, "user@") && strings.HasSuffix(p, ".service") {
			return true
		}
	}
	return false
}
