package tests

import (
	"encoding/json"
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/net/dns/dnsmessage"

	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/internal/privtest"
	"github.com/egressd/egressd/pkg/control"
)

// udpAgentScript is a UDP client in Python on plain sockets, driven one
// command a line: "sock" opens an unconnected socket and answers "ok ID";
// "connect ID HOST PORT", "unconnect ID" (connect(AF_UNSPEC)), "send ID"
// (on the connected socket), "sendto ID HOST PORT" and "close ID" answer
// "ok" or "err ERRNO"; "hold HOST PORT N" opens N sockets, each sending a
// datagram to HOST:PORT, keeps them and answers "ok ADMITTED"; "churn HOST
// PORT N" opens a socket, sends a datagram to HOST:PORT and closes it, N
// times, and answers "ok ADMITTED REFUSED".
const udpAgentScript = `
import ctypes, errno, os, socket, sys
libc = ctypes.CDLL(None, use_errno=True)
socks, held, nxt = {}, [], 0
print("ready %d" % os.getpid(), flush=True)
for line in sys.stdin:
    f = line.split()
    try:
        if f[0] == "sock":
            socks[nxt] = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            print("ok %d" % nxt)
            nxt += 1
        elif f[0] == "connect":
            socks[int(f[1])].connect((f[2], int(f[3])))
            print("ok")
        elif f[0] == "unconnect":
            unspec = (ctypes.c_ubyte * 16)()
            if libc.connect(socks[int(f[1])].fileno(), unspec, 16) != 0:
                raise OSError(ctypes.get_errno(), "connect(AF_UNSPEC)")
            print("ok")
        elif f[0] == "send":
            socks[int(f[1])].send(b"x")
            print("ok")
        elif f[0] == "sendto":
            socks[int(f[1])].sendto(b"x", (f[2], int(f[3])))
            print("ok")
        elif f[0] == "close":
            socks.pop(int(f[1])).close()
            print("ok")
        elif f[0] == "hold":
            ok = 0
            for _ in range(int(f[3])):
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                held.append(s)
                try:
                    s.sendto(b"x", (f[1], int(f[2])))
                    ok += 1
                except PermissionError:
                    pass
            print("ok %d" % ok)
        elif f[0] == "churn":
            ok = refused = 0
            for _ in range(int(f[3])):
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                try:
                    s.sendto(b"x", (f[1], int(f[2])))
                    ok += 1
                except PermissionError:
                    refused += 1
                s.close()
            print("ok %d %d" % (ok, refused))
        else:
            print("bad command")
    except OSError as e:
        print("err %d" % e.errno)
    sys.stdout.flush()
`

// udpAgent starts the UDP agent in cgroup cg.
func udpAgent(t *testing.T, cg string) *pyProc {
	t.Helper()
	p := startPythonIn(t, nil, cg, udpAgentScript)
	if got, want := p.line(t), fmt.Sprintf("ready %d", p.pid); got != want {
		t.Fatalf("udp agent: %q, want %q", got, want)
	}
	return p
}

// want sends the agent a command and fails the test unless it answers
// want.
func (p *pyProc) want(t *testing.T, want, format string, args ...any) {
	t.Helper()
	if got := p.call(t, format, args...); got != want {
		t.Fatalf("%s: %q, want %q", fmt.Sprintf(format, args...), got, want)
	}
}

var eperm = fmt.Sprintf("err %d", syscall.EPERM)

// udpSinks listens on n UDP ports of ns and drops what they receive; it
// returns the ports.
func udpSinks(t *testing.T, ns *privtest.NetNS, n int) []int {
	t.Helper()
	var ports []int
	for range n {
		var pc net.PacketConn
		if err := ns.Do(func() (err error) { pc, err = net.ListenPacket("udp4", "0.0.0.0:0"); return err }); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { pc.Close() })
		go func() {
			buf := make([]byte, 2048)
			for {
				if _, _, err := pc.ReadFrom(buf); err != nil {
					return
				}
			}
		}()
		ports = append(ports, pc.LocalAddr().(*net.UDPAddr).Port)
	}
	return ports
}

// TestUDPFromPython drives plain Python sockets against a rule of
// concurrency 2 on a namespace's address, any port, [udp]: connected
// sockets are admitted or refused at connect(), a connect() elsewhere
// moves the flow, close() and connect(AF_UNSPEC) end it; an unconnected
// socket's first datagram to each destination opens a flow, the third
// destination's is refused and sends on open flows pass; killed -9, the
// process gives every slot back. The rule's counts and events say so.
func TestUDPFromPython(t *testing.T) {
	e := newEnv(t)
	dep := privtest.NewNetNS(t)
	const ip = "10.216.4.2"
	privtest.VethToHost(t, "10.216.4.1/24", dep, ip+"/24")
	p := udpSinks(t, dep, 4)
	e.writePolicy(t, "rules:\n  - {name: udp, destination: "+ip+", protocols: [udp], concurrency: 2}\n")
	e.start(t)
	py := udpAgent(t, e.cg)
	live := func(want int64) {
		t.Helper()
		if l := e.limit(t, "udp"); l.Live != want {
			t.Fatalf("live %d, want %d", l.Live, want)
		}
	}

	// Connected.
	for i := range 3 {
		py.want(t, fmt.Sprintf("ok %d", i), "sock")
	}
	py.want(t, "ok", "connect 0 %s %d", ip, p[0])
	py.want(t, "ok", "connect 1 %s %d", ip, p[1])
	py.want(t, eperm, "connect 2 %s %d", ip, p[2])
	py.want(t, "ok", "send 0")
	live(2)
	py.want(t, "ok", "connect 0 %s %d", ip, p[2]) // moves its flow
	live(2)
	py.want(t, eperm, "connect 2 %s %d", ip, p[3])
	py.want(t, "ok", "close 1")
	live(1)
	py.want(t, "ok", "connect 2 %s %d", ip, p[3])
	live(2)
	// connect(AF_UNSPEC) runs no hook: the flow ends at the socket's next
	// send to an address, which opens one there.
	py.want(t, "ok", "unconnect 0")
	py.want(t, "ok", "sendto 0 %s %d", ip, p[0])
	live(2)
	py.want(t, "ok", "close 0")
	py.want(t, "ok", "close 2")
	live(0)

	// Unconnected: one socket, several destinations.
	py.want(t, "ok 3", "sock")
	py.want(t, "ok", "sendto 3 %s %d", ip, p[0])
	py.want(t, "ok", "sendto 3 %s %d", ip, p[1])
	py.want(t, eperm, "sendto 3 %s %d", ip, p[2])
	for range 3 {
		py.want(t, "ok", "sendto 3 %s %d", ip, p[0])
		py.want(t, "ok", "sendto 3 %s %d", ip, p[1])
	}
	live(2)
	l := e.limit(t, "udp")
	if l.Admitted != 7 || l.Refused != 3 {
		t.Errorf("admitted %d refused %d, want 7 and 3", l.Admitted, l.Refused)
	}
	// The refusals reach the event stream from the ring buffer shortly.
	clocktest.Eventually(t, "the 3 UDP refusals in egressd events --json", func() bool {
		refusals := 0
		for _, line := range lines(e.ok(t, "--json", "events")) {
			var ev control.Event
			if err := json.Unmarshal([]byte(line), &ev); err != nil {
				t.Fatalf("event %q: %v", line, err)
			}
			if ev.Rule == "udp" && ev.Kind == "refusal" {
				if ev.Protocol != "udp" || int(ev.PID) != py.pid {
					t.Fatalf("event %+v, want a UDP refusal of pid %d", ev, py.pid)
				}
				refusals += int(ev.Count)
			}
		}
		return refusals == 3
	})
	if out := e.ok(t, "events"); !strings.Contains(out, fmt.Sprintf("refused pid %d -> %s:%d/udp by rule udp", py.pid, ip, p[2])) {
		t.Errorf("events:\n%s", out)
	}

	// Killed -9 holding its flows: it gives them back.
	py.cmd.Process.Kill()
	<-py.done
	live(0)
}

// TestUDPKilledAndChurned: a process killed -9 holding a rule's worth of
// flows gives every slot back; 100,000 flows opened and closed, beside a
// process that holds flows and is killed, leave no slot and no socket's
// entry behind. With sock_release detached (a close the kernel runs no
// hook for), the recount gives the slots of the sockets freed back.
func TestUDPKilledAndChurned(t *testing.T) {
	const limit = 50
	e := newEnv(t)
	dep := privtest.NewNetNS(t)
	const ip = "10.216.5.2"
	privtest.VethToHost(t, "10.216.5.1/24", dep, ip+"/24")
	port := udpSinks(t, dep, 1)[0]
	e.args = []string{"--recount-every", "1s"}
	e.writePolicy(t, fmt.Sprintf("rules:\n  - {name: udp, destination: %s, port: %d, protocols: [udp], concurrency: %d}\n", ip, port, limit))
	e.start(t)

	holder := udpAgent(t, e.cg)
	holder.want(t, fmt.Sprintf("ok %d", limit), "hold %s %d %d", ip, port, limit+5)
	if l := e.limit(t, "udp"); l.Live != limit || l.Refused != 5 {
		t.Fatalf("live %d refused %d with a holder, want %d and 5", l.Live, l.Refused, limit)
	}
	holder.cmd.Process.Kill()
	<-holder.done
	if l := e.limit(t, "udp"); l.Live != 0 {
		t.Fatalf("live %d after the holder was killed, want 0", l.Live)
	}

	// Churn, while another holder takes half the limit and is killed.
	const flows = 100_000
	churn := udpAgent(t, e.cg)
	if _, err := fmt.Fprintf(churn.stdin, "churn %s %d %d\n", ip, port, flows); err != nil {
		t.Fatal(err)
	}
	holder = udpAgent(t, e.cg)
	holder.want(t, fmt.Sprintf("ok %d", limit/2), "hold %s %d %d", ip, port, limit/2)
	holder.cmd.Process.Kill()
	<-holder.done
	var admitted, refused int
	select {
	case l := <-churn.out:
		if _, err := fmt.Sscanf(l, "ok %d %d", &admitted, &refused); err != nil {
			t.Fatalf("churn: %q", l)
		}
	case <-time.After(5 * time.Minute):
		t.Fatal("the churn did not end in 5 minutes")
	}
	l := e.limit(t, "udp")
	t.Logf("churn: %d flows admitted, %d refused; the rule: live %d admitted %d refused %d", admitted, refused, l.Live, l.Admitted, l.Refused)
	// The churn holds one flow at a time, the holder half the limit.
	if admitted != flows || refused != 0 {
		t.Errorf("churn: %d admitted and %d refused of %d, want all admitted", admitted, refused, flows)
	}
	if want := uint64(limit + limit/2 + admitted); l.Admitted != want {
		t.Errorf("admitted %d, want %d", l.Admitted, want)
	}
	// On a loaded machine the kernel now and then frees a UDP socket
	// without running its sock_release program (see docs/design.md):
	// the recount gives such a slot back within its period, so live and
	// the table come to zero by then.
	clocktest.Eventually(t, "no slot and no UDP socket's entry once every socket closed", func() bool {
		return e.limit(t, "udp").Live == 0 && udpSockEntries(t, e.pins) == 0
	})

	// Closes without sock_release: the recount finds the sockets freed.
	freed := map[string]string{"rule": "udp", "cause": "freed_socket"}
	before, _ := e.scrape(t).value("egressd_recount_released_total", freed)
	holder = udpAgent(t, e.cg)
	holder.want(t, fmt.Sprintf("ok %d", limit), "hold %s %d %d", ip, port, limit)
	detachSockRelease(t, e.pins)
	holder.cmd.Process.Kill()
	<-holder.done
	clocktest.Eventually(t, "the recount giving back the killed holder's slots", func() bool { return e.limit(t, "udp").Live == 0 })
	if v, _ := e.scrape(t).value("egressd_recount_released_total", freed); v-before != limit {
		t.Errorf("egressd_recount_released_total{cause=freed_socket} grew by %v, want %d", v-before, limit)
	}
	if n := udpSockEntries(t, e.pins); n != 0 {
		t.Errorf("%d UDP sockets' entries left after the recount", n)
	}
}

// udpSockEntries counts the entries of the UDP sockets' table of the
// datapath pinned at pins.
func udpSockEntries(t *testing.T, pins string) int {
	t.Helper()
	m, err := ebpf.LoadPinnedMap(filepath.Join(pins, "maps", "udp_socks"), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	var (
		key   uint64
		value []byte
		n     int
	)
	it := m.Iterate()
	for it.Next(&key, &value) {
		n++
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	return n
}

// resolverScript holds a rule's only UDP flow to the resolver's address,
// checks that a second one there is refused, then runs getent hosts NAME
// with the resolv.conf at RESOLVCONF bind-mounted over /etc/resolv.conf in
// a mount namespace of its own (the host's stays as it is). It prints
// "held", "refused" and getent's output, or what went wrong, and holds
// its flow until its stdin closes.
const resolverScript = `
import ctypes, socket, subprocess, sys
rc, name = sys.argv[1], sys.argv[2]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.sendto(b"x", ("127.0.0.1", 9999))
print("held", flush=True)
try:
    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("127.0.0.1", 9998))
    print("admitted", flush=True)
except PermissionError:
    print("refused", flush=True)
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, MS_BIND, MS_REC, MS_PRIVATE = 0x20000, 4096, 16384, 1 << 18
if libc.unshare(CLONE_NEWNS) != 0 or libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0 \
        or libc.mount(rc.encode(), b"/etc/resolv.conf", None, MS_BIND, None) != 0:
    print("mount namespace: errno %d" % ctypes.get_errno(), flush=True)
    sys.exit(1)
r = subprocess.run(["getent", "hosts", name], capture_output=True, text=True)
print("getent %d %s" % (r.returncode, (r.stdout + r.stderr).strip()), flush=True)
sys.stdin.read()  # holds the flow until the test is done
`

// dnsServer answers A queries for name with addr, and every other query
// with no answer, on 127.0.0.1:53 of ns; it returns how many queries for
// name it answered so far.
func dnsServer(t *testing.T, ns *privtest.NetNS, name string, addr [4]byte) func() int {
	t.Helper()
	var pc net.PacketConn
	if err := ns.Do(func() (err error) { pc, err = net.ListenPacket("udp4", "127.0.0.1:53"); return err }); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pc.Close() })
	asked := make(chan int, 1)
	asked <- 0
	go func() {
		buf := make([]byte, 1500)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			var p dnsmessage.Parser
			h, err := p.Start(buf[:n])
			if err != nil {
				continue
			}
			q, err := p.Question()
			if err != nil {
				continue
			}
			b := dnsmessage.NewBuilder(nil, dnsmessage.Header{ID: h.ID, Response: true, Authoritative: true, RecursionDesired: h.RecursionDesired})
			b.StartQuestions()
			b.Question(q)
			b.StartAnswers()
			if q.Name.String() == name {
				asked <- <-asked + 1
				if q.Type == dnsmessage.TypeA {
					b.AResource(dnsmessage.ResourceHeader{Name: q.Name, Class: dnsmessage.ClassINET, TTL: 60}, dnsmessage.AResource{A: addr})
				}
			}
			msg, err := b.Finish()
			if err == nil {
				pc.WriteTo(msg, from)
			}
		}
	}()
	return func() int { n := <-asked; asked <- n; return n }
}

// TestDNSResolvesUnderUDPRule: a process in a cgroup whose rule is [udp]
// on any port of its resolver's address (127.0.0.1, in a network
// namespace of the test's), with the rule's one flow taken and a second
// refused, still resolves a name with getent hosts (glibc's resolver, on
// UDP to port 53): DNS is never counted by an any-port rule.
func TestDNSResolvesUnderUDPRule(t *testing.T) {
	if _, err := exec.LookPath("getent"); err != nil {
		t.Skip("skipping: needs getent (libc-bin)")
	}
	e := newEnv(t)
	ns := privtest.NewNetNS(t)
	const name = "svc.egressd.test."
	asked := dnsServer(t, ns, name, [4]byte{10, 216, 6, 9})
	rc := filepath.Join(t.TempDir(), "resolv.conf")
	writeFile(t, rc, "nameserver 127.0.0.1\noptions timeout:2 attempts:2\n")
	e.writePolicy(t, "rules:\n  - {name: resolver, destination: 127.0.0.1, protocols: [udp], concurrency: 1}\n")
	e.start(t)
	py := startPythonIn(t, ns, e.cg, resolverScript, rc, strings.TrimSuffix(name, "."))
	for _, want := range []string{"held", "refused"} {
		if got := py.line(t); got != want {
			t.Fatalf("before resolving: %q, want %q", got, want)
		}
	}
	got := py.line(t)
	if !regexp.MustCompile(`^getent 0 10\.216\.6\.9\s+svc\.egressd\.test$`).MatchString(got) {
		t.Errorf("getent hosts under the rule: %q, want 10.216.6.9 svc.egressd.test", got)
	}
	if asked() == 0 {
		t.Error("the resolver was never asked")
	}
	if l := e.limit(t, "resolver"); l.Live != 1 || l.Admitted != 1 || l.Refused != 1 {
		t.Errorf("rule: live %d admitted %d refused %d, want 1, 1, 1: the queries counted", l.Live, l.Admitted, l.Refused)
	}
}

// TestUDPBadPolicy: protocols naming sctp, an empty list and udp on an
// adaptive rule are each named by policy check, at their line; a reload
// of such a file loads nothing, and the rules in force stay.
func TestUDPBadPolicy(t *testing.T) {
	e := newEnv(t)
	good := "rules:\n  - {name: good, destination: 10.0.0.1, protocols: [tcp, udp], concurrency: 5}\n"
	e.writePolicy(t, good)
	e.start(t)
	bad := filepath.Join(t.TempDir(), "bad.yaml")
	text := good + `  - {name: a, destination: 10.0.0.2, protocols: [sctp], concurrency: 1}
  - {name: b, destination: 10.0.0.3, protocols: [], concurrency: 1}
  - {name: c, destination: 10.0.0.4, protocols: [udp], adaptive: {initial: 4}}
`
	writeFile(t, bad, text)
	r := e.cli(t, "policy", "check", bad)
	if r.code != 1 {
		t.Fatalf("policy check: exit %d, want 1\n%s", r.code, r.stderr)
	}
	for _, want := range []string{
		bad + `:3:`, `rule a: protocols: "sctp" is not tcp or udp`,
		bad + `:4:`, `rule b: protocols is empty`,
		bad + `:5:`, `rule c: an adaptive rule cannot count UDP`,
		"3 problem(s)",
	} {
		if !strings.Contains(r.stderr, want) {
			t.Errorf("policy check: stderr lacks %q:\n%s", want, r.stderr)
		}
	}
	writeFile(t, e.policy, text)
	if r := e.cli(t, "policy", "reload"); r.code == 0 {
		t.Fatalf("policy reload of a bad file succeeded:\n%s", r.stdout)
	}
	var limits []control.Limit
	e.json(t, &limits, "limit", "ls")
	var names []string
	for _, l := range limits {
		names = append(names, l.Name)
	}
	if !slices.Equal(names, []string{"good"}) {
		t.Errorf("rules after a refused reload: %v, want [good]", names)
	}
}
