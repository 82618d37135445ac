package tests

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf/link"

	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/internal/privtest"
	"github.com/egressd/egressd/internal/redistest"
	"github.com/egressd/egressd/internal/testport"
)

// startHTTP10 starts python3's http.server on a loopback port and returns
// the port. It speaks HTTP/1.0 and closes each connection once it has
// answered: the client's socket sees the server's FIN before its own
// close(), the case where a second egressd used to take the first's mark
// off.
func startHTTP10(t *testing.T) int {
	t.Helper()
	port := testport.Free(t)
	cmd := exec.Command("python3", "-m", "http.server", "--bind", "127.0.0.1", "--directory", t.TempDir(), strconv.Itoa(port))
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start http.server: %v", err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	clocktest.Eventually(t, "http.server listening", func() bool {
		c, err := net.Dial("tcp4", fmt.Sprintf("127.0.0.1:%d", port))
		if err == nil {
			c.Close()
		}
		return err == nil
	})
	return port
}

// resetAtOnce accepts loopback connections and resets each at once.
func resetAtOnce(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.(*net.TCPConn).SetLinger(0)
			c.Close()
		}
	}()
	return ln.Addr().(*net.TCPAddr).Port
}

// curlIn fetches / from port with curl started in cgroup cg, and wants a
// 200.
func curlIn(t *testing.T, cg string, port int) {
	t.Helper()
	dir, err := os.Open(cg)
	if err != nil {
		t.Fatal(err)
	}
	defer dir.Close()
	cmd := exec.Command("curl", "-sS", "-o", "/dev/null", "--max-time", "10", "-w", "%{http_code}", fmt.Sprintf("http://127.0.0.1:%d/", port))
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(dir.Fd()), Pdeathsig: syscall.SIGKILL}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil || string(out) != "200" {
		t.Fatalf("curl in %s: %q, %v: %s", filepath.Base(cg), out, err, stderr.String())
	}
}

// TestNestedDaemons: two egressd daemons, one on a cgroup and one on its
// child, the rule on either or both, started in either order and each
// killed -9 and started again (adopting its datapath) in the order they
// started, keep exact counts of their own rules through real clients in
// the child: curl against an HTTP/1.0 server that closes first,
// connections the server resets while the client keeps them open, and a
// client killed -9 holding the limit's worth. After each round every rule
// has no live connection, admits the limit's worth again and refuses the
// next. Before sockops stopped taking the marks off sockets it held no
// state for, the daemon without the rule made the other's slots leak at
// the first requests, and then every request was refused.
func TestNestedDaemons(t *testing.T) {
	const limit = 2
	http10, reset, holder := startHTTP10(t), resetAtOnce(t), listen(t)
	for _, tc := range []struct {
		name                 string
		outerRule, innerRule bool
		innerFirst           bool
	}{
		{"rule above, outer started first", true, false, false},
		{"rule above, inner started first", true, false, true},
		{"rule below, outer started first", false, true, false},
		{"rule below, inner started first", false, true, true},
		{"rules on both, outer started first", true, true, false},
		{"rules on both, inner started first", true, true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			outer := newEnv(t)
			inner := newEnvOn(t, privtest.SubCgroup(t, outer.cg, "inner"))
			limited := map[*env]bool{outer: tc.outerRule, inner: tc.innerRule}
			for e, on := range limited {
				e.writePolicy(t, "")
				if on {
					e.writePolicy(t, fmt.Sprintf("rules:\n  - {name: local, destination: 127.0.0.1, concurrency: %d}\n", limit))
				}
			}
			order := []*env{outer, inner}
			if tc.innerFirst {
				order = []*env{inner, outer}
			}
			daemons := map[*env]*daemon{}
			for _, e := range order {
				daemons[e] = e.start(t)
			}
			round := func(when string) {
				t.Helper()
				for range 3 * limit {
					curlIn(t, inner.cg, http10)
				}
				a := startPythonIn(t, nil, inner.cg, agentScript)
				a.line(t)
				for range 3 * limit {
					if got := a.dial(t, reset); !strings.HasPrefix(got, "ok ") {
						t.Fatalf("%s: dial the resetting server: %s", when, got)
					}
					// Held open after the reset: its slot comes back as
					// the reset comes in.
					for e, on := range limited {
						if on {
							clocktest.Eventually(t, when+": no live connection after a reset", func() bool { return e.limit(t, "local").Live == 0 })
						}
					}
				}
				k := startPythonIn(t, nil, inner.cg, agentScript)
				k.line(t)
				for i := range limit + 1 {
					got := k.dial(t, holder)
					if want := map[bool]string{true: "ok", false: "err 1"}[i < limit]; !strings.HasPrefix(got, want) {
						t.Fatalf("%s: connection %d of a limit of %d: %s, want %s", when, i, limit, got, want)
					}
				}
				k.cmd.Process.Kill()
				<-k.done
				for e, on := range limited {
					if on {
						clocktest.Eventually(t, when+": no live connection after the kill", func() bool { return e.limit(t, "local").Live == 0 })
					}
				}
			}
			round("first round")
			for _, e := range order {
				daemons[e].kill(t)
				daemons[e] = e.start(t)
			}
			round("after restarts")
			for e, on := range limited {
				if !on {
					continue
				}
				// Every connection of the two rounds, admitted and given back.
				l := e.limit(t, "local")
				if want := uint64(2 * (3*limit + 3*limit + limit)); l.Live != 0 || l.Admitted != want {
					t.Errorf("%s: live %d, admitted %d; want 0 and %d", e.cg, l.Live, l.Admitted, want)
				}
			}
		})
	}
}

// serviceRound runs clients in cgroup service against the rule "local" of
// e, a concurrency limit of limit on 127.0.0.1: curl against an HTTP/1.0
// server that closes first, connections the server resets, and a client
// killed -9 holding the limit's worth (one more is refused). Afterwards the
// rule has no live connection.
func serviceRound(t *testing.T, e *env, service string, limit, http10, reset, holder int) {
	t.Helper()
	for range 2 * limit {
		curlIn(t, service, http10)
	}
	a := startPythonIn(t, nil, service, agentScript)
	a.line(t)
	for range 2 * limit {
		got := a.dial(t, reset)
		id, ok := strings.CutPrefix(got, "ok ")
		if !ok {
			t.Fatalf("dial the resetting server: %s", got)
		}
		a.call(t, "close %s", id)
	}
	k := startPythonIn(t, nil, service, agentScript)
	k.line(t)
	for i := range limit + 1 {
		got := k.dial(t, holder)
		if want := map[bool]string{true: "ok", false: "err 1"}[i < limit]; !strings.HasPrefix(got, want) {
			t.Fatalf("connection %d of a limit of %d: %s, want %s", i, limit, got, want)
		}
	}
	k.cmd.Process.Kill()
	<-k.done
	clocktest.Eventually(t, "no live connection after the round", func() bool { return e.limit(t, "local").Live == 0 })
}

// TestOtherProgramsMarks: another program that clears, sets or turns over
// the sockops callback flags egressd marks its sockets with, above and
// below egressd's cgroup, costs no slot: after rounds of real clients the
// rule has no live connection and the recounts (every second) gave
// nothing back, for there was nothing to.
func TestOtherProgramsMarks(t *testing.T) {
	const limit = 3
	http10, reset, holder := startHTTP10(t), resetAtOnce(t), listen(t)
	for _, tc := range []struct {
		name string
		how  privtest.Flip
	}{{"clears", privtest.FlipClear}, {"sets", privtest.FlipSet}, {"toggles", privtest.FlipToggle}} {
		t.Run(tc.name, func(t *testing.T) {
			privtest.RequireRoot(t)
			top := privtest.Cgroup(t, "flip")
			e := newEnvOn(t, privtest.SubCgroup(t, top, "egressd"))
			service := privtest.SubCgroup(t, e.cg, "service")
			privtest.AttachFlipper(t, top, tc.how)
			privtest.AttachFlipper(t, service, tc.how)
			e.args = []string{"--recount-every", "1s"}
			e.writePolicy(t, fmt.Sprintf("rules:\n  - {name: local, destination: 127.0.0.1, concurrency: %d}\n", limit))
			d := e.start(t)
			for range 2 {
				serviceRound(t, e, service, limit, http10, reset, holder)
			}
			// Two recounts more: had a slot been lost, the second would
			// give it back.
			time.Sleep(2500 * time.Millisecond)
			m := e.scrape(t)
			for _, cause := range []string{"freed_socket", "drift"} {
				if v, ok := m.value("egressd_recount_released_total", map[string]string{"rule": "local", "cause": cause}); !ok || v != 0 {
					t.Errorf("egressd_recount_released_total{cause=%s} %v (%v), want 0", cause, v, ok)
				}
			}
			if strings.Contains(d.log.String(), "recount drift") {
				t.Errorf("a recount found drift:\n%s", d.log)
			}
		})
	}
}

// detachSockRelease detaches the sock_release program of the datapath
// pinned at pins and removes its link's pin: sockets closed afterwards are
// freed as by a close the kernel runs no sock_release for, until a daemon
// started again attaches it again.
func detachSockRelease(t *testing.T, pins string) {
	t.Helper()
	l, err := link.LoadPinnedLink(filepath.Join(pins, "links", "sock_release"), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if err := l.Detach(); err != nil {
		t.Fatal(err)
	}
	if err := l.Unpin(); err != nil {
		t.Fatal(err)
	}
}

// TestRecountGivesBackLostSlots: slots lost to closes that ran no
// sock_release (the test detaches it, and a program above and below
// egressd clears the marks, so that nothing else gives them back either)
// are given back by the recount within two of its periods, and counted in
// the metrics, the events and the log. Started again (which puts
// sock_release back), the daemon's rule serves a round of clients.
func TestRecountGivesBackLostSlots(t *testing.T) {
	const limit = 3
	privtest.RequireRoot(t)
	top := privtest.Cgroup(t, "lost")
	e := newEnvOn(t, privtest.SubCgroup(t, top, "egressd"))
	service := privtest.SubCgroup(t, e.cg, "service")
	privtest.AttachFlipper(t, top, privtest.FlipClear)
	privtest.AttachFlipper(t, service, privtest.FlipClear)
	http10, reset, holder := startHTTP10(t), resetAtOnce(t), listen(t)
	closed := testport.Free(t)
	e.args = []string{"--recount-every", "1s"}
	e.writePolicy(t, fmt.Sprintf("rules:\n  - {name: local, destination: 127.0.0.1, concurrency: %d}\n", limit))
	d := e.start(t)
	serviceRound(t, e, service, limit, http10, reset, holder)

	detachSockRelease(t, e.pins)
	// Refused by the peer: each socket holds its slot until it is closed,
	// and its close, with no sock_release, gives none back.
	a := startPythonIn(t, nil, service, agentScript)
	a.line(t)
	for range limit {
		if got := a.dial(t, closed); got != "err 111" {
			t.Fatalf("dial a closed port: %s, want ECONNREFUSED", got)
		}
	}
	lostAt := time.Now()
	// Every slot lost: the rule refuses everything, until a recount gives
	// them back. The recount comes every second, and on a loaded machine
	// may come first: what was seen is checked only if none gave a slot
	// back by the end (the count given back only grows).
	live := e.limit(t, "local").Live
	got := a.dial(t, holder)
	if v, _ := e.scrape(t).value("egressd_recount_released_total", map[string]string{"rule": "local", "cause": "freed_socket"}); v == 0 {
		if live != limit {
			t.Fatalf("live %d after %d closes without sock_release, want %d", live, limit, limit)
		}
		if got != "err 1" {
			t.Fatalf("dial with every slot lost: %s, want EPERM", got)
		}
	} else if id, ok := strings.CutPrefix(got, "ok "); ok {
		if reply := a.call(t, "close %s", id); reply != "ok" {
			t.Fatalf("close: %s", reply)
		}
	}
	clocktest.Eventually(t, "the recounts to give the lost slots back", func() bool { return e.limit(t, "local").Live == 0 })
	// A recount that starts just after the loss gives the slots back; the
	// next one starts a period later, at the most.
	if took := time.Since(lostAt); took > 2*time.Second {
		t.Errorf("the slots came back %v after they were lost: more than two recount periods", took)
	}
	m := e.scrape(t)
	if v, _ := m.value("egressd_recount_released_total", map[string]string{"rule": "local", "cause": "freed_socket"}); v != limit {
		t.Errorf("egressd_recount_released_total{cause=freed_socket} %v, want %d", v, limit)
	}
	// The recounts' events, as the CLI shows them, add up to the slots.
	var given int
	events := e.ok(t, "events")
	for _, l := range lines(events) {
		var n, freed int
		if _, err := fmt.Sscanf(l[strings.Index(l, " ")+1:], "recount gave back %d slots of rule local (%d of sockets freed holding them, 0 held by no socket)", &n, &freed); err == nil && n == freed {
			given += n
		}
	}
	if given != limit {
		t.Errorf("recount events give back %d slots, want %d:\n%s", given, limit, events)
	}
	if !strings.Contains(d.log.String(), "recount gave slots back") {
		t.Errorf("no log line of the slots given back:\n%s", d.log)
	}

	d.kill(t)
	e.start(t)
	serviceRound(t, e, service, limit, http10, reset, holder)
}

// churnDuration is how long TestRecountNeverOverAdmits churns each rule:
// EGRESSD_CHURN_SECONDS, 15 s by default (the closing notes' longer runs
// set it).
func churnDuration(t *testing.T) time.Duration {
	t.Helper()
	s := os.Getenv("EGRESSD_CHURN_SECONDS")
	if s == "" {
		return 15 * time.Second
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 1 {
		t.Fatalf("EGRESSD_CHURN_SECONDS=%q: want a whole number of seconds", s)
	}
	return time.Duration(n) * time.Second
}

// TestRecountNeverOverAdmits: clients open and close connections through
// a concurrency rule as fast as they can, far more of them than its limit,
// while the daemon recounts every second; again and again slots are lost
// (sock_release detached, connects the peer refuses closed), given back by
// a recount under the churn, and the daemon killed and started again. The
// clients never hold more connections at once than the limit: a recount
// that gave back a slot a socket still held would let one more in. The
// same for a shared concurrency rule of two hosts, slots lost on one: the
// hosts together never hold more than the budget, and once the clients
// stop, the host that lost slots hands its Redis slots back (a slot never
// given back would keep one held for good).
func TestRecountNeverOverAdmits(t *testing.T) {
	d := churnDuration(t)
	t.Run("local", func(t *testing.T) {
		const limit = 4
		w := newWorldHolding(t, nil, limit, time.Millisecond)
		h := prepareHost(t, 40, w.dep)
		h.args = append(h.args, "--recount-every", "1s")
		h.writePolicy(t, fmt.Sprintf("rules:\n  - {name: pool, destination: %s, concurrency: %d}\n", h.dest, limit))
		h.d = h.start(t)
		w.hosts = append(w.hosts, h)
		churnLosingSlots(t, w, h, d)
	})
	t.Run("shared", func(t *testing.T) {
		const budget = 6
		w := newWorldHolding(t, redistest.Start(t), budget, time.Millisecond)
		lossy := w.addHost(`key: "egressd-test:churn", lease: 3s`, false)
		w.addHost(`key: "egressd-test:churn", lease: 3s`, false)
		w.thawed()
		// Recounts every second on the host that loses slots.
		lossy.d.kill(t)
		lossy.args = append(lossy.args, "--recount-every", "1s")
		lossy.d = lossy.start(t)
		w.busy(w.hosts[1], 12)
		churnLosingSlots(t, w, lossy, d)
		clocktest.Eventually(t, "the host that lost slots hands its Redis slots back", func() bool { return lossy.share(t, "pool").Shared.Slots == 0 })
	})
}

// churnLosingSlots runs clients on h for d, far more than the budget,
// and meanwhile loses 2 slots of h's rule "pool" at a time, waits for a
// recount to give them back, and kills and starts h's daemon again (which
// attaches sock_release again). Then it judges the budget by every
// client's intervals, and wants the limit to have been reached.
func churnLosingSlots(t *testing.T, w *world, h *sharingHost, d time.Duration) {
	t.Helper()
	const perLoss = 2
	closed := testport.Free(t)
	start := privtest.Monotonic()
	path := filepath.Join(t.TempDir(), "intervals")
	load := h.ns.Spawn(t, h.cg, "requester", fmt.Sprintf("%s:%d", h.dest, w.srv.port), "16", d.String(), path)
	a := startPythonIn(t, h.ns, h.cg, agentScript)
	a.line(t)
	losses, heals := 0, []time.Duration{}
	for end := time.Now().Add(d - time.Second); time.Now().Before(end); {
		detachSockRelease(t, h.pins)
		// Each admitted connect the peer refuses holds its slot, lost at
		// its close; under the churn the rule often refuses it first.
		lost := 0
		clocktest.Eventually(t, fmt.Sprintf("%d connects admitted to lose slots with", perLoss), func() bool {
			switch got := a.call(t, "dial %s %d", h.dest, closed); got {
			case "err 111":
				lost++
			case "err 1":
			default:
				t.Fatalf("dial a closed port: %s", got)
			}
			return lost == perLoss
		})
		lostAt := time.Now()
		clocktest.Eventually(t, fmt.Sprintf("the recounts to give back the %d lost slots", perLoss), func() bool {
			v, _ := h.scrape(t).value("egressd_recount_released_total", map[string]string{"rule": "pool", "cause": "freed_socket"})
			return v >= perLoss
		})
		heals = append(heals, time.Since(lostAt))
		losses++
		h.d.kill(t)
		h.d = h.start(t)
	}
	line := load.Line(t)
	var ok, refused, failed int
	if _, err := fmt.Sscanf(line, "done ok %d refused %d failed %d", &ok, &refused, &failed); err != nil {
		t.Fatalf("clients: %q", line)
	}
	load.Wait(t)
	ivs, err := privtest.ReadIntervals(path)
	if err != nil {
		t.Fatal(err)
	}
	w.stopAll()
	w.ivs = append(w.ivs, ivs...)
	most := w.check(fmt.Sprintf("churn with %d losses given back", losses), start, privtest.Monotonic())
	slices.Sort(heals)
	if len(heals) > 0 {
		t.Logf("%d connections, %d refused, %d failed; %d times %d slots lost and given back after %v (median %v, most %v)", ok, refused, failed, losses, perLoss, heals[0], heals[len(heals)/2], heals[len(heals)-1])
	}
	if refused == 0 || most < w.budget {
		t.Errorf("the clients held at most %d connections and were refused %d times: the budget of %d was never reached, and the test checked nothing", most, refused, w.budget)
	}
	if losses == 0 {
		t.Error("no slot was lost during the churn")
	}
}
