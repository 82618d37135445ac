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
