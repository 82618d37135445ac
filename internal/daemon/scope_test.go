package daemon

import (
	"context"
	"fmt"
	"io/fs"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"testing/fstest"
	"time"

	"github.com/egressd/egressd/internal/privtest"
	"github.com/egressd/egressd/pkg/cgroups"
	"github.com/egressd/egressd/pkg/loader"
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
	got := cgroupTree{root: "/cg", fs: tree}.scopes(nil, rules)
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

// TestUnitOutsideUsersTrees: a cgroup of a system unit's name in a user's
// delegated tree, which any user can make, does not shadow the system
// unit's; a user unit is found there when no other cgroup has its name.
func TestUnitOutsideUsersTrees(t *testing.T) {
	const user = "user.slice/user-1000.slice/user@1000.service/"
	for _, tc := range []struct {
		name string
		tree []string
		want string
	}{
		{
			name: "a system unit and a user's of its name",
			tree: []string{"system.slice/x.service", user + "app.slice/x.service"},
			want: "cgroup /cg/system.slice/x.service does not exist",
		},
		{
			name: "a user unit alone",
			tree: []string{user + "app.slice/x.service"},
			want: "cgroup /cg/" + user + "app.slice/x.service does not exist",
		},
		{
			name: "two users' units",
			tree: []string{user + "app.slice/x.service", "user.slice/user-1001.slice/user@1001.service/x.service"},
			want: "unit x.service: several cgroups are named so: /cg/" + user + "app.slice/x.service, /cg/user.slice/user-1001.slice/user@1001.service/x.service",
		},
		{
			name: "two system units",
			tree: []string{"a.slice/x.service", "b.slice/x.service"},
			want: "unit x.service: several cgroups are named so: /cg/a.slice/x.service, /cg/b.slice/x.service",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tree := fstest.MapFS{}
			for _, dir := range tc.tree {
				tree[dir+"/cgroup.procs"] = &fstest.MapFile{}
			}
			s := policy.Scope{Unit: "x.service"}
			got := cgroupTree{root: "/cg", fs: tree}.scopes(nil, []policy.Rule{{Scope: s}})
			if p := got[s].pending; p != tc.want {
				t.Errorf("pending %q, want %q", p, tc.want)
			}
		})
	}
}

// TestUnitKeepsEnforcedCgroup: a second cgroup of a unit's name (a
// container's systemd made one) leaves the rule on the cgroup it is
// enforced in, where it went pending and the limit was lifted.
func TestUnitKeepsEnforcedCgroup(t *testing.T) {
	privtest.RequireHostRoot(t, "creates cgroups")
	base := privtest.Cgroup(t, "units")
	unit := filepath.Base(base) + ".service"
	first := privtest.SubCgroup(t, privtest.SubCgroup(t, base, "a.slice"), unit)
	id, err := cgroups.ID(first)
	if err != nil {
		t.Fatal(err)
	}
	td := newTestDaemon(t)
	td.apply(t, "rules:\n  - {name: pay, destination: 10.0.0.1, unit: "+unit+", concurrency: 1}\n")
	privtest.SubCgroup(t, privtest.SubCgroup(t, base, "b.slice"), unit)
	td.table.refresh(context.Background(), time.Now(), true)
	r, ok := td.fake.rule("pay")
	if !ok || r.Scope.CgroupID != id {
		t.Errorf("rule in the kernel %v, in cgroup %d; want it in %d (%s): %q", ok, r.Scope.CgroupID, id, first, td.state()["pay"])
	}
}

// TestChangeAfterUnitRestart: a change whose cgroups were found before a
// unit restarted and a reload took its new cgroup looks again, where it
// put the old, dead cgroup back until the next refresh.
func TestChangeAfterUnitRestart(t *testing.T) {
	privtest.RequireHostRoot(t, "creates cgroups")
	base := privtest.Cgroup(t, "restart")
	unit := filepath.Base(base) + ".service"
	svc := privtest.SubCgroup(t, base, unit)
	td := newTestDaemon(t)
	ctx := context.Background()
	writeFile(t, td.cfg.PolicyFile, "rules:\n  - {name: s, destination: 10.0.0.1, unit: "+unit+", concurrency: 1}\n")
	if _, err := td.reloadPolicy(ctx); err != nil {
		t.Fatal(err)
	}
	f := td.table.prepare(ctx, time.Now()) // a refresh looks for the unit...
	if err := os.Remove(svc); err != nil { // ...which restarts...
		t.Fatal(err)
	}
	if err := os.Mkdir(svc, 0o755); err != nil {
		t.Fatal(err)
	}
	id, err := cgroups.ID(svc)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := td.reloadPolicy(ctx); err != nil { // ...a reload takes the new cgroup...
		t.Fatal(err)
	}
	err = td.table.change(ctx, f, func(f found) ([]retired, error) { // ...then the refresh applies.
		return td.table.applyLocked(td.table.policy, td.table.applied, f)
	})
	if err != nil {
		t.Fatal(err)
	}
	if r, _ := td.fake.rule("s"); r.Scope.CgroupID != id {
		t.Errorf("rule in cgroup %d, want the unit's new one, %d: %q", r.Scope.CgroupID, id, td.state()["s"])
	}
}

// TestScopeOutsideAttachedCgroup: a rule scoped to a cgroup outside the one
// the datapath is attached to is pending, with why: installed, it looked
// enforced and matched nothing, since no socket there reaches egressd's
// programs. A cgroup whose name only begins as the attached one's is
// outside too.
func TestScopeOutsideAttachedCgroup(t *testing.T) {
	tree := fstest.MapFS{}
	for _, dir := range []string{"in/a/x.service", "inner/y.service", "out/z.service"} {
		tree[dir+"/cgroup.procs"] = &fstest.MapFile{}
	}
	var rules []policy.Rule
	for _, u := range []string{"x.service", "y.service", "z.service"} {
		rules = append(rules, policy.Rule{Scope: policy.Scope{Unit: u}})
	}
	got := cgroupTree{root: "/cg", fs: tree, attach: "/cg/in"}.scopes(nil, rules)
	want := map[string]string{
		"x.service": "cgroup /cg/in/a/x.service does not exist", // inside: looked up
		"y.service": "cgroup /cg/inner/y.service is outside /cg/in, the cgroup egressd is attached to",
		"z.service": "cgroup /cg/out/z.service is outside /cg/in, the cgroup egressd is attached to",
	}
	for u, why := range want {
		if p := got[policy.Scope{Unit: u}].pending; p != why {
			t.Errorf("unit %s: pending %q, want %q", u, p, why)
		}
	}
}

// The same through the table, with cgroups that exist: the rule inside is
// installed, the one outside pending.
func TestRuleOutsideAttachedCgroupPending(t *testing.T) {
	privtest.RequireHostRoot(t, "creates cgroups")
	base := privtest.Cgroup(t, "attached")
	in := privtest.SubCgroup(t, base, "in")
	inside := privtest.SubCgroup(t, in, "app")
	outside := privtest.SubCgroup(t, base, "other")
	td := newTestDaemon(t)
	td.cfg.Cgroup = in
	td.apply(t, "rules:\n  - {name: inside, destination: 10.0.0.1, cgroup: "+inside+", concurrency: 1}\n"+
		"  - {name: outside, destination: 10.0.0.1, cgroup: "+outside+", concurrency: 1}\n")
	if _, ok := td.fake.rule("inside"); !ok {
		t.Errorf("the rule scoped inside the attached cgroup is not in the kernel: %q", td.state()["inside"])
	}
	if _, ok := td.fake.rule("outside"); ok || !strings.Contains(td.table.entries["outside"].pending, "is outside") {
		t.Errorf("the rule scoped outside the attached cgroup: in the kernel %v, pending %q; want pending, outside", ok, td.table.entries["outside"].pending)
	}
}

// TestStartKeepsAdoptedCgroup: a daemon that starts on the datapath a
// previous one left pinned keeps a unit's rule on the cgroup the adopted
// kernel rule enforces it in, of the several of the unit's name, where it
// went pending and the limit was lifted across the restart. A cgroup gone
// since, or not of the unit's name, counts for nothing.
func TestStartKeepsAdoptedCgroup(t *testing.T) {
	privtest.RequireHostRoot(t, "creates cgroups")
	for _, tc := range []struct {
		name    string
		slices  []string // each with a cgroup of the unit's name
		adopted string   // the adopted rule's cgroup: a slice's, "gone" (removed before the start) or "other" (another unit's)
		want    string   // a slice's cgroup, "several" or "none" (pending)
	}{
		{"kept in the first of two", []string{"a.slice", "b.slice"}, "a.slice", "a.slice"},
		{"kept in the second of two", []string{"a.slice", "b.slice"}, "b.slice", "b.slice"},
		{"adopted gone, two left", []string{"a.slice", "b.slice"}, "gone", "several"},
		{"adopted gone, one left", []string{"a.slice"}, "gone", "a.slice"},
		{"adopted gone, none left", nil, "gone", "none"},
		{"adopted another unit's", []string{"a.slice", "b.slice"}, "other", "several"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			base := privtest.Cgroup(t, "adopt")
			unit := filepath.Base(base) + ".service"
			ids := map[string]uint64{}
			var named []string
			for _, s := range append(tc.slices, "gone") {
				dir := privtest.SubCgroup(t, privtest.SubCgroup(t, base, s), unit)
				ids[s], named = cgroupID(t, dir), append(named, dir)
			}
			ids["other"] = cgroupID(t, privtest.SubCgroup(t, privtest.SubCgroup(t, base, "other.slice"), "other.service"))
			if err := os.Remove(named[len(named)-1]); err != nil { // gone
				t.Fatal(err)
			}
			named = named[:len(named)-1]
			td := newTestDaemon(t)
			td.fake.adopted = true
			td.fake.rules["pay"] = loader.Rule{Name: "pay", Scope: loader.Scope{CgroupID: ids[tc.adopted]}, Dests: []netip.Prefix{netip.MustParsePrefix("10.0.0.1/32")}, Limit: 1}
			writeFile(t, td.cfg.PolicyFile, "rules:\n  - {name: pay, destination: 10.0.0.1, unit: "+unit+", concurrency: 1}\n")
			td.start(t)
			want := map[string]string{
				"several": "pending: unit " + unit + ": several cgroups are named so: " + strings.Join(named, ", "),
				"none":    "pending: unit " + unit + ": " + errNoUnit.Error(),
			}
			for s, id := range ids {
				want[s] = fmt.Sprintf("cgroup %d", id)
			}
			if got := td.enforcedIn("pay"); got != want[tc.want] {
				t.Errorf("rule %s; want %s", got, want[tc.want])
			}
		})
	}
}

func cgroupID(t *testing.T, dir string) uint64 {
	t.Helper()
	id, err := cgroups.ID(dir)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// enforcedIn is the cgroup the kernel enforces a rule in, or why the
// rule is pending.
func (td *testDaemon) enforcedIn(name string) string {
	if st := td.state()[name]; strings.HasPrefix(st, "pending: ") {
		return st
	}
	r, _ := td.fake.rule(name)
	return fmt.Sprintf("cgroup %d", r.Scope.CgroupID)
}
