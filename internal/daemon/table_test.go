package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/internal/dns"
	"github.com/egressd/egressd/internal/redistest"
	"github.com/egressd/egressd/pkg/adaptive"
	"github.com/egressd/egressd/pkg/control"
	"github.com/egressd/egressd/pkg/loader"
	"github.com/egressd/egressd/pkg/policy"
)

// testDaemon is a daemon on the fake datapath, with a hosts file of its
// own for host-name destinations (and no DNS server: a closed port).
type testDaemon struct {
	*Daemon
	fake   *fakeDatapath
	dir    string
	hosts  string
	notify *testNotifier
	// done is closed when Run, started by start, returns runErr.
	done   <-chan struct{}
	runErr error
}

// testNotifier passes on what the daemon tells the service manager, for
// tests to wait on. Ready and Reloading block once 64 are unread, more
// than any test causes.
type testNotifier struct {
	ready, reloading chan struct{}
}

func newTestNotifier() *testNotifier {
	return &testNotifier{ready: make(chan struct{}, 64), reloading: make(chan struct{}, 64)}
}

func (n *testNotifier) Ready()                                { n.ready <- struct{}{} }
func (n *testNotifier) Reloading()                            { n.reloading <- struct{}{} }
func (*testNotifier) Stopping()                               {}
func (*testNotifier) Watchdog()                               {}
func (*testNotifier) WatchdogInterval() (time.Duration, bool) { return 0, false }

// await waits for the daemon, started by start, to say what ch carries,
// failing the test once Run returns or after a minute: a bound for a hang
// only, as a large policy under -race on a loaded machine starts in more
// than 10 s.
func (td *testDaemon) await(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-td.done:
		t.Fatalf("the daemon stopped before it was %s: run: %v", what, td.runErr)
	case <-time.After(time.Minute):
		t.Fatalf("the daemon was not %s within a minute", what)
	}
}

func newTestDaemon(t testing.TB) *testDaemon {
	t.Helper()
	dir := t.TempDir()
	td := &testDaemon{fake: newFake(), dir: dir, hosts: filepath.Join(dir, "hosts"), notify: newTestNotifier()}
	writeFile(t, td.hosts, "")
	writeFile(t, filepath.Join(dir, "policy.yaml"), "rules: []\n")
	d, err := New(Config{
		PolicyFile: filepath.Join(dir, "policy.yaml"), StateDir: filepath.Join(dir, "state"), Socket: filepath.Join(dir, "sock"),
		HostID: "test-host", Version: "test", Logger: slog.New(slog.DiscardHandler),
		Resolver: &dns.Resolver{HostsFile: td.hosts, Servers: []string{"127.0.0.1:1"}, Timeout: 100 * time.Millisecond, MinTTL: time.Second, MaxTTL: time.Second},
		Notify:   td.notify,
		open:     td.fake.open,
	})
	if err != nil {
		t.Fatal(err)
	}
	d.useDatapath(td.fake)
	td.Daemon = d
	t.Cleanup(func() { d.table.endShares(true); d.redis.close() })
	return td
}

// logTo makes l the log of every part.
func (td *testDaemon) logTo(l *slog.Logger) {
	td.log, td.file.log, td.table.log, td.metrics.log, td.api.log = l, l, l, l, l
}

// useResolver makes r the resolver host names are looked up with, from
// the names the state directory keeps.
func (td *testDaemon) useResolver(r *dns.Resolver) {
	td.cfg.Resolver = r
	td.names = newNames(r, td.cfg.StateDir, td.log)
	td.table.names = td.names
}

func writeFile(t testing.TB, path, text string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
}

func parse(t testing.TB, text string) *policy.Policy {
	t.Helper()
	p, err := policy.Parse([]byte(text))
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// state describes the table: each rule, installed with its destinations
// and limit, or pending with why.
func (td *testDaemon) state() map[string]string {
	td.table.mu.Lock()
	defer td.table.mu.Unlock()
	out := map[string]string{}
	for name, e := range td.table.entries {
		if !e.installed() {
			out[name] = "pending: " + e.pending
			continue
		}
		r, ok := td.fake.rule(name)
		if !ok {
			out[name] = "installed, but not in the kernel"
			continue
		}
		var dests []string
		for _, p := range r.Dests {
			dests = append(dests, p.String())
		}
		out[name] = strings.Join(dests, ",") + " " + r.Shape.String() + " " + strconv.Itoa(int(r.Limit)) + " (" + e.source + ")"
	}
	return out
}

// TestAdaptiveResumesPinnedLimit: a daemon that starts on the rules a
// previous one left pinned starts each adaptive loop at the limit the
// previous loop left in the kernel (within the rule's Minimum and
// Maximum), not at Initial: a restart does not lift a limit lowered for a
// struggling dependency. A rule the kernel had with a fixed limit, or none,
// starts at Initial; so does a rule changed while this daemon runs.
func TestAdaptiveResumesPinnedLimit(t *testing.T) {
	dest := []netip.Prefix{netip.MustParsePrefix("10.0.0.2/32")}
	for _, tc := range []struct {
		name   string
		pinned *loader.Rule
		rule   string
		want   string
	}{
		{"lowered by the previous loop", &loader.Rule{Name: "dep", Shape: loader.ShapeConcurrency, Limit: 6, Samples: true, Dests: dest},
			"adaptive: {}", "10.0.0.2/32 concurrency 6 (policy)"},
		{"above the rule's maximum now", &loader.Rule{Name: "dep", Shape: loader.ShapeConcurrency, Limit: 90, Samples: true, Dests: dest},
			"adaptive: {maximum: 50}", "10.0.0.2/32 concurrency 50 (policy)"},
		{"below the rule's minimum now", &loader.Rule{Name: "dep", Shape: loader.ShapeConcurrency, Limit: 2, Samples: true, Dests: dest},
			"adaptive: {minimum: 5}", "10.0.0.2/32 concurrency 5 (policy)"},
		{"a fixed limit before", &loader.Rule{Name: "dep", Shape: loader.ShapeConcurrency, Limit: 3, Dests: dest},
			"adaptive: {}", "10.0.0.2/32 concurrency 20 (policy)"},
		{"nothing pinned", nil, "adaptive: {initial: 7}", "10.0.0.2/32 concurrency 7 (policy)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			td := newTestDaemon(t)
			if tc.pinned != nil {
				td.fake.adopted = true
				td.fake.rules["dep"] = *tc.pinned
			}
			if err := td.table.install(context.Background(), parse(t, "rules:\n  - {name: dep, destination: 10.0.0.2, "+tc.rule+"}\n"), time.Now()); err != nil {
				t.Fatal(err)
			}
			if got := td.state()["dep"]; got != tc.want {
				t.Errorf("dep: %s, want %s", got, tc.want)
			}
			// Changed while this daemon runs: the new loop starts at
			// Initial, as documented.
			if err := td.table.install(context.Background(), parse(t, "rules:\n  - {name: dep, destination: 10.0.0.2, adaptive: {initial: 9}}\n"), time.Now()); err != nil {
				t.Fatal(err)
			}
			if got := td.state()["dep"]; got != "10.0.0.2/32 concurrency 9 (policy)" {
				t.Errorf("dep changed: %s, want it at its initial 9", got)
			}
		})
	}
}

// TestInstall: a policy file and the run-time changes become the table,
// each rule in the kernel or pending with the reason.
func TestInstall(t *testing.T) {
	tests := []struct {
		name   string
		policy string
		set    []string // rules set at run time, as policy YAML items
		remove []string // rules removed at run time
		hosts  string
		want   map[string]string
	}{{
		name:   "prefix and port",
		policy: "rules:\n  - {name: db, destination: 10.0.0.0/8, port: 5432, concurrency: 5}\n",
		want:   map[string]string{"db": "10.0.0.0/8 concurrency 5 (policy)"},
	}, {
		name:   "a host name, from the hosts file",
		policy: "rules:\n  - {name: api, destination: api.test, perSecond: {permits: 9}}\n",
		hosts:  "10.1.1.1 api.test\n10.1.1.2 api.test\n",
		want:   map[string]string{"api": "10.1.1.1/32,10.1.1.2/32 per_second 9 (policy)"},
	}, {
		name:   "a host name that does not resolve is pending",
		policy: "rules:\n  - {name: api, destination: api.test, concurrency: 1}\n",
		want:   map[string]string{"api": "pending: host api.test has no addresses yet"},
	}, {
		name:   "a unit that is not running is pending",
		policy: "rules:\n  - {name: svc, destination: 10.0.0.1, unit: egressd-test-absent.service, concurrency: 1}\n",
		want:   map[string]string{"svc": "pending: unit egressd-test-absent.service: no cgroup at most 6 levels deep (is it running?)"},
	}, {
		name:   "an adaptive rule starts at its initial limit",
		policy: "rules:\n  - {name: dep, destination: 10.0.0.2, adaptive: {initial: 7}}\n",
		want:   map[string]string{"dep": "10.0.0.2/32 concurrency 7 (policy)"},
	}, {
		name:   "a rule set at run time wins over the file's",
		policy: "rules:\n  - {name: db, destination: 10.0.0.1, concurrency: 5}\n",
		set:    []string{"{name: db, destination: 10.0.0.1, concurrency: 2}", "{name: new, destination: 10.0.0.3, concurrency: 3}"},
		want:   map[string]string{"db": "10.0.0.1/32 concurrency 2 (cli)", "new": "10.0.0.3/32 concurrency 3 (cli)"},
	}, {
		name:   "a rule removed at run time stays removed",
		policy: "rules:\n  - {name: db, destination: 10.0.0.1, concurrency: 5}\n  - {name: web, destination: 10.0.0.2, concurrency: 5}\n",
		remove: []string{"db"},
		want:   map[string]string{"web": "10.0.0.2/32 concurrency 5 (policy)"},
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			td := newTestDaemon(t)
			writeFile(t, td.hosts, tt.hosts)
			for _, r := range tt.set {
				td.table.overrides = td.table.overrides.with(parse(t, "rules:\n  - "+r+"\n").Rules[0])
			}
			for _, n := range tt.remove {
				td.table.overrides = td.table.overrides.without(n, true)
			}
			if err := td.table.install(context.Background(), parse(t, tt.policy), time.Now()); err != nil {
				t.Fatal(err)
			}
			if got := td.state(); !equalMaps(got, tt.want) {
				t.Errorf("table %v, want %v", got, tt.want)
			}
		})
	}
}

func equalMaps(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

// TestInstallWholeOrNothing: a policy with a problem, or a kernel that
// refuses the write, changes nothing.
func TestInstallWholeOrNothing(t *testing.T) {
	td := newTestDaemon(t)
	good := "rules:\n  - {name: db, destination: 10.0.0.1, concurrency: 5}\n"
	if err := td.table.install(context.Background(), parse(t, good), time.Now()); err != nil {
		t.Fatal(err)
	}
	before, syncs := td.state(), td.fake.syncs

	// A run-time rule on the same traffic as the file's: the policy's
	// check refuses it.
	clash := parse(t, "rules:\n  - {name: again, destination: 10.0.0.1, concurrency: 1}\n").Rules[0]
	if err := td.table.set(context.Background(), clash, time.Now()); !errors.Is(err, policy.ErrInvalid) {
		t.Errorf("a run-time rule on the file's destination = %v, want a policy error", err)
	}
	// The kernel refuses the write.
	td.fake.fail(errWrite)
	if err := td.table.install(context.Background(), parse(t, "rules:\n  - {name: db, destination: 10.0.0.1, concurrency: 9}\n"), time.Now()); !errors.Is(err, errWrite) {
		t.Errorf("install the kernel refused = %v, want its error", err)
	}
	td.fake.fail(nil)
	if got := td.state(); !equalMaps(got, before) || td.fake.syncs != syncs {
		t.Errorf("after refused installs: table %v (was %v), %d syncs (was %d)", got, before, td.fake.syncs, syncs)
	}
}

// TestRunTimeChanges: a rule set or removed at run time is kept in the
// state directory, survives a reload of the file, and a change whose state
// cannot be saved is not made in the kernel either.
func TestRunTimeChanges(t *testing.T) {
	td := newTestDaemon(t)
	file := "rules:\n  - {name: db, destination: 10.0.0.1, concurrency: 5}\n"
	writeFile(t, td.cfg.PolicyFile, file)
	if err := td.table.install(context.Background(), parse(t, file), time.Now()); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := td.table.set(ctx, parse(t, "rules:\n  - {name: web, destination: 10.0.0.2, concurrency: 3}\n").Rules[0], time.Now()); err != nil {
		t.Fatal(err)
	}
	if err := td.table.remove(ctx, "db", time.Now()); err != nil {
		t.Fatal(err)
	}
	if err := td.table.remove(ctx, "nope", time.Now()); !errors.Is(err, errUnknownRule) {
		t.Errorf("remove of an unknown rule = %v, want errUnknownRule", err)
	}
	if _, err := td.reloadPolicy(ctx); err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"web": "10.0.0.2/32 concurrency 3 (cli)"}
	if got := td.state(); !equalMaps(got, want) {
		t.Errorf("after set, remove and reload: %v, want %v", got, want)
	}
	saved, err := loadOverrides(td.cfg.StateDir)
	if err != nil || len(saved.Set) != 1 || saved.Set[0].Name != "web" || !slices.Equal(saved.Removed, []string{"db"}) {
		t.Errorf("state saved %+v, %v; want web set and db removed", saved, err)
	}

	// The state directory cannot be written: the change is not made.
	td.cfg.StateDir = filepath.Join(td.cfg.PolicyFile, "state") // below a file
	if err := td.table.set(ctx, parse(t, "rules:\n  - {name: more, destination: 10.0.0.3, concurrency: 1}\n").Rules[0], time.Now()); err == nil {
		t.Error("a change whose state cannot be saved succeeded")
	}
	if _, ok := td.fake.rule("more"); ok {
		t.Error("a change whose state could not be saved is in the kernel")
	}
	if got := td.state(); !equalMaps(got, want) {
		t.Errorf("after an unsaved change: %v, want %v", got, want)
	}
}

// TestSaveIsDurable: saving the run-time limits syncs the state directory
// after the rename, so that a crash cannot bring the old file back, and
// syncs its parent when it made the directory.
func TestSaveIsDurable(t *testing.T) {
	parent := t.TempDir()
	dir := filepath.Join(parent, "state")
	var synced []string // each directory synced, with the rules saved by then
	orig := syncDir
	t.Cleanup(func() { syncDir = orig })
	syncDir = func(d string) error {
		o, err := loadOverrides(dir)
		if err != nil {
			t.Error(err)
		}
		names := []string{}
		for _, r := range o.Set {
			names = append(names, r.Name)
		}
		synced = append(synced, fmt.Sprintf("%s %v", d, names))
		return orig(d)
	}
	steps := []struct {
		set  string
		want []string
	}{
		{"{name: a, destination: 10.0.0.1, concurrency: 1}", []string{parent + " []", dir + " [a]"}},
		{"{name: b, destination: 10.0.0.2, concurrency: 1}", []string{dir + " [a b]"}},
	}
	var o overrides
	for _, s := range steps {
		synced = nil
		o = o.with(parse(t, "rules:\n  - "+s.set+"\n").Rules[0])
		if err := o.save(dir); err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(synced, s.want) {
			t.Errorf("saving %s synced %q, want %q", s.set, synced, s.want)
		}
	}
}

// TestRefusedRunTimeChangeLeavesAllAsItWas: a limit set refused because
// its state cannot be saved, or because the kernel refuses it, leaves all
// as it was: the kernel never has it, an adaptive rule keeps its loop and
// the limit it learned, a shared rule its share, and the state directory
// the limits saved before.
func TestRefusedRunTimeChangeLeavesAllAsItWas(t *testing.T) {
	rds := redistest.Start(t)
	tests := []struct {
		name   string
		refuse func(t *testing.T, td *testDaemon)
	}{
		{"the state cannot be saved", func(t *testing.T, td *testDaemon) { td.cfg.StateDir = filepath.Join(td.cfg.PolicyFile, "state") }},
		{"the state is renamed but not synced", func(t *testing.T, td *testDaemon) {
			orig := syncDir
			t.Cleanup(func() { syncDir = orig })
			syncDir = func(string) error { return syscall.EIO }
		}},
		{"the kernel refuses it", func(t *testing.T, td *testDaemon) { td.fake.fail(errWrite) }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			td := newTestDaemon(t)
			td.apply(t, adaptivePolicy+strings.TrimPrefix(sharedPool(rds, 10, t.Name()), "rules:\n"))
			ctx := context.Background()
			if err := td.table.set(ctx, parse(t, "rules:\n  - {name: other, destination: 10.0.0.7, concurrency: 1}\n").Rules[0], time.Now()); err != nil {
				t.Fatal(err)
			}
			td.table.mu.Lock()
			dep, pool := td.table.entries["dep"], td.table.entries["pool"]
			td.table.mu.Unlock()
			pool.share.end(false, 0) // its loop stopped: the kernel rule stays as it is
			lowerLimit(t, dep.ctrl)
			before, syncs, dir := td.state(), td.fake.syncs, td.cfg.StateDir

			tt.refuse(t, td)
			for _, r := range []string{"{name: dep, destination: 10.0.0.2, port: 80, concurrency: 9}", "{name: pool, destination: 127.0.0.9, concurrency: 3}"} {
				if err := td.table.set(ctx, parse(t, "rules:\n  - "+r+"\n").Rules[0], time.Now()); err == nil {
					t.Errorf("limit set %s succeeded", r)
				}
			}
			if got := td.state(); !equalMaps(got, before) || td.fake.syncs != syncs {
				t.Errorf("after refused changes: table %v (was %v), %d syncs (was %d)", got, before, td.fake.syncs, syncs)
			}
			td.table.mu.Lock()
			kept := td.table.entries["dep"].ctrl == dep.ctrl && td.table.entries["pool"].share == pool.share
			td.table.mu.Unlock()
			if !kept {
				t.Error("a refused change replaced dep's adaptive loop or pool's share")
			}
			saved, err := loadOverrides(dir)
			if err != nil || len(saved.Set) != 1 || saved.Set[0].Name != "other" {
				t.Errorf("state saved %+v, %v; want other set alone", saved, err)
			}
		})
	}
}

// TestReloadKeepsOldPolicyOnError: a reload of a bad file, or of a file
// gone, changes nothing and says why, also in the log: a reload through
// the control API has no other place the daemon's operator looks.
func TestReloadKeepsOldPolicyOnError(t *testing.T) {
	td := newTestDaemon(t)
	logged := &messages{}
	td.logTo(slog.New(logged))
	good := "rules:\n  - {name: db, destination: 10.0.0.1, concurrency: 5}\n"
	writeFile(t, td.cfg.PolicyFile, good)
	if _, err := td.reloadPolicy(context.Background()); err != nil {
		t.Fatal(err)
	}
	before := td.state()
	writeFile(t, td.cfg.PolicyFile, "rules:\n  - {name: db, destination: [not, one], concurrency: 5}\n")
	r, err := td.reloadPolicy(context.Background())
	if err == nil || r.OK || !strings.Contains(r.Error, "destination") {
		t.Errorf("reload of a bad file = %+v, %v; want refused, naming the problem", r, err)
	}
	logged.mu.Lock()
	refusal := logged.attrs["policy reload refused; the old policy stays"]["err"]
	logged.mu.Unlock()
	if !strings.Contains(refusal.String(), "destination") {
		t.Errorf("the refused reload logged %q; want its error", refusal)
	}
	os.Remove(td.cfg.PolicyFile)
	if r, err := td.reloadPolicy(context.Background()); err == nil || r.OK {
		t.Errorf("reload of a file gone = %+v, %v; want refused", r, err)
	}
	if got := td.state(); !equalMaps(got, before) {
		t.Errorf("after refused reloads: %v, want %v", got, before)
	}
}

// reloadAsync starts a reload with ctx; its error comes on the channel.
func (td *testDaemon) reloadAsync(ctx context.Context) <-chan error {
	done := make(chan error, 1)
	go func() { _, err := td.reloadPolicy(ctx); done <- err }()
	return done
}

// TestReloadsApplyInTurn: a reload of a newer file while an older one's
// reload waits on a slow lookup leaves the newer file in force: the second
// reload waits for the first, rather than the first applying its older
// read last.
func TestReloadsApplyInTurn(t *testing.T) {
	td := newTestDaemon(t)
	srv := td.silentDNS(t, time.Minute)
	writeFile(t, td.cfg.PolicyFile, "rules:\n  - {name: db, destination: 10.0.0.1, concurrency: 5}\n")
	if _, err := td.reloadPolicy(context.Background()); err != nil {
		t.Fatal(err)
	}
	// The older file adds a rule whose host name the DNS server sits on.
	writeFile(t, td.cfg.PolicyFile, "rules:\n  - {name: db, destination: 10.0.0.1, concurrency: 1}\n  - {name: api, destination: api.test, concurrency: 1}\n")
	older := td.reloadAsync(context.Background())
	<-srv.asked
	newer := "rules:\n  - {name: db, destination: 10.0.0.1, concurrency: 2}\n"
	writeFile(t, td.cfg.PolicyFile, newer)
	second := td.reloadAsync(context.Background())
	// The second reload waits for the first, or (were it not made to)
	// applies the newer file before the first ends.
	var secondErr error
	secondDone := false
	clocktest.Eventually(t, "the second reload to wait for the first, or to end", func() bool {
		select {
		case secondErr = <-second:
			secondDone = true
			return true
		default:
			return reloadWaits()
		}
	})
	srv.fail()
	if !secondDone {
		secondErr = <-second
	}
	if err := errors.Join(<-older, secondErr); err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"db": "10.0.0.1/32 concurrency 2 (policy)"}
	if got := td.state(); !equalMaps(got, want) {
		t.Errorf("after both reloads, with the newer file in place: %v, want %v", got, want)
	}
}

// reloadWaits reports whether a reload waits for another to end: a
// goroutine in reloadPolicy waits for a lock.
func reloadWaits() bool {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, "(*Daemon).reloadPolicy(") && strings.Contains(g, "sync.(*Mutex).Lock") {
			return true
		}
	}
	return false
}

// TestStartWithConflictingRunTimeRule: a run-time rule that conflicts
// with a policy changed while the daemon was down does not keep the
// daemon from starting: it runs the policy alone and says so.
func TestStartWithConflictingRunTimeRule(t *testing.T) {
	td := newTestDaemon(t)
	td.table.overrides = td.table.overrides.with(parse(t, "rules:\n  - {name: cli, destination: 10.0.0.1, concurrency: 1}\n").Rules[0])
	p := parse(t, "rules:\n  - {name: file, destination: 10.0.0.1, concurrency: 5}\n")
	if err := td.installAtStart(context.Background(), p); err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"file": "10.0.0.1/32 concurrency 5 (policy)"}
	if got := td.state(); !equalMaps(got, want) {
		t.Errorf("table %v, want %v", got, want)
	}
	if td.table.reload.OK || !strings.Contains(td.table.reload.Error, "run-time limits not applied") {
		t.Errorf("last load %+v, want it to say the run-time limits were not applied", td.table.reload)
	}
	// Removing the conflicting rule puts the others in force: the load is
	// whole, and status and egressd_policy_last_load_ok say so without a
	// reload.
	if err := td.table.remove(context.Background(), "cli", time.Now()); err != nil {
		t.Fatal(err)
	}
	if !td.table.reload.OK || td.table.reload.Error != "" {
		t.Errorf("after limit rm of the conflicting rule: last load %+v, want ok", td.table.reload)
	}
}

// messages records the messages logged at Info and above.
type messages struct {
	mu  sync.Mutex
	got []string
	// attrs are the attributes of the last record of each message.
	attrs map[string]map[string]slog.Value
}

func (m *messages) Enabled(_ context.Context, l slog.Level) bool { return l >= slog.LevelInfo }
func (m *messages) Handle(_ context.Context, r slog.Record) error {
	attrs := map[string]slog.Value{}
	r.Attrs(func(a slog.Attr) bool { attrs[a.Key] = a.Value; return true })
	m.mu.Lock()
	defer m.mu.Unlock()
	m.got = append(m.got, r.Message)
	if m.attrs == nil {
		m.attrs = map[string]map[string]slog.Value{}
	}
	m.attrs[r.Message] = attrs
	return nil
}

// durations are the attributes keys of the last record of message msg,
// as durations; the test fails when one is missing or not a duration.
func (m *messages) durations(t *testing.T, msg string, keys ...string) map[string]time.Duration {
	t.Helper()
	m.mu.Lock()
	defer m.mu.Unlock()
	out := map[string]time.Duration{}
	for _, k := range keys {
		v, ok := m.attrs[msg][k]
		if !ok || v.Kind() != slog.KindDuration {
			t.Fatalf("%q logged %s = %v, want a duration", msg, k, v)
		}
		out[k] = v.Duration()
	}
	return out
}
func (m *messages) WithAttrs([]slog.Attr) slog.Handler { return m }
func (m *messages) WithGroup(string) slog.Handler      { return m }

// TestLogChanges: a few rule changes are logged one line each; a policy of
// many is one line that counts them, so that a large policy is not seconds
// of logging.
func TestLogChanges(t *testing.T) {
	for _, n := range []int{3, logChangesEach + 1} {
		td := newTestDaemon(t)
		m := &messages{}
		td.logTo(slog.New(m))
		var b strings.Builder
		b.WriteString("rules:\n")
		for i := range n {
			fmt.Fprintf(&b, "  - {name: r%d, destination: 10.0.%d.%d, concurrency: 1}\n", i, i/256, i%256)
		}
		td.apply(t, b.String())
		added, summary := 0, 0
		for _, msg := range m.got {
			switch msg {
			case "rule added":
				added++
			case "rules changed":
				summary++
			}
		}
		want := [2]int{n, 0}
		if n > logChangesEach {
			want = [2]int{0, 1}
		}
		if [2]int{added, summary} != want {
			t.Errorf("%d rules added: %d \"rule added\" and %d \"rules changed\" lines at Info; want %d and %d", n, added, summary, want[0], want[1])
		}
	}
	// One rule kept, one changed, one removed, one added.
	td := newTestDaemon(t)
	td.apply(t, "rules:\n  - {name: a, destination: 10.0.0.1, concurrency: 1}\n  - {name: b, destination: 10.0.0.2, concurrency: 1}\n  - {name: c, destination: 10.0.0.3, concurrency: 1}\n")
	m := &messages{}
	td.logTo(slog.New(m))
	td.apply(t, "rules:\n  - {name: a, destination: 10.0.0.1, concurrency: 1}\n  - {name: b, destination: 10.0.0.2, concurrency: 2}\n  - {name: d, destination: 10.0.0.4, concurrency: 1}\n")
	if want := []string{"rule changed", "rule added", "rule removed"}; !slices.Equal(m.got, want) {
		t.Errorf("logged %q; want %q", m.got, want)
	}
}

// TestReloadFindsEachRulesState: a reload that moves rules to other places
// in the file, with one removed and one added, gives each rule kept the
// adaptive loop it had, whatever rule held its place before.
func TestReloadFindsEachRulesState(t *testing.T) {
	td := newTestDaemon(t)
	rule := func(name string) string {
		return fmt.Sprintf("  - {name: %s, destination: 10.0.0.%d, adaptive: {initial: 5}}\n", name, name[0])
	}
	td.apply(t, "rules:\n"+rule("a")+rule("b")+rule("c")+rule("d"))
	td.table.mu.Lock()
	loops := map[string]*adaptive.Controller{}
	for name, e := range td.table.entries {
		loops[name] = e.ctrl
	}
	td.table.mu.Unlock()
	td.apply(t, "rules:\n"+rule("d")+rule("b")+rule("x")+rule("a"))
	td.table.mu.Lock()
	defer td.table.mu.Unlock()
	for _, name := range []string{"a", "b", "d"} {
		if e := td.table.entries[name]; e == nil || e.ctrl != loops[name] {
			t.Errorf("rule %s lost its adaptive loop", name)
		}
	}
	if x := td.table.entries["x"]; x == nil || x.ctrl == nil || slices.Contains(slices.Collect(maps.Values(loops)), x.ctrl) {
		t.Errorf("the new rule x has no loop of its own")
	}
	if _, ok := td.table.entries["c"]; ok || len(td.table.entries) != 4 {
		t.Errorf("table %v after the reload", slices.Collect(maps.Keys(td.table.entries)))
	}
}

// TestTableViews: the host names the table uses and its installed adaptive
// rules, which the loops that tick often read instead of the whole table,
// follow every change of it, and a change refused leaves them as they were.
func TestTableViews(t *testing.T) {
	td := newTestDaemon(t)
	writeFile(t, td.hosts, "10.1.1.1 api.test\n")
	views := func() (names, adaptive []string) {
		td.table.mu.Lock()
		defer td.table.mu.Unlock()
		for _, u := range td.table.uses {
			names = append(names, u.rule+"="+u.host)
		}
		for _, e := range td.table.adaptive {
			adaptive = append(adaptive, e.spec.Name)
		}
		slices.Sort(names)
		slices.Sort(adaptive)
		return names, adaptive
	}
	check := func(when string, wantNames, wantAdaptive []string) {
		t.Helper()
		names, adaptive := views()
		if !slices.Equal(names, wantNames) || !slices.Equal(adaptive, wantAdaptive) {
			t.Errorf("%s: names %q, adaptive %q; want %q, %q", when, names, adaptive, wantNames, wantAdaptive)
		}
	}
	ctx := context.Background()
	if err := td.table.install(ctx, parse(t, `rules:
  - {name: api, destination: api.test, adaptive: {initial: 4}}
  - {name: gone, destination: gone.test, adaptive: {initial: 4}}
  - {name: db, destination: 10.0.0.1, concurrency: 5}
  - {name: dep, destination: 10.0.0.2, adaptive: {initial: 4}}
`), time.Now()); err != nil {
		t.Fatal(err)
	}
	// gone.test has no addresses: its rule is pending, and no loop of it runs.
	check("installed", []string{"api=api.test", "gone=gone.test"}, []string{"api", "dep"})

	if err := td.table.set(ctx, parse(t, "rules:\n  - {name: dep, destination: dep.test, concurrency: 3}\n").Rules[0], time.Now()); err != nil {
		t.Fatal(err)
	}
	if err := td.table.remove(ctx, "api", time.Now()); err != nil {
		t.Fatal(err)
	}
	check("dep made fixed, api removed", []string{"dep=dep.test", "gone=gone.test"}, nil)

	td.fake.fail(errors.New("kernel says no"))
	if err := td.table.set(ctx, parse(t, "rules:\n  - {name: more, destination: more.test, adaptive: {initial: 4}}\n").Rules[0], time.Now()); err == nil {
		t.Fatal("a change the kernel refused succeeded")
	}
	check("a refused change", []string{"dep=dep.test", "gone=gone.test"}, nil)
}

// TestLimitsList: the list of every rule, which reads the kernel's counts
// of all of them at once, says of each what the view of that rule alone
// says, pending rules included.
func TestLimitsList(t *testing.T) {
	td := newTestDaemon(t)
	writeFile(t, td.hosts, "10.1.1.1 api.test\n")
	td.apply(t, `rules:
  - {name: db, destination: 10.0.0.1, concurrency: 5}
  - {name: api, destination: api.test, adaptive: {initial: 4}}
  - {name: gone, destination: gone.test, concurrency: 2}
  - {name: rate, destination: 10.0.0.3, perSecond: {permits: 9}, shadow: true}
`)
	td.fake.mu.Lock()
	td.fake.stats["db"] = loader.Stats{Live: 3, Admitted: 7, Refused: 2}
	td.fake.stats["api"] = loader.Stats{Live: 1, InFlight: 1, Admitted: 4}
	td.fake.mu.Unlock()
	list := td.list(t, control.LimitsQuery{})
	var names []string
	for _, l := range list {
		names = append(names, l.Name)
		one, err := td.api.limitView(l.Name, false)
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(l, one) {
			t.Errorf("%s in the list:\n%+v\nalone:\n%+v", l.Name, l, one)
		}
	}
	if want := []string{"api", "db", "gone", "rate"}; !slices.Equal(names, want) {
		t.Errorf("listed %q, want %q", names, want)
	}
	if l := list[1]; l.Live != 3 || l.Admitted != 7 || l.Refused != 2 || l.Limit != 5 || !strings.Contains(l.Rule, "concurrency: 5") {
		t.Errorf("db listed as %+v", l)
	}
	if l := list[2]; l.Pending == "" {
		t.Errorf("gone listed as %+v, want pending", l)
	}
}
