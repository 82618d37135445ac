package daemon

import (
	"io/fs"
	"testing"
	"testing/fstest"

	"github.com/egressd/egressd/pkg/policy"
)

// readCounter counts the directories read in a file system.
type readCounter struct {
	fstest.MapFS
	reads map[string]int
}

func (c readCounter) ReadDir(name string) ([]fs.DirEntry, error) {
	c.reads[name]++
	return c.MapFS.ReadDir(name)
}

// TestUnitsFoundInOneWalk: the cgroups of every unit the rules name are
// looked for in one walk of the tree, not one walk per unit.
func TestUnitsFoundInOneWalk(t *testing.T) {
	tree := readCounter{fstest.MapFS{
		"system.slice/a.service/cgroup.procs": {},
		"system.slice/b.service/cgroup.procs": {},
		"user.slice/c.service/cgroup.procs":   {},
	}, map[string]int{}}
	var rules []policy.Rule
	for _, u := range []string{"a.service", "b.service", "c.service", "absent.service"} {
		rules = append(rules, policy.Rule{Scope: policy.Scope{Unit: u}})
	}
	got := cgroupTree{root: "/cg", fs: tree}.scopes(rules)
	if n := tree.reads["."]; n != 1 {
		t.Errorf("the tree's root was read %d times, want 1", n)
	}
	want := map[string]string{
		"a.service":      "cgroup /cg/system.slice/a.service does not exist",
		"b.service":      "cgroup /cg/system.slice/b.service does not exist",
		"c.service":      "cgroup /cg/user.slice/c.service does not exist",
		"absent.service": "unit absent.service: " + errNoUnit.Error(),
	}
	for u, why := range want {
		if p := got[policy.Scope{Unit: u}].pending; p != why {
			t.Errorf("unit %s: pending %q, want %q", u, p, why)
		}
	}
}
