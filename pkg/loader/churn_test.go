//go:build linux

package loader

import (
	"errors"
	"io"
	"net"
	"net/netip"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/egressd/egressd/internal/privtest"
)

// resetServer accepts, reads one byte and resets the connection.
func resetServer(t *testing.T) netip.AddrPort {
	t.Helper()
	return serve(t, "tcp4", "127.0.0.1:0", func(c net.Conn) {
		// Read first: a reset racing the client's connect() wake-up
		// would fail the connect itself.
		c.Read(make([]byte, 1))
		c.(*net.TCPConn).SetLinger(0)
		c.Close()
	})
}

// closedPort returns a loopback port nobody listens on.
func closedPort(t *testing.T) netip.AddrPort {
	t.Helper()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ap := netip.MustParseAddrPort(ln.Addr().String())
	ln.Close()
	return ap
}

func socket4(t *testing.T, flags int) int {
	t.Helper()
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC|flags, 0)
	if err != nil {
		t.Fatal(err)
	}
	return fd
}

func sa4(ap netip.AddrPort) *unix.SockaddrInet4 {
	return &unix.SockaddrInet4{Port: int(ap.Port()), Addr: ap.Addr().As4()}
}

// TestChurnLeavesNothing drives more than 10,000 connects through every
// way a connection can end and checks that every slot came back.
func TestChurnLeavesNothing(t *testing.T) {
	d, cg := open(t)
	srv := listen(t, "tcp4", "127.0.0.1:0")
	rst := resetServer(t)
	closed := closedPort(t)

	ns := privtest.NewNetNS(t)
	peer := privtest.NewNetNS(t)
	// 10.201.0.2 is on the link but nobody answers ARP for it: SYNs go
	// nowhere. 10.202.0.1 has no route at all.
	privtest.Veth(t, ns, "10.201.0.1/24", peer, "10.201.0.3/24")
	silent := netip.MustParseAddrPort("10.201.0.2:80")
	unroutable := netip.MustParseAddrPort("10.202.0.1:80")

	const localLimit = 8
	put(t, d, Rule{Name: "local", Dests: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}, Limit: localLimit})
	put(t, d, Rule{Name: "netns", Dests: []netip.Prefix{netip.MustParsePrefix("10.200.0.0/14")}, Limit: 1000})
	privtest.Join(t, cg)

	connects := 0
	expect := func(what string, err, want error) {
		t.Helper()
		connects++
		if !errors.Is(err, want) {
			t.Fatalf("%s: %v, want %v", what, err, want)
		}
	}

	// A child holding the whole limit is killed with SIGKILL: the kernel
	// closes its sockets and the slots come back.
	child := privtest.Spawn(t, cg, "agent")
	for range localLimit {
		if reply := child.Call(t, "dial %s 2s", srv); !strings.HasPrefix(reply, "ok") {
			t.Fatalf("child dial: %s", reply)
		}
		connects++
	}
	expect("dial while the child holds the limit", dialErr(srv), syscall.EPERM)
	child.Kill(t)
	waitLive(t, d, "local", 0)

	for round := range 2500 {
		// Admitted and closed; every 50 rounds, fill the limit first so
		// the next dial is refused, then reuse the refused socket.
		if round%50 == 0 {
			var held []io.Closer
			for range localLimit {
				c, err := connect(srv)
				expect("fill", err, nil)
				held = append(held, c)
			}
			if round == 0 {
				checkRecount(t, d, "local", localLimit)
			}
			fd := socket4(t, 0)
			expect("over the limit", unix.Connect(fd, sa4(srv)), unix.EPERM)
			held[0].Close()
			waitLive(t, d, "local", localLimit-1)
			expect("re-connect after refusal", unix.Connect(fd, sa4(srv)), nil)
			unix.Close(fd)
			for _, c := range held[1:] {
				c.Close()
			}
		}
		c, err := connect(srv)
		expect("plain", err, nil)
		c.Close()

		// Refused by the peer: RST to the SYN.
		expect("closed port", dialErr(closed), syscall.ECONNREFUSED)

		// Reset by the peer while the fd stays open: released at
		// TCP_CLOSE, before close().
		fd := socket4(t, 0)
		expect("to reset server", unix.Connect(fd, sa4(rst)), nil)
		unix.Write(fd, []byte{1})
		unix.Read(fd, make([]byte, 1))
		if round == 0 {
			waitLive(t, d, "local", 0)
		}
		unix.Close(fd)

		// A socket closed without ever connecting holds nothing.
		unix.Close(socket4(t, 0))
	}

	err := ns.Do(func() error {
		for range 1000 {
			// SYN to a silent peer, given up after a millisecond.
			fd := socket4(t, unix.SOCK_NONBLOCK)
			connects++
			if err := unix.Connect(fd, sa4(silent)); err != unix.EINPROGRESS {
				return err
			}
			unix.Poll([]unix.PollFd{{Fd: int32(fd), Events: unix.POLLOUT}}, 1)
			unix.Close(fd)

			// No route: fails after the hook, before tcp_connect();
			// only the re-connect and close paths can release it.
			fd = socket4(t, 0)
			connects += 2
			if err := unix.Connect(fd, sa4(unroutable)); err != unix.ENETUNREACH {
				return err
			}
			if err := unix.Connect(fd, sa4(unroutable)); err != unix.ENETUNREACH {
				return err
			}
			unix.Close(fd)
		}
		// And through the net package, whose dial times out.
		for range 5 {
			connects++
			if _, err := net.DialTimeout("tcp4", silent.String(), 20*time.Millisecond); err == nil {
				return errors.New("dial to a silent peer succeeded")
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("netns: %v", err)
	}

	t.Logf("%d connects", connects)
	if connects < 10_000 {
		t.Fatalf("only %d connects", connects)
	}
	for _, name := range []string{"local", "netns"} {
		s := waitLive(t, d, name, 0)
		if s.Admitted != s.Released || s.Untracked != 0 {
			t.Errorf("%s: admitted %d released %d untracked %d", name, s.Admitted, s.Released, s.Untracked)
		}
		t.Logf("%s: %+v", name, s)
	}
	rc, err := d.Recount()
	if err != nil {
		t.Fatal(err)
	}
	for name, r := range rc {
		if r.Drift() != 0 || r.Live != 0 || r.InFlight != r.CountedInFlight {
			t.Errorf("recount %s: %+v", name, r)
		}
	}
}

// dialErr connects and closes, returning the connect error.
func dialErr(ap netip.AddrPort) error {
	c, err := connect(ap)
	if err == nil {
		c.Close()
	}
	return err
}

// checkRecount walks the sockets and expects the rule's kernel count and
// the socket count to agree on live.
func checkRecount(t *testing.T, d *Datapath, rule string, live int64) {
	t.Helper()
	rc, err := d.Recount()
	if err != nil {
		t.Fatal(err)
	}
	if r := rc[rule]; r.Live != live || r.Counted != live {
		t.Fatalf("recount %s: %+v, want %d live and counted", rule, r, live)
	}
}

// zeroBacklog returns a listening socket on a loopback port whose accept
// queue is full with one connection waiting.
func zeroBacklog(t *testing.T) (int, netip.AddrPort) {
	t.Helper()
	ln := socket4(t, 0)
	t.Cleanup(func() { unix.Close(ln) })
	if err := unix.Bind(ln, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	if err := unix.Listen(ln, 0); err != nil {
		t.Fatal(err)
	}
	sa, err := unix.Getsockname(ln)
	if err != nil {
		t.Fatal(err)
	}
	in4 := sa.(*unix.SockaddrInet4)
	return ln, netip.AddrPortFrom(netip.AddrFrom4(in4.Addr), uint16(in4.Port))
}

// fullListener returns a loopback port whose listener has a full accept
// queue: the kernel drops every SYN to it, answering nothing.
func fullListener(t *testing.T) netip.AddrPort {
	t.Helper()
	_, ap := zeroBacklog(t)
	filler := socket4(t, 0)
	t.Cleanup(func() { unix.Close(filler) })
	if err := unix.Connect(filler, sa4(ap)); err != nil {
		t.Fatal(err)
	}
	return ap
}

// TestFailedConnectReleases: a connect() that fails before the connection
// is established, its fd left open. When TCP gives up on an unanswered
// SYN, the slot comes back at once (sockops RTO_CB). A connect() refused
// by the peer keeps its slot until the socket's next connect() or its
// close() (sockops STATE_CB is on only for established connections).
func TestFailedConnectReleases(t *testing.T) {
	d, cg := open(t)
	silent := fullListener(t) // before the rule: the filler holds no slot
	closed := closedPort(t)
	put(t, d, Rule{Name: "r", Dests: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}, Limit: 10})
	privtest.Join(t, cg)

	fd := socket4(t, unix.SOCK_NONBLOCK)
	defer unix.Close(fd)
	// Given up at the first retransmission timeout (about 1 s): the user
	// timeout has run out by then.
	if err := unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, 1); err != nil {
		t.Fatal(err)
	}
	if err := unix.Connect(fd, sa4(silent)); err != unix.EINPROGRESS {
		t.Fatalf("connect to a full listener: %v, want EINPROGRESS", err)
	}
	if s := stats(t, d, "r"); s.Live != 1 {
		t.Fatalf("live %d after the SYN, want 1", s.Live)
	}
	pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLOUT}}
	if n, err := unix.Poll(pfd, 10_000); n != 1 || err != nil {
		t.Fatalf("poll: %d, %v", n, err)
	}
	if errno, _ := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ERROR); syscall.Errno(errno) != unix.ETIMEDOUT {
		t.Fatalf("connect: %v, want ETIMEDOUT", syscall.Errno(errno))
	}
	if s := stats(t, d, "r"); s.Live != 0 || s.Released != 1 || s.ConnectFailed != 1 {
		t.Errorf("after TCP gave up, fd open: live %d, released %d, connect failed %d; want 0, 1, 1", s.Live, s.Released, s.ConnectFailed)
	}

	refused := socket4(t, 0)
	for i := range 2 {
		if err := unix.Connect(refused, sa4(closed)); err != unix.ECONNREFUSED {
			unix.Close(refused)
			t.Fatalf("connect %d to a closed port: %v, want ECONNREFUSED", i, err)
		}
		if s := stats(t, d, "r"); s.Live != 1 || s.Released != uint64(1+i) {
			t.Errorf("after refusal %d, fd open: live %d, released %d; want 1, %d", i, s.Live, s.Released, 1+i)
		}
	}
	unix.Close(refused)
	if s := stats(t, d, "r"); s.Live != 0 || s.Released != 3 || s.ConnectFailed != 3 {
		t.Errorf("after close: live %d, released %d, connect failed %d; want 0, 3, 3", s.Live, s.Released, s.ConnectFailed)
	}

	// Disconnected while its SYN goes unanswered: back at close().
	pending := socket4(t, unix.SOCK_NONBLOCK)
	if err := unix.Connect(pending, sa4(silent)); err != unix.EINPROGRESS {
		unix.Close(pending)
		t.Fatalf("connect to a full listener: %v, want EINPROGRESS", err)
	}
	if err := disconnect(pending); err != nil {
		unix.Close(pending)
		t.Fatalf("disconnect: %v", err)
	}
	if s := stats(t, d, "r"); s.Live != 1 {
		t.Errorf("disconnected, fd open: live %d, want 1", s.Live)
	}
	unix.Close(pending)
	if s := stats(t, d, "r"); s.Live != 0 || s.Released != 4 {
		t.Errorf("after close: live %d, released %d; want 0, 4", s.Live, s.Released)
	}
}

// disconnect connects fd to AF_UNSPEC, which takes a TCP socket to
// TCP_CLOSE (tcp_disconnect) and leaves it open.
func disconnect(fd int) error {
	unspec := unix.RawSockaddr{Family: unix.AF_UNSPEC}
	if _, _, errno := unix.Syscall(unix.SYS_CONNECT, uintptr(fd), uintptr(unsafe.Pointer(&unspec)), unsafe.Sizeof(unspec)); errno != 0 {
		return errno
	}
	return nil
}

// TestSimultaneousOpen: a socket connected to its own address meets its
// own SYN, and TCP establishes it as a passive open. It counts as
// established, and a disconnect while its fd stays open gives its slot
// back at once, as for any established connection.
func TestSimultaneousOpen(t *testing.T) {
	d, cg := open(t)
	put(t, d, Rule{Name: "r", Dests: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}, Limit: 10})
	privtest.Join(t, cg)
	fd := socket4(t, 0)
	defer unix.Close(fd)
	if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	self, err := unix.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Connect(fd, self); err != nil {
		t.Fatalf("connect to itself: %v", err)
	}
	if s := stats(t, d, "r"); s.Live != 1 || s.Established != 1 {
		t.Fatalf("live %d, established %d; want 1, 1", s.Live, s.Established)
	}
	if err := disconnect(fd); err != nil {
		t.Fatalf("disconnect: %v", err)
	}
	if s := stats(t, d, "r"); s.Live != 0 || s.Released != 1 || s.ConnectFailed != 0 {
		t.Errorf("after disconnect, fd open: live %d, released %d, connect failed %d; want 0, 1, 0", s.Live, s.Released, s.ConnectFailed)
	}
}
