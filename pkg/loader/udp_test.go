//go:build linux

package loader

import (
	"fmt"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/internal/privtest"
)

// udpSocket opens a UDP socket, closed when the test ends.
func udpSocket(t testing.TB) int {
	t.Helper()
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return fd
}

// udpServer is a loopback UDP port that reads and drops what it gets.
func udpServer(t testing.TB) netip.AddrPort {
	t.Helper()
	c := udpListen(t)
	go func() {
		buf := make([]byte, 1500)
		for {
			if _, _, err := c.ReadFrom(buf); err != nil {
				return
			}
		}
	}()
	return netip.MustParseAddrPort(c.LocalAddr().String())
}

// udpSink is a loopback UDP port that never reads: once its buffer is full
// the kernel drops what comes, with no reader to wake, so that a send
// costs the same whenever it is sent.
func udpSink(t testing.TB) netip.AddrPort {
	t.Helper()
	return netip.MustParseAddrPort(udpListen(t).LocalAddr().String())
}

// udpListen opens a UDP socket on a loopback port, closed when the test
// ends.
func udpListen(t testing.TB) *net.UDPConn {
	t.Helper()
	c, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func sendto(fd int, ap netip.AddrPort) error {
	return unix.Sendto(fd, []byte{1}, 0, sa4udp(ap))
}

func sa4udp(ap netip.AddrPort) *unix.SockaddrInet4 {
	return &unix.SockaddrInet4{Port: int(ap.Port()), Addr: ap.Addr().As4()}
}

// TestUDPConnectedFlows: a connected UDP socket holds a flow from its
// connect() (refused past the limit, with EPERM) to its release; a
// connect() to another destination moves it; after connect(AF_UNSPEC) the
// socket's next send to an address ends it.
func TestUDPConnectedFlows(t *testing.T) {
	d, cg := open(t)
	a, b := udpServer(t), udpServer(t)
	put(t, d, Rule{Name: "udp", Dests: []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}, Limit: 2, Protocols: ProtoUDP})
	privtest.Join(t, cg)
	x, y, z := udpSocket(t), udpSocket(t), udpSocket(t)
	for _, fd := range []int{x, y} {
		if err := unix.Connect(fd, sa4udp(a)); err != nil {
			t.Fatalf("connect: %v", err)
		}
	}
	if err := unix.Connect(z, sa4udp(a)); err != unix.EPERM {
		t.Fatalf("third connect: %v, want EPERM", err)
	}
	// Connected again elsewhere: still one flow.
	if err := unix.Connect(y, sa4udp(b)); err != nil {
		t.Fatalf("connect elsewhere: %v", err)
	}
	if s := stats(t, d, "udp"); s.Live != 2 || s.Admitted != 3 || s.Released != 1 {
		t.Fatalf("after a reconnect: live %d, admitted %d, released %d; want 2, 3, 1", s.Live, s.Admitted, s.Released)
	}
	// Disconnected: the next send to an address ends the flow of
	// connect() and opens one of its own.
	if err := disconnect(y); err != nil {
		t.Fatalf("disconnect: %v", err)
	}
	if err := sendto(y, b); err != nil {
		t.Fatalf("send after disconnect: %v", err)
	}
	if s := stats(t, d, "udp"); s.Live != 2 || s.Released != 2 {
		t.Fatalf("after a disconnect and a send: live %d, released %d; want 2, 2", s.Live, s.Released)
	}
	unix.Close(x)
	if err := unix.Connect(z, sa4udp(a)); err != nil {
		t.Fatalf("connect after a close: %v", err)
	}
	unix.Close(y)
	unix.Close(z)
	waitLive(t, d, "udp", 0)
	checkRecount(t, d, "udp", 0)
}

// TestUDPUnconnectedFlows: one socket sending to several destinations
// holds a flow to each from its first datagram; a send that would open
// one past the limit fails with EPERM, and is noted as a UDP refusal;
// datagrams on an open flow pass; the socket's close ends them all.
func TestUDPUnconnectedFlows(t *testing.T) {
	d, cg := open(t)
	var dests []netip.AddrPort
	for range 4 {
		dests = append(dests, udpServer(t))
	}
	put(t, d, Rule{Name: "udp", Dests: []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}, Limit: 3, Protocols: ProtoUDP})
	privtest.Join(t, cg)
	fd := udpSocket(t)
	for i, dest := range dests[:3] {
		for range 3 {
			if err := sendto(fd, dest); err != nil {
				t.Fatalf("send %d: %v", i, err)
			}
		}
	}
	if err := sendto(fd, dests[3]); err != unix.EPERM {
		t.Fatalf("a send opening a 4th flow: %v, want EPERM", err)
	}
	r, ok, err := d.LastRefusal(uint32(unix.Getpid()), ProtoUDP, dests[3])
	if err != nil || !ok || r.Rule != "udp" || r.Protocol != ProtoUDP || r.Shadow {
		t.Errorf("last refusal: %+v, %v, %v; want rule udp's, of UDP", r, ok, err)
	}
	// A TCP connect() to the same address was not refused: a firewall's
	// EPERM there is not the rule's.
	if r, ok, err := d.LastRefusal(uint32(unix.Getpid()), ProtoTCP, dests[3]); ok || err != nil {
		t.Errorf("last TCP refusal: %+v, %v, %v; want none", r, ok, err)
	}
	if s := stats(t, d, "udp"); s.Live != 3 || s.Admitted != 3 || s.Refused != 1 {
		t.Fatalf("live %d, admitted %d, refused %d; want 3, 3, 1", s.Live, s.Admitted, s.Refused)
	}
	checkRecount(t, d, "udp", 3)
	unix.Close(fd)
	waitLive(t, d, "udp", 0)
	if table, hash := udpEntries(t, d); table != 0 || hash != 0 {
		t.Errorf("UDP socket states after the close: %d in the table, %d in the hash", table, hash)
	}
}

// udpEntries counts the UDP sockets' states: the UDP table's entries a
// socket holds, and the entries of the hash of the others.
func udpEntries(t *testing.T, d *Datapath) (table, hash int) {
	t.Helper()
	var idx uint32
	var e egressdUdpEntry
	it := d.maps().UdpTable.Iterate()
	for it.Next(&idx, &e) {
		if e.Cookie != 0 {
			table++
		}
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	var cookie uint64
	var us egressdUdpSock
	it = d.maps().UdpSocks.Iterate()
	for it.Next(&cookie, &us) {
		hash++
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	return table, hash
}

// TestUDPFlowsPerSocket: a socket sending to more destinations than it
// keeps flows for gives back the slot of the one idle longest for each
// new one: its next datagram opens a flow again.
func TestUDPFlowsPerSocket(t *testing.T) {
	d, cg := open(t)
	const n = 10
	put(t, d, Rule{Name: "udp", Dests: []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}, Limit: 1000, Protocols: ProtoUDP})
	privtest.Join(t, cg)
	fd := udpSocket(t)
	flows := len(egressdUdpSock{}.Flows)
	for i := range n {
		if err := sendto(fd, netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), uint16(20000+i))); err != nil {
			t.Fatal(err)
		}
	}
	if s := stats(t, d, "udp"); s.Live != int64(flows) || s.Admitted != n || s.Released != uint64(n-flows) {
		t.Fatalf("live %d, admitted %d, released %d; want %d, %d, %d", s.Live, s.Admitted, s.Released, flows, n, n-flows)
	}
	// The first destination's flow went first; a datagram opens it again.
	if err := sendto(fd, netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), 20000)); err != nil {
		t.Fatal(err)
	}
	if s := stats(t, d, "udp"); s.Live != int64(flows) || s.Admitted != n+1 {
		t.Fatalf("after the first destination again: live %d, admitted %d; want %d, %d", s.Live, s.Admitted, flows, n+1)
	}
}

// TestUDPFlowIdle: a flow sent to an address that sees no datagram for
// its rule's idle time is ended by the next recount; its next datagram
// opens it again. A flow of connect() does not idle out.
func TestUDPFlowIdle(t *testing.T) {
	d, cg := open(t)
	srv := udpServer(t)
	put(t, d, Rule{Name: "udp", Dests: []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}, Limit: 10, Protocols: ProtoUDP, FlowIdle: time.Second})
	privtest.Join(t, cg)
	sent, connected := udpSocket(t), udpSocket(t)
	if err := sendto(sent, srv); err != nil {
		t.Fatal(err)
	}
	if err := unix.Connect(connected, sa4udp(srv)); err != nil {
		t.Fatal(err)
	}
	var expired int64
	clocktest.Eventually(t, "a recount to end an idle flow", func() bool {
		rc, err := d.Recount()
		if err != nil {
			t.Fatal(err)
		}
		expired += rc["udp"].Expired
		return expired > 0
	})
	if s := stats(t, d, "udp"); expired != 1 || s.Live != 1 {
		t.Fatalf("%d flows idled out, live %d; want the one sent to an address, and connect()'s left", expired, s.Live)
	}
	if err := sendto(sent, srv); err != nil {
		t.Fatal(err)
	}
	if s := stats(t, d, "udp"); s.Live != 2 || s.Admitted != 3 {
		t.Fatalf("after a datagram on the idled flow: live %d, admitted %d; want 2, 3", s.Live, s.Admitted)
	}
}

// TestUDPAndTCPOneBudget: a rule of both protocols counts TCP connections
// and UDP flows from one budget, whichever comes first.
func TestUDPAndTCPOneBudget(t *testing.T) {
	d, cg := open(t)
	tcpSrv, udpSrv := listen(t, "tcp4", "127.0.0.1:0"), udpServer(t)
	put(t, d, Rule{Name: "both", Dests: []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}, Limit: 2, Protocols: ProtoTCP | ProtoUDP})
	privtest.Join(t, cg)
	c := dial(t, tcpSrv)
	fd := udpSocket(t)
	if err := sendto(fd, udpSrv); err != nil {
		t.Fatalf("a UDP flow beside one connection: %v", err)
	}
	dialRefused(t, tcpSrv, unix.EPERM)
	if err := unix.Connect(udpSocket(t), sa4udp(udpSrv)); err != unix.EPERM {
		t.Fatalf("a connected UDP flow past the limit: %v, want EPERM", err)
	}
	c.Close()
	waitLive(t, d, "both", 1)
	if err := unix.Connect(udpSocket(t), sa4udp(udpSrv)); err != nil {
		t.Fatalf("a UDP flow once the connection closed: %v", err)
	}
}

// TestDNSLeftAlone: a rule on any port of an address limits no send to
// its DNS ports (53, 853); one that names the port does.
func TestDNSLeftAlone(t *testing.T) {
	d, cg := open(t)
	local := []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}
	put(t, d, Rule{Name: "any", Dests: local, Limit: 0, Protocols: ProtoUDP | ProtoTCP})
	privtest.Join(t, cg)
	fd := udpSocket(t)
	for _, port := range []uint16{53, 853} {
		if err := sendto(fd, netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), port)); err != nil {
			t.Errorf("send to port %d under a rule on any port: %v", port, err)
		}
	}
	if err := sendto(fd, netip.MustParseAddrPort("127.0.0.1:5353")); err != unix.EPERM {
		t.Errorf("send to port 5353: %v, want EPERM", err)
	}
	put(t, d, Rule{Name: "dns", Dests: local, Port: 53, Limit: 0, Protocols: ProtoUDP})
	if err := sendto(udpSocket(t), netip.MustParseAddrPort("127.0.0.1:53")); err != unix.EPERM {
		t.Errorf("send to port 53 under a rule that names it: %v, want EPERM", err)
	}
}

// TestUDPTCPRulesApart: a TCP rule and a UDP rule for the same
// destination are two budgets.
func TestUDPTCPRulesApart(t *testing.T) {
	d, cg := open(t)
	tcpSrv, udpSrv := listen(t, "tcp4", "127.0.0.1:0"), udpServer(t)
	local := []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}
	put(t, d, Rule{Name: "tcp", Dests: local, Limit: 1})
	put(t, d, Rule{Name: "udp", Dests: local, Limit: 1, Protocols: ProtoUDP})
	privtest.Join(t, cg)
	dial(t, tcpSrv)
	if err := sendto(udpSocket(t), udpSrv); err != nil {
		t.Fatalf("a UDP flow beside a TCP rule's connection: %v", err)
	}
	dialRefused(t, tcpSrv, unix.EPERM)
	if err := sendto(udpSocket(t), udpSrv); err != unix.EPERM {
		t.Fatalf("a second UDP flow: %v, want EPERM", err)
	}
	if r, err := d.Rule("udp"); err != nil || r.Protocols != ProtoUDP {
		t.Errorf("rule udp: %+v, %v", r, err)
	}
}

// TestUDPFlowsOfFreedSockets: a UDP socket freed without its sock_release
// keeps its flows' slots until a recount finds it freed and gives them
// back; its entry goes.
func TestUDPFlowsOfFreedSockets(t *testing.T) {
	d, cg := open(t)
	a, b := udpServer(t), udpServer(t)
	put(t, d, Rule{Name: "udp", Dests: []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}, Limit: 10, Protocols: ProtoUDP})
	privtest.Join(t, cg)
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, dest := range []netip.AddrPort{a, b} {
		if err := sendto(fd, dest); err != nil {
			t.Fatal(err)
		}
	}
	withoutSockRelease(t, d, func() { unix.Close(fd) })
	freed := recountUntil(t, d, "udp", 2)
	if s := stats(t, d, "udp"); s.Live != 0 || freed != 2 {
		t.Errorf("live %d, freed %d; want 0, 2", s.Live, freed)
	}
	if table, hash := udpEntries(t, d); table != 0 || hash != 0 {
		t.Errorf("UDP socket states left: %d in the table, %d in the hash", table, hash)
	}
}

// TestUDPKilledHolder: a process killed -9 holding UDP flows, connected
// and sent to addresses, gives every slot back.
func TestUDPKilledHolder(t *testing.T) {
	d, cg := open(t)
	srv := udpServer(t)
	put(t, d, Rule{Name: "udp", Dests: []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}, Limit: 100, Protocols: ProtoUDP})
	c := privtest.Spawn(t, cg, "udpflows", srv.String(), "5")
	if line := c.Line(t); line != "ok" {
		t.Fatalf("helper: %s", line)
	}
	if s := stats(t, d, "udp"); s.Live != 10 {
		t.Fatalf("live %d with the helper's flows open, want 10", s.Live)
	}
	c.Kill(t)
	waitLive(t, d, "udp", 0)
}

// runUDPFlows opens args[1] connected UDP sockets to args[0] and as many
// that send it a datagram, says "ok" and waits to be killed.
func runUDPFlows(args []string) error {
	dest, err := netip.ParseAddrPort(args[0])
	if err != nil {
		return err
	}
	var n int
	if _, err := fmt.Sscan(args[1], &n); err != nil {
		return err
	}
	for range n {
		for _, connected := range []bool{true, false} {
			fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM, 0)
			if err != nil {
				return err
			}
			if connected {
				err = unix.Connect(fd, sa4udp(dest))
			} else {
				err = sendto(fd, dest)
			}
			if err != nil {
				return err
			}
		}
	}
	fmt.Println("ok")
	select {}
}

// TestUDPRuleAdopted: a datapath adopted from pins reads back a rule's
// protocols, its flows' idle time and its destinations once each, and
// keeps counting its flows.
func TestUDPRuleAdopted(t *testing.T) {
	privtest.RequireRoot(t)
	cg := privtest.Cgroup(t, "udpadopt")
	pins := privtest.PinDir(t)
	srv := udpServer(t)
	want := Rule{Name: "both", Dests: []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32"), netip.MustParsePrefix("10.9.0.0/16")}, Port: srv.Port(), Limit: 5, Protocols: ProtoTCP | ProtoUDP, FlowIdle: 7 * time.Second}
	d, err := Open(&Config{Cgroup: cg, PinDir: pins, MaxRules: 64})
	if err != nil {
		t.Fatal(err)
	}
	put(t, d, want)
	privtest.Join(t, cg)
	fd := udpSocket(t)
	if err := sendto(fd, srv); err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	d, err = Open(&Config{Cgroup: cg, PinDir: pins})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := d.Uninstall(); err != nil {
			t.Errorf("uninstall: %v", err)
		}
	})
	got, err := d.Rule("both")
	if err != nil || !sameRule(&got, new(want.WithDefaults())) {
		t.Fatalf("adopted %+v (%v), want %+v", got, err, want.WithDefaults())
	}
	unix.Close(fd)
	waitLive(t, d, "both", 0)
}

// TestUDPDestinationsHinted: a send returns at once unless some UDP rule's
// destinations may hold its address; every rule's, whole addresses and
// prefixes, IPv4, IPv6 and IPv4 sent from an IPv6 socket, still limit
// theirs. The kernel's hint follows the rules as they go.
func TestUDPDestinationsHinted(t *testing.T) {
	d, cg := open(t)
	udp := func(r Rule) Rule { r.Protocols = ProtoUDP; return r }
	for _, r := range []Rule{
		{Name: "v4", Dests: prefixes("127.0.0.2/32")},
		{Name: "v4wide", Dests: prefixes("10.0.0.0/8")},
		{Name: "v4sub", Dests: prefixes("172.16.16.0/20")},
		{Name: "v4net", Dests: prefixes("192.168.7.0/24")},
		{Name: "v4part", Dests: prefixes("192.168.8.128/25")},
		{Name: "v6", Dests: prefixes("::1/128")},
		{Name: "v6sub", Dests: prefixes("2001:db8:2:3::/64")},
		{Name: "v6net", Dests: prefixes("2001:db8:1::/48")},
		{Name: "v6part", Dests: prefixes("2001:db9:ff00::/40")},
		{Name: "v6wide", Dests: prefixes("fd00::/20")},
	} {
		put(t, d, udp(r))
	}
	privtest.Join(t, cg)
	refused := func(dests ...string) {
		t.Helper()
		for _, dest := range dests {
			if err := sendtoAny(t, netip.MustParseAddrPort(dest)); err != unix.EPERM {
				t.Errorf("send to %s: %v, want EPERM", dest, err)
			}
		}
	}
	refused("127.0.0.2:7", "10.200.3.4:7", "172.16.31.9:7", "192.168.7.200:7", "192.168.8.200:7", "[::ffff:192.168.7.1]:7", "[::ffff:127.0.0.2]:7",
		"[::1]:7", "[2001:db8:2:3::9]:7", "[2001:db8:1:ff::5]:7", "[2001:db9:ffaa::1]:7", "[fd00:fff:1::1]:7")
	// A prefix holding every address, IPv4's too.
	put(t, d, udp(Rule{Name: "all", Dests: prefixes("::/0"), Port: 9}))
	refused("192.0.2.1:9", "[2001:db9::1]:9")
	checkHints := func() {
		t.Helper()
		held, err := d.readHints()
		if err != nil {
			t.Fatal(err)
		}
		if held.udpDests != d.t.uses.hints().udpDests {
			t.Error("the kernel's UDP destinations are not what the rules say")
		}
	}
	checkHints()
	for _, name := range []string{"all", "v4wide"} {
		if err := d.Delete(name); err != nil {
			t.Fatal(err)
		}
	}
	checkHints()
	if h := d.t.uses.hints(); h.udpDests[0x0a00/64] != 0 {
		t.Errorf("the buckets of 10.0.0.0/8 after its rule went: %#x", h.udpDests[0x0a00/64])
	}
}

// sendtoAny sends a datagram to ap from a socket of its family (an IPv6
// one for an IPv4-mapped address), closed after.
func sendtoAny(t *testing.T, ap netip.AddrPort) error {
	t.Helper()
	family := unix.AF_INET6
	var sa unix.Sockaddr = &unix.SockaddrInet6{Port: int(ap.Port()), Addr: ap.Addr().As16()}
	if ap.Addr().Is4() {
		family, sa = unix.AF_INET, sa4udp(ap)
	}
	fd, err := unix.Socket(family, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	return unix.Sendto(fd, []byte{1}, 0, sa)
}

// TestUDPSocketsBeyondTheTable: sockets with flows hold the UDP table's
// entries their cookies pick, and those whose entry another holds keep
// their flows in the hash: every flow counts and the recount finds each.
// Their closes give every slot back and free every state; so does the
// recount for sockets freed without their sock_release.
func TestUDPSocketsBeyondTheTable(t *testing.T) {
	d, cg := open(t)
	srv := udpSink(t)
	put(t, d, Rule{Name: "udp", Dests: prefixes("127.0.0.1/32"), Limit: 1 << 20, Protocols: ProtoUDP})
	privtest.Join(t, cg)
	entries := int(d.maps().UdpTable.MaxEntries())
	n := 3 * entries / 2
	var fds []int
	closeAll := func() {
		for _, fd := range fds {
			unix.Close(fd)
		}
		fds = nil
	}
	t.Cleanup(closeAll)
	openAll := func() {
		t.Helper()
		for range n {
			fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
			if err != nil {
				t.Fatal(err)
			}
			fds = append(fds, fd)
			if err := sendto(fd, srv); err != nil {
				t.Fatal(err)
			}
		}
		// Past the table's length, some share an entry.
		if table, hash := udpEntries(t, d); table+hash != n || hash < n-entries {
			t.Fatalf("%d sockets' states: %d in the table, %d in the hash", n, table, hash)
		}
		checkRecount(t, d, "udp", int64(n))
	}
	noStates := func() {
		t.Helper()
		if table, hash := udpEntries(t, d); table != 0 || hash != 0 {
			t.Errorf("UDP socket states left: %d in the table, %d in the hash", table, hash)
		}
	}
	openAll()
	closeAll()
	waitLive(t, d, "udp", 0)
	noStates()
	openAll()
	withoutSockRelease(t, d, closeAll)
	if freed := recountUntil(t, d, "udp", int64(n)); freed != int64(n) {
		t.Errorf("%d freed, want %d", freed, n)
	}
	waitLive(t, d, "udp", 0)
	noStates()
}

// TestUDPSweepFreesNoLiveSocket: while threads open a UDP socket, send a
// datagram and close it as fast as they can, beside sockets that hold
// their flows a moment (so that states collide in the table and go to
// the hash), the recount sweeps again and again: it must give back the
// flow of no socket but one freed without its sock_release, which the
// sock_release program's run count tells (see TestSweepFreesNoLiveSocket).
func TestUDPSweepFreesNoLiveSocket(t *testing.T) {
	d, cg := open(t)
	srv := udpSink(t)
	put(t, d, Rule{Name: "udp", Dests: []netip.Prefix{netip.PrefixFrom(srv.Addr(), 32)}, Limit: 1 << 20, Protocols: ProtoUDP})
	sweepDuringChurn(t, d, cg, "udp", 5*time.Second, func(stop <-chan struct{}, sockets *atomic.Uint64) {
		// Each worker opens hold sockets with a flow each, then closes them.
		churn := func(hold int) {
			for !stopped(stop) {
				fds := make([]int, 0, hold)
				for range hold {
					fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
					if err != nil {
						t.Error(err)
						return
					}
					sockets.Add(1)
					if err := sendto(fd, srv); err != nil {
						t.Error(err)
					}
					fds = append(fds, fd)
				}
				for _, fd := range fds {
					unix.Close(fd)
				}
			}
		}
		var wg sync.WaitGroup
		wg.Go(func() { churn(1) })
		wg.Go(func() { churn(1) })
		wg.Go(func() { churn(400) })
		wg.Wait()
	})
}
