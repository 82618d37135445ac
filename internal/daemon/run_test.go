package daemon

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"net/netip"
	"os"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"testing/synctest"
	"time"

	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/pkg/control"
	"github.com/egressd/egressd/pkg/loader"
	"github.com/egressd/egressd/pkg/policy"
)

// apply installs a policy's text as the table.
func (td *testDaemon) apply(t *testing.T, text string) {
	t.Helper()
	td.applyAt(t, time.Now(), text)
}

// applyAt installs a policy's text as the table at now.
func (td *testDaemon) applyAt(t *testing.T, now time.Time, text string) {
	t.Helper()
	if err := td.table.install(context.Background(), parse(t, text), now); err != nil {
		t.Fatal(err)
	}
}

// start runs the daemon until the test ends, and waits until it says it
// is ready. The test fails if Run fails, or returns leaving a goroutine of
// the daemon's behind.
func (td *testDaemon) start(t *testing.T) (stop func() error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	td.done = done
	go func() { defer close(done); td.runErr = td.Run(ctx) }()
	stopped := false
	once := func() error {
		if !stopped {
			stopped = true
			cancel()
			<-done
			if g := daemonGoroutines(); g != "" {
				t.Errorf("Run returned with the daemon's goroutines still running:\n%s", g)
			}
		}
		return td.runErr
	}
	t.Cleanup(func() {
		if err := once(); err != nil && !errors.Is(err, ErrUninstalled) {
			t.Errorf("run: %v", err)
		}
	})
	td.await(t, td.notify.ready, "ready")
	return once
}

func (td *testDaemon) client() *control.Client {
	// A bound for a hang only: a reload of a large policy under -race on
	// a loaded machine takes seconds.
	return &control.Client{Socket: td.cfg.Socket, Timeout: time.Minute}
}

// daemonGoroutines returns the stacks of goroutines running the daemon's
// code, but the test's own.
func daemonGoroutines() string {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	var out []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, "egressd/internal/daemon.") && !strings.Contains(g, "testing.tRunner") && !strings.Contains(g, "_test.go") {
			out = append(out, g)
		}
	}
	return strings.Join(out, "\n\n")
}

// TestNewChecksConfig: New refuses a configuration it cannot run, listing
// every problem, and touches nothing.
func TestNewChecksConfig(t *testing.T) {
	tests := []struct {
		name string
		cfg  Config
		want []string
	}{
		{"defaults", Config{HostID: "h"}, nil},
		{"everything wrong", Config{Socket: "/" + strings.Repeat("s", 200), SocketMode: 0o4777, Refresh: -time.Second, HostID: "a host", MetricsAddr: "localhost", MaxRules: -1},
			[]string{"socket path", "socket mode", "refresh", `host id "a host"`, `metrics address "localhost"`, "max rules -1"}},
		{"a control character", Config{HostID: "h\x00"}, []string{`host id "h\x00"`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := New(tt.cfg)
			if (err != nil) != (len(tt.want) > 0) || (err != nil && !errors.Is(err, ErrConfig)) {
				t.Fatalf("New = %v, want problems %q", err, tt.want)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("New = %v, want it to name %q", err, w)
				}
			}
		})
	}
}

// TestRunServesAndStops: Run serves the control API on the datapath it
// opened, and stops on its context: the datapath stays pinned (closed,
// not uninstalled), and no goroutine of the daemon's outlives it.
func TestRunServesAndStops(t *testing.T) {
	td := newTestDaemon(t)
	writeFile(t, td.cfg.PolicyFile, "rules:\n  - {name: db, destination: 10.0.0.1, concurrency: 5}\n")
	stop := td.start(t)
	l, err := td.client().Limit(context.Background(), "db")
	if err != nil || l.Limit != 5 {
		t.Fatalf("limit db = %+v, %v", l, err)
	}
	if err := stop(); err != nil {
		t.Fatalf("run: %v", err)
	}
	if td.fake.closed != "closed" {
		t.Errorf("the datapath was %q after a stop, want closed (pinned)", td.fake.closed)
	}
}

// TestRunSIGHUPDuringStart: a SIGHUP that comes while the daemon starts
// does not end it (the signal's default): once it runs, it reloads the
// policy, which changed meanwhile.
func TestRunSIGHUPDuringStart(t *testing.T) {
	td := newTestDaemon(t)
	writeFile(t, td.cfg.PolicyFile, "rules:\n  - {name: db, destination: 10.0.0.1, concurrency: 5}\n")
	td.cfg.open = func(cfg *loader.Config) (datapath, error) {
		// Not writeFile: this runs in Run's goroutine, where t.Fatal must not.
		if err := os.WriteFile(td.cfg.PolicyFile, []byte("rules:\n  - {name: db, destination: 10.0.0.1, concurrency: 7}\n"), 0o644); err != nil {
			t.Error(err)
		}
		// To this process, as systemctl reload sends it to the daemon.
		if err := syscall.Kill(os.Getpid(), syscall.SIGHUP); err != nil {
			t.Error(err)
		}
		return td.fake.open(cfg)
	}
	td.start(t)
	td.await(t, td.notify.reloading, "reloading")
	td.await(t, td.notify.ready, "ready after the reload")
	l, err := td.client().Limit(context.Background(), "db")
	if err != nil {
		t.Fatal(err)
	}
	if l.Limit != 7 {
		t.Fatalf("limit db = %d after a SIGHUP during start, want 7 from the policy reloaded", l.Limit)
	}
}

// watchdogNotifier is a testNotifier that asks for watchdog pings every
// 20 ms and passes them on, and keeps what the daemon said in order.
type watchdogNotifier struct {
	*testNotifier
	pings chan struct{}
	mu    sync.Mutex
	said  []string
}

func (n *watchdogNotifier) Ready()     { n.say("ready"); n.testNotifier.Ready() }
func (n *watchdogNotifier) Reloading() { n.say("reloading"); n.testNotifier.Reloading() }
func (n *watchdogNotifier) Stopping()  { n.say("stopping") }
func (n *watchdogNotifier) Watchdog() {
	select {
	case n.pings <- struct{}{}:
	default:
	}
}
func (*watchdogNotifier) WatchdogInterval() (time.Duration, bool) { return 20 * time.Millisecond, true }

func (n *watchdogNotifier) say(what string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.said = append(n.said, what)
}

// TestSIGHUPReloadKeepsWatchdog: while a SIGHUP's reload waits on a DNS
// server that does not answer, the watchdog is still pinged (the unit
// kills a daemon that stops pinging for WatchdogSec); a stop or an
// uninstall meanwhile ends the reload's wait and comes after it: the
// daemon says it is ready again, then that it stops.
func TestSIGHUPReloadKeepsWatchdog(t *testing.T) {
	tests := []struct {
		name string
		end  func(td *testDaemon, stop func() error) error
		want error
	}{
		{"stopped", func(_ *testDaemon, stop func() error) error { return stop() }, nil},
		{"uninstalled", func(td *testDaemon, stop func() error) error { td.requestStop(); <-td.done; return td.runErr }, ErrUninstalled},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			td := newTestDaemon(t)
			n := &watchdogNotifier{testNotifier: td.notify, pings: make(chan struct{}, 1)}
			td.cfg.Notify = n
			asked := td.silentDNS(t, time.Minute).asked
			stop := td.start(t)
			writeFile(t, td.cfg.PolicyFile, "rules:\n  - {name: api, destination: api.test, concurrency: 1}\n")
			if err := syscall.Kill(os.Getpid(), syscall.SIGHUP); err != nil {
				t.Fatal(err)
			}
			td.await(t, td.notify.reloading, "reloading")
			td.await(t, asked, "asking the DNS server")
			select {
			case <-n.pings:
			default:
			}
			// A bound for a hang only: a watchdog held up by the reload
			// is pinged again after the lookup's minute.
			for i := range 3 {
				select {
				case <-n.pings:
				case <-time.After(20 * time.Second):
					t.Fatalf("%d watchdog pings in 20 s while the reload waits on DNS, want 3 (one every 10 ms)", i)
				}
			}
			ended := make(chan error, 1)
			go func() { ended <- tt.end(td, stop) }()
			select {
			case err := <-ended:
				if !errors.Is(err, tt.want) {
					t.Fatalf("run: %v, want %v", err, tt.want)
				}
			case <-time.After(20 * time.Second):
				t.Fatal("Run did not return within 20 s: the reload's lookup still waits")
			}
			n.mu.Lock()
			defer n.mu.Unlock()
			if want := []string{"ready", "reloading", "ready", "stopping"}; !slices.Equal(n.said, want) {
				t.Errorf("the daemon said %v, want %v", n.said, want)
			}
		})
	}
}

// TestRunLogsHowLongItTook: the line that says the daemon runs says how
// long the start took and its phases; a reload's line says its phases.
func TestRunLogsHowLongItTook(t *testing.T) {
	td := newTestDaemon(t)
	rec := &messages{}
	td.logTo(slog.New(rec))
	writeFile(t, td.cfg.PolicyFile, "rules:\n  - {name: db, destination: 10.0.0.1, concurrency: 5}\n")
	td.start(t)
	// Each time is rounded to the millisecond: the phases may sum to 2 ms
	// over.
	d := rec.durations(t, "egressd running", "took", "read", "datapath_wait", "install")
	if d["read"]+d["datapath_wait"]+d["install"] > d["took"]+2*time.Millisecond {
		t.Errorf("egressd running: %v; want the phases within took", d)
	}
	if _, err := td.client().ReloadPolicy(context.Background()); err != nil {
		t.Fatal(err)
	}
	rec.durations(t, "policy reloaded", "read", "install")
}

// TestStartPhases: the start's phases are timed apart. A policy this small
// is read before the datapath is opened, so the open is the wait for the
// datapath; in a bubble, the open's time is all the start takes.
func TestStartPhases(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		td := newTestDaemon(t)
		writeFile(t, td.cfg.PolicyFile, "rules:\n  - {name: db, destination: 10.0.0.1, concurrency: 5}\n")
		const opening = 50 * time.Millisecond
		td.cfg.open = func(cfg *loader.Config) (datapath, error) {
			clocktest.Latency(context.Background(), opening)
			return td.fake.open(cfg)
		}
		var stack cleanups
		detach := false
		took, err := td.enforce(context.Background(), &stack, &detach)
		if err != nil {
			t.Fatal(err)
		}
		if err := stack.run(); err != nil {
			t.Fatal(err)
		}
		if want := (startTimes{datapathWait: opening}); took != want {
			t.Errorf("the start took %+v, want %+v", took, want)
		}
	})
}

// TestRunUninstall: an uninstall request ends Run with ErrUninstalled and
// the datapath uninstalled; so does a stop with DetachOnExit, without the
// error.
func TestRunUninstall(t *testing.T) {
	td := newTestDaemon(t)
	stop := td.start(t)
	if err := td.client().Post(context.Background(), control.RouteUninstall, nil, nil); err != nil {
		t.Fatal(err)
	}
	if err := stop(); !errors.Is(err, ErrUninstalled) || td.fake.closed != "uninstalled" {
		t.Errorf("after uninstall: run = %v, datapath %q; want ErrUninstalled, uninstalled", err, td.fake.closed)
	}

	td = newTestDaemon(t)
	td.cfg.DetachOnExit = true
	if err := td.start(t)(); err != nil || td.fake.closed != "uninstalled" {
		t.Errorf("a stop with DetachOnExit: run = %v, datapath %q; want nil, uninstalled", err, td.fake.closed)
	}
}

// TestRunSocketTakenFirst: a second daemon on a socket that answers stops
// before it opens the datapath of the first.
func TestRunSocketTakenFirst(t *testing.T) {
	first := newTestDaemon(t)
	first.start(t)
	second := newTestDaemon(t)
	second.cfg.Socket = first.cfg.Socket
	opened := false
	second.cfg.open = func(*loader.Config) (datapath, error) { opened = true; return second.fake, nil }
	if err := second.Run(context.Background()); err == nil || opened {
		t.Errorf("a second daemon on a live socket: run = %v, opened the datapath %v; want an error, not opened", err, opened)
	}
}

// TestRunOpensLargePolicyEarly: the datapath of a large policy is opened
// while the policy is parsed, once, with tables of the size its text
// asks for. When the policy then turns out bad, a datapath made just now
// is taken down and an adopted one left pinned, as the start found it; a
// small bad policy is never opened for.
func TestRunOpensLargePolicyEarly(t *testing.T) {
	large := manyRules(3000, 5000)
	bad := strings.Replace(large, "{name: r2999, ", "{name: r2999, port: 0, ", 1)
	for _, tc := range []struct {
		name, policy string
		adopted      bool
		opens        int
		closed       string
		maxRules     int
		ok           bool
	}{
		{"large", large, false, 1, "closed", 5000, true},
		{"large and bad", bad, false, 1, "uninstalled", 5000, false},
		{"large and bad, adopted", bad, true, 1, "closed", 5000, false},
		{"small and bad", "rules:\n  - {name: db, destination: 10.0.0.1, port: 0, concurrency: 5}\n", false, 0, "", loader.DefaultMaxRules, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			td := newTestDaemon(t)
			writeFile(t, td.cfg.PolicyFile, tc.policy)
			td.fake.adopted = tc.adopted
			var opens atomic.Int32
			td.cfg.open = func(cfg *loader.Config) (datapath, error) {
				opens.Add(1)
				return td.fake.open(cfg)
			}
			if tc.ok {
				td.start(t)()
			} else if err := td.Run(context.Background()); err == nil || !strings.Contains(err.Error(), "port") {
				t.Fatalf("run with a bad policy: %v", err)
			}
			if int(opens.Load()) != tc.opens || td.fake.closed != tc.closed || td.fake.maxRules != tc.maxRules {
				t.Errorf("opened %d times, datapath %q with %d slots; want %d, %q, %d", opens.Load(), td.fake.closed, td.fake.maxRules, tc.opens, tc.closed, tc.maxRules)
			}
			if g := daemonGoroutines(); g != "" {
				t.Errorf("goroutines left:\n%s", g)
			}
		})
	}
}

// TestRunBadPolicyStopsStart: a policy that cannot be applied at start
// stops the daemon, and what it started is stopped.
func TestRunBadPolicyStopsStart(t *testing.T) {
	td := newTestDaemon(t)
	writeFile(t, td.cfg.PolicyFile, "rules:\n  - {name: db, destination: 10.0.0.1, concurrency: 5}\n")
	td.fake.fail(errWrite)
	err := td.Run(context.Background())
	if !errors.Is(err, errWrite) || td.fake.closed != "closed" {
		t.Errorf("run with a kernel that refuses the policy = %v, datapath %q; want its error, closed", err, td.fake.closed)
	}
	if g := daemonGoroutines(); g != "" {
		t.Errorf("goroutines left:\n%s", g)
	}
	if _, err := (&control.Client{Socket: td.cfg.Socket, Timeout: time.Second}).Status(context.Background()); err == nil {
		t.Error("the control socket still answers after a failed start")
	}
}

// TestRunInvalidPolicyRunsLastGood: a start whose policy file is invalid
// (an edit a reload refused, then a restart) runs the last policy applied
// from the file, says so in status, and takes the file once a reload finds
// it valid; with no policy applied before, it does not start.
func TestRunInvalidPolicyRunsLastGood(t *testing.T) {
	const good = "rules:\n  - {name: db, destination: 10.0.0.1, concurrency: 5}\n"
	const bad = "rules:\n  - {name: db, destination: 10.0.0.1, concurrency: -5}\n"
	first := newTestDaemon(t)
	writeFile(t, first.cfg.PolicyFile, good)
	stop := first.start(t)
	writeFile(t, first.cfg.PolicyFile, bad)
	if _, err := first.reloadPolicy(context.Background()); !errors.Is(err, policy.ErrInvalid) {
		t.Fatalf("reload of an invalid file: %v, want refused", err)
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}

	td := newTestDaemon(t)
	td.cfg.PolicyFile, td.cfg.StateDir = first.cfg.PolicyFile, first.cfg.StateDir
	td.start(t)
	if got, want := td.state()["db"], "10.0.0.1/32 concurrency 5 (policy)"; got != want {
		t.Errorf("started on an invalid file: db %q, want the last good %q", got, want)
	}
	st, err := td.client().Status(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if st.LastReload.OK || !strings.Contains(st.LastReload.Error, "running the last policy applied") {
		t.Errorf("status says %+v, want the invalid file and the last policy running", st.LastReload)
	}
	writeFile(t, td.cfg.PolicyFile, strings.Replace(good, "5", "7", 1))
	if _, err := td.reloadPolicy(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got, want := td.state()["db"], "10.0.0.1/32 concurrency 7 (policy)"; got != want {
		t.Errorf("after a valid reload: db %q, want %q", got, want)
	}

	fresh := newTestDaemon(t)
	writeFile(t, fresh.cfg.PolicyFile, bad)
	if err := fresh.Run(context.Background()); !errors.Is(err, policy.ErrInvalid) {
		t.Errorf("start on an invalid file with no policy applied before: %v, want it refused", err)
	}
}

// TestRunUnreadableOverridesSetAside: run-time limits saved in a file that
// does not parse (edited by hand, written by a newer egressd) are set
// aside, not written over, and the daemon starts with the policy alone and
// says so in status, rather than not start.
func TestRunUnreadableOverridesSetAside(t *testing.T) {
	td := newTestDaemon(t)
	const garbled = `{"rules": "- {name: x`
	if err := os.MkdirAll(td.cfg.StateDir, 0o700); err != nil {
		t.Fatal(err)
	}
	writeFile(t, overridesPath(td.cfg.StateDir), garbled)
	writeFile(t, td.cfg.PolicyFile, "rules:\n  - {name: db, destination: 10.0.0.1, concurrency: 5}\n")
	td.start(t)
	if got, want := td.state()["db"], "10.0.0.1/32 concurrency 5 (policy)"; got != want {
		t.Errorf("db %q, want %q", got, want)
	}
	st, err := td.client().Status(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(st.LastReload.Error, "run-time limits not read") {
		t.Errorf("status says %+v, want the run-time limits not read", st.LastReload)
	}
	if b, err := os.ReadFile(overridesPath(td.cfg.StateDir) + ".unreadable"); err != nil || string(b) != garbled {
		t.Errorf("set aside: %q, %v; want the file as it was", b, err)
	}
	if err := td.table.set(context.Background(), parse(t, "rules:\n  - {name: web, destination: 10.0.0.2, concurrency: 1}\n").Rules[0], time.Now()); err != nil {
		t.Fatal(err)
	}
	if o, err := loadOverrides(td.cfg.StateDir); err != nil || len(o.Set) != 1 {
		t.Errorf("run-time limits after a limit set: %+v, %v", o, err)
	}
}

// TestRunStopsDespiteStalledFollower: a follower of events that stops
// reading, with the daemon's writes to it blocked, neither holds up a stop
// nor makes it fail.
func TestRunStopsDespiteStalledFollower(t *testing.T) {
	td := newTestDaemon(t)
	stop := td.start(t)
	_, resp := followRaw(t, td.cfg.Socket)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("follow: status %d", resp.StatusCode)
	}
	// Far more than the socket's buffers hold, all to a reader that
	// reads none.
	for i := range 20000 {
		td.fake.refuse(loader.Refusal{Time: time.Now(), PID: uint32(i), Rule: strings.Repeat("r", 200), Dest: netip.MustParseAddrPort("10.0.0.1:1")})
	}
	td.fake.refusals.drain(t)
	t0 := time.Now()
	if err := stop(); err != nil {
		t.Errorf("stop: %v", err)
	}
	if took := time.Since(t0); took > 3*time.Second {
		t.Errorf("stop took %v with a stalled follower", took)
	}
}

// TestNoReloadAfterStop: a SIGHUP that waited behind a reload does not
// start another once the daemon stops. Both are ready to the reloads'
// loop then, and a select picks one at random: fifty tries would let one
// through half the time each.
func TestNoReloadAfterStop(t *testing.T) {
	td := newTestDaemon(t)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	for range 50 {
		want := make(chan struct{}, 1)
		want <- struct{}{}
		td.reloadOnHUP(ctx, want)
	}
	if n := len(td.notify.reloading); n != 0 {
		t.Errorf("%d reloads began after the stop", n)
	}
}
