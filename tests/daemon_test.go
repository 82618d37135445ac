// Package tests runs the real egressd binary as an operator would: built
// once, started on a cgroup the test makes, driven by its own CLI, scraped
// over HTTP, and enforced against clients that are not Go programs.
package tests

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/internal/privtest"
	"github.com/egressd/egressd/internal/testport"
	"github.com/egressd/egressd/pkg/control"
)

// egressd is the binary under test, built by TestMain.
var egressd string

func TestMain(m *testing.M) {
	if privtest.IsHelper() {
		// A client process a test started; it exits.
		privtest.Main(m, privtest.Role{Name: "sdkservice", Run: runSDKService}, privtest.Role{Name: "sdkdial", Run: runSDKDial},
			privtest.Role{Name: "quicrequester", Run: runQUICRequester})
	}
	os.Exit(run(m))
}

func run(m *testing.M) int {
	if os.Geteuid() != 0 {
		return m.Run() // every test skips, saying why; no binary needed
	}
	dir, err := os.MkdirTemp("", "egressd-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	egressd = filepath.Join(dir, "egressd")
	build := exec.Command("go", "build", "-o", egressd, "github.com/egressd/egressd/cmd/egressd")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintf(os.Stderr, "build egressd: %v\n", err)
		return 1
	}
	return m.Run()
}

// TestDaemonLimitsAnyLanguage starts the daemon on a concurrency limit of 2
// and checks that a Python client in the cgroup gets two connections and an
// EPERM, that the CLI, the event stream and /metrics all say so, and that
// uninstall ends enforcement and leaves nothing pinned.
func TestDaemonLimitsAnyLanguage(t *testing.T) {
	e := newEnv(t)
	port := listen(t)
	e.writePolicy(t, policyRule("web", port, 2))
	d := e.start(t)

	// The CLI before any traffic.
	if out := e.ok(t, "limit", "ls"); !regexp.MustCompile(`(?m)^web\s+concurrency\s+tcp\s+2\s+0\s+0\s+0\s+0\s+policy\s+installed\s*$`).MatchString(out) {
		t.Errorf("limit ls:\n%s", out)
	}
	var ls []control.Limit
	e.json(t, &ls, "limit", "ls")
	if len(ls) != 1 {
		t.Fatalf("limit ls --json: %d rules, want 1: %+v", len(ls), ls)
	}
	web := ls[0]
	if web.Name != "web" || web.Source != "policy" || web.Shape != "concurrency" || web.Limit != 2 ||
		web.Pending != "" || !slices.Equal(web.Destinations, []string{"127.0.0.1/32"}) {
		t.Errorf("limit ls --json: %+v", web)
	}
	if out := e.ok(t, "limit", "get", "web"); !strings.Contains(out, "web (concurrency, from policy)") ||
		!strings.Contains(out, "destinations: 127.0.0.1/32") || !strings.Contains(out, "limit: 2  live: 0") {
		t.Errorf("limit get web:\n%s", out)
	}
	var st control.Status
	e.json(t, &st, "status")
	if st.Adopted || st.Rules != 1 || st.Pending != 0 || !st.LastReload.OK || st.PinDir != e.pins || st.Cgroup != e.cg {
		t.Errorf("status --json on a fresh start: %+v", st)
	}
	if out := e.ok(t, "status"); !strings.Contains(out, "(adopted: false)") || !strings.Contains(out, "rules: 1 (0 pending)") {
		t.Errorf("status:\n%s", out)
	}
	if fi, err := os.Stat(e.socket); err != nil {
		t.Errorf("control socket: %v", err)
	} else if fi.Mode().Type() != os.ModeSocket || fi.Mode().Perm() != 0o660 {
		t.Errorf("control socket: mode %v, want a socket of mode 0660", fi.Mode())
	}

	// Follow the event stream from before the refusal.
	follow := exec.Command(egressd, "--socket", e.socket, "--json", "events", "--follow")
	followOut, err := follow.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	follow.Stderr = os.Stderr
	if err := follow.Start(); err != nil {
		t.Fatal(err)
	}
	followed := make(chan string, 16)
	go func() {
		sc := bufio.NewScanner(followOut)
		for sc.Scan() {
			followed <- sc.Text()
		}
		close(followed)
	}()
	t.Cleanup(func() { follow.Process.Kill(); follow.Wait() })
	// Opened before the refusal, the stream sends it live; opened after, as
	// a recent one. Give it time to open, so it is usually the first.
	time.Sleep(100 * time.Millisecond)

	// Python, not Go: the limit is the host's, not a library's.
	py := e.python(t)
	got := []string{py.dial(t, port), py.dial(t, port), py.dial(t, port)}
	if want := []string{"ok 0", "ok 1", "err 1"}; !slices.Equal(got, want) {
		t.Fatalf("python connects: %q, want %q (two admitted, then EPERM)", got, want)
	}
	l := e.limit(t, "web")
	if l.Live != 2 || l.Admitted != 2 || l.Refused != 1 {
		t.Errorf("limit get web after the connects: live %d admitted %d refused %d, want 2 2 1", l.Live, l.Admitted, l.Refused)
	}

	// The refusal reaches the event stream from the ring buffer shortly.
	var ev control.Event
	clocktest.Eventually(t, "the refusal in egressd events --json", func() bool {
		for _, line := range lines(e.ok(t, "--json", "events")) {
			var r control.Event
			if err := json.Unmarshal([]byte(line), &r); err != nil {
				t.Fatalf("events --json line %q: %v", line, err)
			}
			if r.PID == uint32(py.pid) {
				ev = r
				return true
			}
		}
		return false
	})
	if ev.Rule != "web" || ev.Dest != fmt.Sprintf("127.0.0.1:%d", port) || ev.Shape != "concurrency" || ev.Shadow {
		t.Errorf("refusal event: %+v", ev)
	}
	if out := e.ok(t, "events"); !strings.Contains(out, fmt.Sprintf("refused pid %d -> 127.0.0.1:%d by rule web (concurrency)", py.pid, port)) {
		t.Errorf("events:\n%s", out)
	}
	select {
	case line := <-followed:
		var r control.Event
		if err := json.Unmarshal([]byte(line), &r); err != nil || r.PID != uint32(py.pid) || r.Rule != "web" {
			t.Errorf("events --follow: %q (%v), want the refusal of pid %d by web", line, err, py.pid)
		}
	case <-time.After(5 * time.Second):
		t.Errorf("events --follow: no refusal within 5s")
	}
	var top []struct {
		control.Limit
		RefusedPerSecond float64 `json:"refusedPerSecond"`
	}
	e.json(t, &top, "top", "--count", "1", "--interval", "10ms")
	if len(top) != 1 || top[0].Name != "web" || top[0].Live != 2 || top[0].Refused != 1 {
		t.Errorf("top --json --count 1: %+v", top)
	}

	m := e.scrape(t)
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"egressd_leases_total", map[string]string{"rule": "web", "outcome": "denied"}, 1},
		{"egressd_leases_total", map[string]string{"rule": "web", "outcome": "acquired"}, 2},
		{"egressd_leases_total", map[string]string{"rule": "web", "outcome": "shadow_denied"}, 0},
		{"egressd_live_connections", map[string]string{"rule": "web"}, 2},
		{"egressd_limit", map[string]string{"rule": "web"}, 2},
		{"egressd_rules", map[string]string{"state": "installed"}, 1},
	} {
		if v, ok := m.value(c.name, c.labels); !ok || v != c.want {
			t.Errorf("/metrics %s%v = %v (found %v), want %v", c.name, c.labels, v, ok, c.want)
		}
	}

	// Closing the connections gives the slots back.
	py.call(t, "close 0")
	py.call(t, "close 1")
	clocktest.Eventually(t, "live back to 0", func() bool { return e.limit(t, "web").Live == 0 })

	// Uninstall: the daemon detaches, removes its pins and exits with
	// status 3, which keeps systemd (RestartPreventExitStatus=3) from
	// starting it again.
	e.ok(t, "uninstall")
	var exit *exec.ExitError
	if err := d.wait(10 * time.Second); !errors.As(err, &exit) || exit.ExitCode() != 3 {
		t.Fatalf("daemon after uninstall: %v, want exit status 3", err)
	}
	if _, err := os.Stat(e.pins); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("pins after uninstall: %v", err)
	}
	for i := range 3 {
		if got := py.dial(t, port); got != fmt.Sprintf("ok %d", i+2) {
			t.Fatalf("connect %d after uninstall: %q, want admitted", i+1, got)
		}
	}
}

// TestDaemonRestartKeepsCLILimits sets limits with the CLI, stops the daemon
// with SIGTERM and starts a new one on the same state directory and pins:
// the limits come back from the state file, the counts from the kernel.
func TestDaemonRestartKeepsCLILimits(t *testing.T) {
	e := newEnv(t)
	webPort, apiPort := listen(t), listen(t)
	e.writePolicy(t, policyRule("web", webPort, 2))
	d := e.start(t)

	// A new rule, by host name, and an override of the policy's rule.
	var api control.Limit
	e.json(t, &api, "limit", "set", "api", "--dest", "localhost", "--port", strconv.Itoa(apiPort), "--concurrency", "1")
	if api.Source != "cli" || api.Limit != 1 || !slices.Contains(api.Destinations, "127.0.0.1/32") {
		t.Fatalf("limit set api: %+v", api)
	}
	if out := e.ok(t, "limit", "set", "web", "--dest", "127.0.0.1", "--port", strconv.Itoa(webPort), "--concurrency", "3"); !strings.Contains(out, "web (concurrency, from cli)") {
		t.Fatalf("limit set web:\n%s", out)
	}

	py := e.python(t)
	got := []string{py.dial(t, apiPort), py.dial(t, apiPort), py.dial(t, webPort)}
	if want := []string{"ok 0", "err 1", "ok 1"}; !slices.Equal(got, want) {
		t.Fatalf("connects: %q, want %q", got, want)
	}

	d.term(t)
	if _, err := os.Stat(e.socket); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("control socket after SIGTERM: %v, want it removed", err)
	}
	// Fail-static: the stopped daemon's limits still hold.
	if got := py.dial(t, apiPort); got != "err 1" {
		t.Fatalf("connect over the api limit with the daemon stopped: %q, want err 1", got)
	}

	e.start(t)
	var st control.Status
	e.json(t, &st, "status")
	if !st.Adopted || st.Rules != 2 || st.Pending != 0 {
		t.Errorf("status after the restart: %+v", st)
	}
	if out := e.ok(t, "status"); !strings.Contains(out, "(adopted: true)") {
		t.Errorf("status after the restart:\n%s", out)
	}
	want := map[string]control.Limit{
		"api": {Name: "api", Source: "cli", Limit: 1, Live: 1, Admitted: 1, Refused: 2},
		"web": {Name: "web", Source: "cli", Limit: 3, Live: 1, Admitted: 1, Refused: 0},
	}
	var ls []control.Limit
	e.json(t, &ls, "limit", "ls")
	checkLimits(t, ls, want)
	if out := e.ok(t, "limit", "ls"); !regexp.MustCompile(`(?m)^api\s+concurrency\s+tcp\s+1\s+1\s+0\s+1\s+2\s+cli\s+installed\s*$`).MatchString(out) {
		t.Errorf("limit ls after the restart:\n%s", out)
	}
	// Still enforced by the new daemon at the CLI's limit, not the file's.
	if got := []string{py.dial(t, webPort), py.dial(t, webPort), py.dial(t, webPort)}; !slices.Equal(got, []string{"ok 2", "ok 3", "err 1"}) {
		t.Errorf("connects to web after the restart: %q, want two more admitted at limit 3", got)
	}

	// A policy rule removed at run time stays removed across a reload.
	e.ok(t, "limit", "rm", "web")
	e.ok(t, "policy", "reload")
	e.json(t, &ls, "limit", "ls")
	if len(ls) != 1 || ls[0].Name != "api" {
		t.Errorf("limit ls after rm web and a reload: %+v, want only api", ls)
	}
}

// TestDaemonKilledUnderChurn kills the daemon with SIGKILL while a client
// churns connections: the limit holds while no daemon runs, and a new daemon
// adopts the kernel's state with the right live count.
func TestDaemonKilledUnderChurn(t *testing.T) {
	e := newEnv(t)
	port := listen(t)
	const limit = 3
	e.writePolicy(t, policyRule("web", port, limit))
	d := e.start(t)

	holder := e.python(t)
	held, refused := 0, 0
	dial := func() string {
		got := holder.dial(t, port)
		switch {
		case strings.HasPrefix(got, "ok "):
			held++
		case got == "err 1":
			refused++
		default:
			t.Fatalf("holder connect: %q", got)
		}
		return got
	}
	for range limit - 1 {
		if got := dial(); !strings.HasPrefix(got, "ok ") {
			t.Fatalf("holder connect under the limit: %q", got)
		}
	}
	churn := e.churn(t, port)
	clocktest.Eventually(t, "the churn under way: ten connections of it admitted", func() bool { return e.limit(t, "web").Admitted >= limit-1+10 })

	d.kill(t)
	// The churner's progress cannot be seen with no daemon: it churns on for a while.
	time.Sleep(100 * time.Millisecond)
	// Take the last slot; the churner holds it at moments, so try again.
	clocktest.Eventually(t, "the holder to take the last slot with the daemon dead", func() bool {
		dial()
		return held == limit
	})
	if got := dial(); got != "err 1" {
		t.Fatalf("connect over the limit with the daemon dead: %q, want err 1 (EPERM)", got)
	}

	e.start(t)
	var st control.Status
	e.json(t, &st, "status")
	if !st.Adopted {
		t.Errorf("status after SIGKILL and restart: not adopted: %+v", st)
	}
	admitted, churnRefused, failed := churn.stop(t)
	t.Logf("churn: %d admitted, %d refused, %d failed; holder: %d held, %d refused", admitted, churnRefused, failed, held, refused)
	if admitted == 0 || churnRefused == 0 {
		t.Errorf("churn admitted %d and refused %d; want both, or the test did not churn across the limit", admitted, churnRefused)
	}

	// Every connect() of both clients is in the adopted counts.
	clocktest.Eventually(t, "live back to what the holder holds", func() bool { return e.limit(t, "web").Live == int64(held) })
	var ls []control.Limit
	e.json(t, &ls, "limit", "ls")
	checkLimits(t, ls, map[string]control.Limit{"web": {
		Name: "web", Source: "policy", Limit: limit, Live: int64(held),
		Admitted: uint64(held + admitted + failed), Refused: uint64(refused + churnRefused),
	}})
	if out := e.ok(t, "limit", "ls"); !regexp.MustCompile(fmt.Sprintf(`(?m)^web\s+concurrency\s+tcp\s+%d\s+%d\s`, limit, held)).MatchString(out) {
		t.Errorf("limit ls after the restart:\n%s", out)
	}
	// The new daemon enforces, and releases what the holder gives back.
	if got := dial(); got != "err 1" {
		t.Errorf("connect over the limit after the restart: %q, want err 1", got)
	}
	for i := range limit {
		holder.call(t, "close %d", i)
	}
	clocktest.Eventually(t, "live back to 0", func() bool { return e.limit(t, "web").Live == 0 })
}

// TestDaemonRestartKeepsHostRuleWhileDNSFails restarts the daemon while a
// rule's host name does not resolve. The kernel rule the stopped daemon
// left must go on enforcing with the addresses last resolved: enforcement
// never gaps across a restart, and a DNS hiccup is no reason to lift a
// limit. Each daemon runs in a mount namespace of its own with an
// /etc/hosts and /etc/resolv.conf the test writes, so the name resolves to
// loopback, or fails at once without a query leaving the host.
func TestDaemonRestartKeepsHostRuleWhileDNSFails(t *testing.T) {
	e := newEnv(t)
	if _, err := exec.LookPath("unshare"); err != nil {
		t.Skip("skipping: needs unshare(1) to give the daemon its own /etc/hosts")
	}
	port := listen(t)
	const host = "egressd-peer.test"
	dir := t.TempDir()
	resolv := filepath.Join(dir, "resolv.conf")
	writeFile(t, resolv, "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
	resolves := filepath.Join(dir, "hosts-resolves")
	writeFile(t, resolves, "127.0.0.1 localhost\n127.0.0.1 "+host+"\n")
	fails := filepath.Join(dir, "hosts-fails")
	writeFile(t, fails, "127.0.0.1 localhost\n")
	withHosts := func(hosts string) []string {
		return []string{"unshare", "--mount", "--propagation", "private", "sh", "-c",
			`mount --bind "$1" /etc/hosts || exit 1
			if [ -e /etc/resolv.conf ]; then mount --bind "$2" /etc/resolv.conf || exit 1; fi
			shift 2; exec "$@"`, "sh", hosts, resolv}
	}
	e.writePolicy(t, fmt.Sprintf("rules:\n  - name: peer\n    destination: %s\n    port: %d\n    concurrency: 1\n", host, port))

	d := e.startWrapped(t, withHosts(resolves)...)
	if l := e.limit(t, "peer"); l.Pending != "" || !slices.Equal(l.Destinations, []string{"127.0.0.1/32"}) {
		t.Fatalf("peer with %s resolving: %+v", host, l)
	}
	py := e.python(t)
	if got := []string{py.dial(t, port), py.dial(t, port)}; !slices.Equal(got, []string{"ok 0", "err 1"}) {
		t.Fatalf("connects: %q, want one admitted, then EPERM", got)
	}
	d.term(t)

	e.startWrapped(t, withHosts(fails)...)
	l := e.limit(t, "peer")
	t.Logf("peer after the restart: pending %q, destinations %v, live %d", l.Pending, l.Destinations, l.Live)
	if got := py.dial(t, port); got != "err 1" {
		t.Errorf("connect over the limit after a restart with %s not resolving: %q, want err 1 (the limit was lifted)", host, got)
	}
}

// TestSecondDaemonChangesNothing starts a second egressd run on the pins and
// socket of a running one, as an operator does who runs it by hand while the
// service runs, with a policy that has no rules. It must fail saying another
// egressd runs, and leave the running daemon's enforcement alone.
func TestSecondDaemonChangesNothing(t *testing.T) {
	e := newEnv(t)
	port := listen(t)
	e.writePolicy(t, policyRule("web", port, 2))
	e.start(t)

	empty := filepath.Join(t.TempDir(), "empty.yaml")
	writeFile(t, empty, "rules: []\n")
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	second := exec.CommandContext(ctx, egressd, "run", "--cgroup", e.cg, "--bpffs", e.pins, "--socket", e.socket,
		"--state-dir", e.state, "--policy", empty, "--metrics", freeAddr(t))
	second.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	out, err := second.CombinedOutput()
	if err == nil || !strings.Contains(string(out), "another egressd is listening") {
		t.Errorf("second egressd run: %v, want a failure saying another egressd runs:\n%s", err, out)
	}

	py := e.python(t)
	got := []string{py.dial(t, port), py.dial(t, port), py.dial(t, port)}
	if want := []string{"ok 0", "ok 1", "err 1"}; !slices.Equal(got, want) {
		t.Errorf("connects after a second egressd run failed to start: %q, want %q (the running daemon's limit of 2)\nsecond egressd run's log:\n%s", got, want, out)
	}
	if l := e.limit(t, "web"); l.Refused != 1 {
		t.Errorf("the running daemon's view of web: %+v", l)
	}
}

// TestDaemonRefusesBadInput sends bad policies, bad CLI values and malformed
// API requests: each gets a clear error, and nothing changes — not the rules,
// not enforcement, not the state directory.
func TestDaemonRefusesBadInput(t *testing.T) {
	e := newEnv(t)
	port := listen(t)
	e.writePolicy(t, policyRule("web", port, 1))
	d := e.start(t)
	py := e.python(t)
	if got := py.dial(t, port); got != "ok 0" {
		t.Fatalf("first connect: %q", got)
	}
	var before []control.Limit
	e.json(t, &before, "limit", "ls")

	t.Run("policy check", func(t *testing.T) {
		bad := filepath.Join(t.TempDir(), "bad.yaml")
		writeFile(t, bad, badPolicy)
		r := e.cli(t, "policy", "check", bad)
		if r.code != 1 {
			t.Fatalf("policy check of a bad file: exit %d, want 1\n%s", r.code, r.stderr)
		}
		var found []int
		for _, line := range lines(r.stderr) {
			if m := regexp.MustCompile(`^` + regexp.QuoteMeta(bad) + `:(\d+):\d+: `).FindStringSubmatch(line); m != nil {
				n, _ := strconv.Atoi(m[1])
				found = append(found, n)
			}
		}
		if want := []int{4, 8, 12}; !slices.Equal(found, want) {
			t.Errorf("policy check: problems on lines %v, want %v:\n%s", found, want, r.stderr)
		}
		if !strings.Contains(r.stderr, "3 problem(s)") {
			t.Errorf("policy check: no count of problems:\n%s", r.stderr)
		}
	})

	t.Run("policy reload", func(t *testing.T) {
		writeFile(t, e.policy, badPolicy)
		r := e.cli(t, "policy", "reload")
		if r.code == 0 {
			t.Fatalf("policy reload of a bad file succeeded:\n%s", r.stdout)
		}
		for _, want := range []string{`"10.0.0.300" is not a valid IP address`, "concurrency must be at least 1", `unknown field "colour"`} {
			if !strings.Contains(r.stderr, want) {
				t.Errorf("policy reload: stderr lacks %q:\n%s", want, r.stderr)
			}
		}
		var st control.Status
		e.json(t, &st, "status")
		if st.LastReload.OK || !strings.Contains(st.LastReload.Error, "concurrency must be at least 1") {
			t.Errorf("status after a refused reload: %+v", st.LastReload)
		}

		// SIGHUP, as systemctl reload sends it: refused the same way.
		if err := d.cmd.Process.Signal(syscall.SIGHUP); err != nil {
			t.Fatal(err)
		}
		var again control.Status
		clocktest.Eventually(t, "the SIGHUP reload in status", func() bool {
			e.json(t, &again, "status")
			return again.LastReload.Time.After(st.LastReload.Time)
		})
		if again.LastReload.OK || !strings.Contains(again.LastReload.Error, `unknown field "colour"`) {
			t.Errorf("status after a refused SIGHUP reload: %+v", again.LastReload)
		}
		if v, ok := e.scrape(t).value("egressd_policy_reloads_total", map[string]string{"outcome": "failure"}); !ok || v != 2 {
			t.Errorf("egressd_policy_reloads_total{outcome=failure} = %v (found %v), want 2", v, ok)
		}
		writeFile(t, e.policy, policyRule("web", port, 1))
	})

	t.Run("limit set", func(t *testing.T) {
		for _, c := range []struct {
			name string
			args []string
			want []string
		}{
			{"zero concurrency", []string{"--dest", "127.0.0.1", "--concurrency", "0"}, []string{"concurrency must be at least 1"}},
			{"two shapes", []string{"--dest", "127.0.0.1", "--concurrency", "2", "--per-second", "5"}, []string{"concurrency and perSecond are both given"}},
			{"bad CIDR", []string{"--dest", "10.0.0.0/33", "--concurrency", "2"}, []string{`"10.0.0.0/33" is not a valid CIDR`}},
			{"every problem at once", []string{"--dest", "10.0.0.0/33", "--port", "70000", "--concurrency", "0", "--errno", "EBOGUS"},
				[]string{`"10.0.0.0/33" is not a valid CIDR`, "port 70000 is outside 1..65535", "concurrency must be at least 1", `errno "EBOGUS"`}},
			{"same traffic as a rule", []string{"--dest", "127.0.0.1", "--port", strconv.Itoa(port), "--concurrency", "5"}, []string{"same scope, destination and port as rule web"}},
		} {
			t.Run(c.name, func(t *testing.T) {
				r := e.cli(t, append([]string{"limit", "set", "bad"}, c.args...)...)
				if r.code == 0 {
					t.Fatalf("limit set %q succeeded:\n%s", c.args, r.stdout)
				}
				for _, w := range c.want {
					if !strings.Contains(r.stderr, w) {
						t.Errorf("limit set %q: stderr lacks %q:\n%s", c.args, w, r.stderr)
					}
				}
			})
		}
	})

	t.Run("malformed API requests", func(t *testing.T) {
		hc := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{
			DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
				return (&net.Dialer{}).DialContext(ctx, "unix", e.socket)
			},
		}}
		t.Cleanup(hc.CloseIdleConnections)
		for _, c := range []struct {
			name, method, path, body string
			header                   string
			status                   int
			want                     string
		}{
			{"truncated JSON", "POST", "limit/set", `{"rule": "name: x`, "", 400, "malformed JSON"},
			{"not JSON", "POST", "limit/set", `rule=x`, "", 400, "malformed JSON"},
			{"wrong type", "POST", "limit/set", `{"rule": 5}`, "", 400, `field "rule"`},
			{"unknown field", "POST", "limit/set", `{"rule": "name: x", "force": true}`, "", 400, `unknown field "force"`},
			{"two values", "POST", "limit/set", `{"rule": "name: x"} {}`, "", 400, "data after the JSON value"},
			{"bad YAML rule", "POST", "limit/set", `{"rule": "name: [x"}`, "", 400, "YAML"},
			{"empty rule", "POST", "limit/set", `{"rule": ""}`, "", 400, "a rule must be a mapping"},
			{"remove unknown rule", "POST", "limit/remove", `{"name": "nosuch"}`, "", 404, "nosuch"},
			{"wrong method", "GET", "limit/set", ``, "", 405, "method GET not allowed"},
			{"browser", "POST", "limit/set", `{"rule": "name: x"}`, "Origin", 403, "Origin"},
		} {
			t.Run(c.name, func(t *testing.T) {
				req, err := http.NewRequest(c.method, "http://egressd"+control.Prefix+c.path, strings.NewReader(c.body))
				if err != nil {
					t.Fatal(err)
				}
				req.Header.Set("Content-Type", "application/json")
				if c.header != "" {
					req.Header.Set(c.header, "http://example.com")
				}
				resp, err := hc.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				defer resp.Body.Close()
				var body struct{ Error, Code string }
				if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
					t.Fatalf("%s %s: status %d, body not an API error: %v", c.method, c.path, resp.StatusCode, err)
				}
				if resp.StatusCode != c.status || !strings.Contains(body.Error, c.want) {
					t.Errorf("%s %s %q: %d %+v, want %d with %q", c.method, c.path, c.body, resp.StatusCode, body, c.status, c.want)
				}
			})
		}
	})

	t.Run("unknown rule", func(t *testing.T) {
		for _, args := range [][]string{{"limit", "get", "nosuch"}, {"limit", "rm", "nosuch"}} {
			r := e.cli(t, args...)
			if r.code == 0 || !strings.Contains(r.stderr, "rule nosuch: no such rule") {
				t.Errorf("%q: exit %d, stderr %q; want a failure naming the rule", args, r.code, r.stderr)
			}
		}
	})

	// Nothing changed: the same rules with the same counts, enforcement,
	// and no state saved.
	var after []control.Limit
	e.json(t, &after, "limit", "ls")
	if !slices.EqualFunc(before, after, func(a, b control.Limit) bool {
		return a.Name == b.Name && a.Source == b.Source && a.Rule == b.Rule && a.Limit == b.Limit && a.Live == b.Live && a.Admitted == b.Admitted
	}) {
		t.Errorf("limit ls changed:\nbefore %+v\nafter  %+v", before, after)
	}
	if got := py.dial(t, port); got != "err 1" {
		t.Errorf("connect over the limit after the bad inputs: %q, want err 1", got)
	}
	// The start kept its policy as the last applied; nothing since.
	if ents, err := os.ReadDir(e.state); err != nil || len(ents) != 1 || ents[0].Name() != "policy.last-good.yaml" {
		t.Errorf("state dir after refused changes: %v %v, want only the policy the start applied", ents, err)
	} else if kept, err := os.ReadFile(filepath.Join(e.state, ents[0].Name())); err != nil || string(kept) != policyRule("web", port, 1) {
		t.Errorf("kept as the last policy applied: %q, %v; want the start's", kept, err)
	}

	// And a good reload after all that applies, keeping web's counts.
	writeFile(t, e.policy, policyRule("web", port, 1)+"  - name: other\n    destination: 127.0.0.2\n    concurrency: 1\n")
	e.ok(t, "policy", "reload")
	var reloaded []control.Limit
	e.json(t, &reloaded, "limit", "ls")
	checkLimits(t, reloaded, map[string]control.Limit{
		"other": {Source: "policy", Limit: 1},
		"web":   {Source: "policy", Limit: 1, Live: 1, Admitted: 1, Refused: 1},
	})
}

// badPolicy has three problems, on lines 4, 8 and 12.
const badPolicy = `# three problems
rules:
  - name: a
    destination: 10.0.0.300
    concurrency: 1
  - name: b
    destination: 10.0.0.0/8
    concurrency: 0
  - name: c
    destination: 10.1.0.0/16
    concurrency: 1
    colour: red
`

func policyRule(name string, port, concurrency int) string {
	return fmt.Sprintf("rules:\n  - name: %s\n    destination: 127.0.0.1\n    port: %d\n    concurrency: %d\n", name, port, concurrency)
}

// checkLimits compares the rules listed with want by name, on the fields
// want sets: source, limit and counts.
func checkLimits(t *testing.T, got []control.Limit, want map[string]control.Limit) {
	t.Helper()
	if len(got) != len(want) {
		t.Errorf("%d rules, want %d: %+v", len(got), len(want), got)
	}
	for _, g := range got {
		w, ok := want[g.Name]
		if !ok {
			t.Errorf("unexpected rule %+v", g)
			continue
		}
		if g.Source != w.Source || g.Limit != w.Limit || g.Live != w.Live || g.Admitted != w.Admitted || g.Refused != w.Refused || g.Pending != "" {
			t.Errorf("rule %s: source %s limit %d live %d admitted %d refused %d pending %q; want %s %d %d %d %d",
				g.Name, g.Source, g.Limit, g.Live, g.Admitted, g.Refused, g.Pending, w.Source, w.Limit, w.Live, w.Admitted, w.Refused)
		}
	}
}

// env is one daemon's world: a cgroup, pins, state, socket, policy file
// and metrics address of its own. Daemons started in it share them, as a
// restarted daemon does.
type env struct {
	cg, pins, state, socket, policy, metrics string
	// args are more flags for egressd run. argv, when set, is instead
	// the whole command line after the binary, the env's paths in it.
	args []string
	argv []string
	// ns, when set, is the network namespace the daemon runs in (its
	// metrics listen there); by default the test's own.
	ns *privtest.NetNS
}

func newEnv(t *testing.T) *env {
	t.Helper()
	privtest.RequireRoot(t)
	return newEnvOn(t, privtest.Cgroup(t, "daemon"))
}

// newEnvOn is newEnv whose daemon attaches to cg.
func newEnvOn(t *testing.T, cg string) *env {
	t.Helper()
	privtest.RequireRoot(t)
	if _, err := exec.LookPath("python3"); err != nil {
		t.Skip("skipping: needs python3 for a client that is not Go")
	}
	dir := t.TempDir()
	e := &env{
		cg:      cg,
		pins:    privtest.PinDir(t),
		state:   filepath.Join(dir, "state"),
		socket:  filepath.Join(dir, "egressd.sock"),
		policy:  filepath.Join(dir, "policy.yaml"),
		metrics: freeAddr(t),
	}
	if len(e.socket) >= 100 {
		t.Fatalf("socket path %s is too long for a unix socket", e.socket)
	}
	return e
}

func (e *env) writePolicy(t *testing.T, text string) { writeFile(t, e.policy, text) }

func writeFile(t *testing.T, path, text string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
}

// freeAddr returns a loopback address nothing listens on now, for a
// daemon to listen on.
func freeAddr(t *testing.T) string {
	t.Helper()
	return "127.0.0.1:" + strconv.Itoa(testport.Free(t))
}

// listen accepts loopback connections and holds each until its client
// closes it; all are closed when the test ends. It returns the port.
func listen(t testing.TB) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	conns := map[net.Conn]bool{}
	done := false
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			if done { // accepted while the cleanup closed the others
				mu.Unlock()
				c.Close()
				return
			}
			conns[c] = true
			mu.Unlock()
			wg.Go(func() {
				io.Copy(io.Discard, c)
				c.Close()
				mu.Lock()
				delete(conns, c)
				mu.Unlock()
			})
		}
	})
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		done = true
		for c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return ln.Addr().(*net.TCPAddr).Port
}

// daemon is one egressd run process.
type daemon struct {
	cmd  *exec.Cmd
	log  *syncBuffer
	done chan struct{}
	err  error // the process's exit, once done is closed
}

// start runs egressd run and waits until it answers on its socket. The
// process is killed when the test ends, and its log shown if the test
// failed.
func (e *env) start(t *testing.T) *daemon {
	t.Helper()
	return e.startWrapped(t)
}

// startWrapped is start with the command run by a wrapper: wrapper...
// followed by egressd run and its arguments.
func (e *env) startWrapped(t *testing.T, wrapper ...string) *daemon {
	t.Helper()
	d := &daemon{log: &syncBuffer{}, done: make(chan struct{})}
	args := append(wrapper, egressd, "run", "--cgroup", e.cg, "--bpffs", e.pins, "--socket", e.socket,
		"--state-dir", e.state, "--policy", e.policy, "--metrics", e.metrics, "--log-level", "debug")
	args = append(args, e.args...)
	if e.argv != nil {
		args = append(append(wrapper[:len(wrapper):len(wrapper)], egressd), e.argv...)
	}
	d.cmd = exec.Command(args[0], args[1:]...)
	d.cmd.Stdout, d.cmd.Stderr = d.log, d.log
	d.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	start := d.cmd.Start
	if e.ns != nil {
		start = func() error { return e.ns.Do(d.cmd.Start) }
	}
	if err := start(); err != nil {
		t.Fatalf("start egressd run: %v", err)
	}
	go func() { d.err = d.cmd.Wait(); close(d.done) }()
	t.Cleanup(func() {
		select {
		case <-d.done:
		default:
			d.cmd.Process.Kill()
			<-d.done
		}
		if t.Failed() {
			t.Logf("egressd run (pid %d) log:\n%s", d.cmd.Process.Pid, d.log)
		}
	})
	cl := &control.Client{Socket: e.socket, Timeout: time.Second}
	defer cl.CloseIdleConnections()
	// Its log is the test's once it fails.
	clocktest.Eventually(t, "egressd run to answer on "+e.socket, func() bool {
		select {
		case <-d.done:
			t.Fatalf("egressd run exited before serving: %v", d.err)
		default:
		}
		_, err := cl.Status(context.Background())
		return err == nil
	})
	return d
}

// wait waits for the daemon to exit by itself and returns how it did.
func (d *daemon) wait(timeout time.Duration) error {
	select {
	case <-d.done:
		return d.err
	case <-time.After(timeout):
		return fmt.Errorf("still running after %v", timeout)
	}
}

// term stops the daemon with SIGTERM, as systemd does, and wants a clean
// exit.
func (d *daemon) term(t *testing.T) {
	t.Helper()
	if err := d.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := d.wait(10 * time.Second); err != nil {
		t.Fatalf("egressd run after SIGTERM: %v\n%s", err, d.log)
	}
}

// kill stops the daemon with SIGKILL: a crash.
func (d *daemon) kill(t *testing.T) {
	t.Helper()
	if err := d.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	<-d.done
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

type result struct {
	stdout, stderr string
	code           int
}

// cli runs the egressd CLI against the env's daemon.
func (e *env) cli(t *testing.T, args ...string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, egressd, append([]string{"--socket", e.socket}, args...)...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var exit *exec.ExitError
	if err != nil && !errors.As(err, &exit) {
		t.Fatalf("egressd %q: %v", args, err)
	}
	return result{stdout: stdout.String(), stderr: stderr.String(), code: cmd.ProcessState.ExitCode()}
}

// ok runs the CLI, wants success and returns its output.
func (e *env) ok(t *testing.T, args ...string) string {
	t.Helper()
	r := e.cli(t, args...)
	if r.code != 0 {
		t.Fatalf("egressd %q: exit %d\n%s%s", args, r.code, r.stdout, r.stderr)
	}
	return r.stdout
}

// json runs the CLI with --json and decodes its output into v.
func (e *env) json(t *testing.T, v any, args ...string) {
	t.Helper()
	out := e.ok(t, append([]string{"--json"}, args...)...)
	if err := json.Unmarshal([]byte(out), v); err != nil {
		t.Fatalf("egressd --json %q: %v\n%s", args, err, out)
	}
}

func (e *env) limit(t *testing.T, name string) control.Limit {
	t.Helper()
	var l control.Limit
	e.json(t, &l, "limit", "get", name)
	return l
}

func lines(s string) []string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.TrimSpace(l) != "" {
			out = append(out, l)
		}
	}
	return out
}

// metrics is one scrape of /metrics: the samples of each family.
type metrics map[string][]sample

type sample struct {
	labels map[string]string
	value  float64
}

// scrape reads the daemon's /metrics over HTTP.
func (e *env) scrape(t *testing.T) metrics {
	t.Helper()
	hc := &http.Client{Timeout: 5 * time.Second}
	if e.ns != nil {
		hc.Transport = &http.Transport{DialContext: func(ctx context.Context, network, addr string) (c net.Conn, err error) {
			err = e.ns.Do(func() (err error) { c, err = (&net.Dialer{}).DialContext(ctx, network, addr); return err })
			return c, err
		}}
	}
	resp, err := hc.Get("http://" + e.metrics + "/metrics")
	if err != nil {
		t.Fatalf("scrape: %v", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("scrape: %s", resp.Status)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("scrape: parse: %v", err)
	}
	out := metrics{}
	for name, f := range fams {
		var samples []sample
		for _, m := range f.GetMetric() {
			s := sample{labels: map[string]string{}}
			for _, lp := range m.GetLabel() {
				s.labels[lp.GetName()] = lp.GetValue()
			}
			switch {
			case m.Counter != nil:
				s.value = m.GetCounter().GetValue()
			case m.Gauge != nil:
				s.value = m.GetGauge().GetValue()
			case m.Untyped != nil:
				s.value = m.GetUntyped().GetValue()
			default:
				continue
			}
			samples = append(samples, s)
		}
		out[name] = samples
	}
	return out
}

// value finds the sample of a family with exactly these labels.
func (m metrics) value(name string, labels map[string]string) (float64, bool) {
	for _, s := range m[name] {
		if maps.Equal(s.labels, labels) {
			return s.value, true
		}
	}
	return 0, false
}

// agentScript dials and closes TCP connections on command, one per line:
// "dial HOST PORT" answers "ok ID" or "err ERRNO"; "close ID" answers "ok".
const agentScript = `
import os, socket, sys
conns, n = {}, 0
print("ready %d" % os.getpid(), flush=True)
for line in sys.stdin:
    f = line.split()
    if f[0] == "dial":
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.connect((f[1], int(f[2])))
        except OSError as e:
            s.close()
            print("err %d" % (e.errno or -1), flush=True)
            continue
        conns[n] = s
        print("ok %d" % n, flush=True)
        n += 1
    elif f[0] == "close":
        conns.pop(int(f[1])).close()
        print("ok", flush=True)
    else:
        sys.exit("agent: bad command %r" % line)
`

// churnScript connects and closes as fast as it can, one connection at a
// time, until its input closes; then it prints what happened.
const churnScript = `
import errno, socket, sys, threading, time
host, port = sys.argv[1], int(sys.argv[2])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
admitted = refused = failed = 0
while not stop.is_set():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.connect((host, port))
        admitted += 1
    except OSError as e:
        if e.errno == errno.EPERM:
            refused += 1
        else:
            failed += 1
    s.close()
    if admitted + refused + failed == 1:
        print("started", flush=True)
    time.sleep(0.0005)
print("admitted %d refused %d failed %d" % (admitted, refused, failed), flush=True)
`

// pyProc is a python3 process started inside the env's cgroup, so that
// every socket it creates is the cgroup's.
type pyProc struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	out   chan string
	pid   int
	done  chan struct{}
}

func (e *env) startPython(t *testing.T, script string, args ...string) *pyProc {
	t.Helper()
	return startPythonIn(t, nil, e.cg, script, args...)
}

// startPythonIn starts python3 in cgroup dir and, unless ns is nil, in
// network namespace ns.
func startPythonIn(t *testing.T, ns *privtest.NetNS, dir, script string, args ...string) *pyProc {
	t.Helper()
	cg, err := os.Open(dir)
	if err != nil {
		t.Fatalf("open cgroup: %v", err)
	}
	defer cg.Close()
	cmd := exec.Command("python3", append([]string{"-c", script}, args...)...)
	cmd.Stderr = os.Stderr
	// Born in the cgroup (clone3 CLONE_INTO_CGROUP): no socket of it is
	// ever created elsewhere.
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(cg.Fd()), Pdeathsig: syscall.SIGKILL}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	start := func() error { return cmd.Start() }
	if ns != nil {
		start = func() error { return ns.Do(cmd.Start) }
	}
	if err := start(); err != nil {
		t.Fatalf("start python3: %v", err)
	}
	p := &pyProc{cmd: cmd, stdin: stdin, out: make(chan string, 16), pid: cmd.Process.Pid, done: make(chan struct{})}
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			p.out <- sc.Text()
		}
		close(p.out)
		cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		stdin.Close()
		select {
		case <-p.done:
		case <-time.After(2 * time.Second):
			cmd.Process.Kill()
			<-p.done
		}
	})
	return p
}

// line reads the process's next output line.
func (p *pyProc) line(t *testing.T) string {
	t.Helper()
	select {
	case l, ok := <-p.out:
		if !ok {
			t.Fatalf("python3 (pid %d) exited", p.pid)
		}
		return l
	case <-time.After(10 * time.Second):
		t.Fatalf("python3 (pid %d) did not answer", p.pid)
	}
	return ""
}

// python starts the connection agent in the cgroup.
func (e *env) python(t *testing.T) *pyProc {
	t.Helper()
	p := e.startPython(t, agentScript)
	if got, want := p.line(t), fmt.Sprintf("ready %d", p.pid); got != want {
		t.Fatalf("agent: %q, want %q", got, want)
	}
	return p
}

func (p *pyProc) call(t *testing.T, format string, args ...any) string {
	t.Helper()
	if _, err := fmt.Fprintf(p.stdin, format+"\n", args...); err != nil {
		t.Fatalf("python3: %v", err)
	}
	return p.line(t)
}

// dial connects to a loopback port: "ok ID" or "err ERRNO".
func (p *pyProc) dial(t *testing.T, port int) string {
	t.Helper()
	return p.call(t, "dial 127.0.0.1 %d", port)
}

// churn starts connecting and closing in the cgroup in a loop.
func (e *env) churn(t *testing.T, port int) *pyProc {
	t.Helper()
	p := e.startPython(t, churnScript, "127.0.0.1", strconv.Itoa(port))
	if got := p.line(t); got != "started" {
		t.Fatalf("churn: %q", got)
	}
	return p
}

// stop ends the churn and returns its counts.
func (p *pyProc) stop(t *testing.T) (admitted, refused, failed int) {
	t.Helper()
	p.stdin.Close()
	l := p.line(t)
	if _, err := fmt.Sscanf(l, "admitted %d refused %d failed %d", &admitted, &refused, &failed); err != nil {
		t.Fatalf("churn: %q: %v", l, err)
	}
	<-p.done
	return admitted, refused, failed
}

// TestDaemonStartsDespiteConflictingCLILimit: a run-time limit that the
// policy file came to conflict with while the daemon was down must not keep
// the daemon from starting (under Restart=always it would loop, and the
// CLI that could fix it would have nothing to talk to).
func TestDaemonStartsDespiteConflictingCLILimit(t *testing.T) {
	e := newEnv(t)
	webPort, apiPort := listen(t), listen(t)
	e.writePolicy(t, policyRule("web", webPort, 2))
	d := e.start(t)
	e.ok(t, "limit", "set", "api", "--dest", "127.0.0.1", "--port", strconv.Itoa(apiPort), "--concurrency", "1")
	d.term(t)

	// The file now claims api's destination and port under another name.
	e.writePolicy(t, policyRule("web", webPort, 2)+"  - name: payments\n    destination: 127.0.0.1\n    port: "+strconv.Itoa(apiPort)+"\n    concurrency: 5\n")
	e.start(t)
	var st control.Status
	e.json(t, &st, "status")
	if st.LastReload.OK || !strings.Contains(st.LastReload.Error, "run-time limits not applied") {
		t.Fatalf("status: %+v, want the conflict reported", st.LastReload)
	}
	var ls []control.Limit
	e.json(t, &ls, "limit", "ls")
	checkLimits(t, ls, map[string]control.Limit{
		"web":      {Name: "web", Source: "policy", Limit: 2},
		"payments": {Name: "payments", Source: "policy", Limit: 5},
	})
	// The CLI can remove the conflicting run-time limit; then the rest of
	// the saved limits apply again on the next start.
	e.ok(t, "limit", "rm", "api")
	// --json after the command name works too.
	if out := e.ok(t, "limit", "ls", "--json"); !strings.HasPrefix(strings.TrimSpace(out), "[") {
		t.Fatalf("limit ls --json:\n%s", out)
	}
}

// TestDaemonAttributesRefusals answers the SDK's question — did egressd
// refuse this process's connect() to this destination just now? — yes for
// its own refusal, no for another process or destination.
func TestDaemonAttributesRefusals(t *testing.T) {
	e := newEnv(t)
	port, other := listen(t), listen(t)
	e.writePolicy(t, policyRule("web", port, 1))
	e.start(t)
	py := e.python(t)
	if got := []string{py.dial(t, port), py.dial(t, port)}; !slices.Equal(got, []string{"ok 0", "err 1"}) {
		t.Fatalf("connects: %q", got)
	}
	c := &control.Client{Socket: e.socket}
	dest := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), uint16(port))
	tests := []struct {
		pid  int
		dest netip.AddrPort
		want control.Attribution
	}{
		{py.pid, dest, control.Attribution{Refused: true, Rule: "web"}},
		{py.pid + 1, dest, control.Attribution{}},
		{py.pid, netip.AddrPortFrom(dest.Addr(), uint16(other)), control.Attribution{}},
	}
	for _, tt := range tests {
		got, err := c.Attribute(context.Background(), tt.pid, "", tt.dest)
		// The refusal was just now: the time since is the test's.
		if got.Refused && (got.SecondsAgo < 0 || got.SecondsAgo > 60) {
			t.Errorf("Attribute(%d, %s): refused %v s ago, want the moment the test refused it", tt.pid, tt.dest, got.SecondsAgo)
		}
		got.SecondsAgo = 0
		if err != nil || got != tt.want {
			t.Errorf("Attribute(%d, %s) = %+v, %v; want %+v", tt.pid, tt.dest, got, err, tt.want)
		}
	}
}
