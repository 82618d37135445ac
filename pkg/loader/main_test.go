//go:build linux

package loader

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/internal/privtest"
	"github.com/egressd/egressd/pkg/cgroups"
)

func TestMain(m *testing.M) {
	privtest.Main(m, privtest.Role{Name: "datapath", Run: runDatapath}, privtest.Role{Name: "udpflows", Run: runUDPFlows})
}

// runDatapath is a daemon stand-in: it opens the datapath pinned at
// args[1] on cgroup args[0], applies a concurrency limit of args[3] to
// the prefixes args[2] (comma-separated), says "ready" and waits to be killed.
func runDatapath(args []string) error {
	limit, err := strconv.Atoi(args[3])
	if err != nil {
		return err
	}
	d, err := Open(&Config{Cgroup: args[0], PinDir: args[1], MaxRules: 64})
	if err != nil {
		return err
	}
	var dests []netip.Prefix
	for _, p := range strings.Split(args[2], ",") {
		dests = append(dests, netip.MustParsePrefix(p))
	}
	if err := d.Put(Rule{Name: "restart", Dests: dests, Limit: uint32(limit)}); err != nil {
		return err
	}
	fmt.Println("ready")
	_, err = io.Copy(io.Discard, os.Stdin)
	return err
}

// open loads a datapath attached to a fresh cgroup with its own pins.
func open(t *testing.T) (*Datapath, string) {
	t.Helper()
	return openSockTable(t, 0)
}

// openSockTable is open with a socket table of n entries (0: the default).
func openSockTable(t *testing.T, n int) (*Datapath, string) {
	t.Helper()
	privtest.RequireRoot(t)
	cg := privtest.Cgroup(t, "loader")
	pins := privtest.PinDir(t)
	d, err := Open(&Config{Cgroup: cg, PinDir: pins, MaxRules: 64, SockTable: n, VerifierLog: true})
	if err != nil {
		t.Fatalf("open: %v", err)
	}
	t.Cleanup(func() {
		if err := d.Uninstall(); err != nil {
			t.Errorf("uninstall: %v", err)
		}
	})
	return d, cg
}

// openSamples opens d's latency samples until the test ends.
func openSamples(t *testing.T, d *Datapath) *SampleReader {
	t.Helper()
	samples, err := d.Samples()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { samples.Close() })
	return samples
}

func put(t *testing.T, d *Datapath, r Rule) {
	t.Helper()
	if err := d.Put(r); err != nil {
		t.Fatalf("put %s: %v", r.Name, err)
	}
}

func stats(t testing.TB, d *Datapath, name string) Stats {
	t.Helper()
	s, err := d.Stats(name)
	if err != nil {
		t.Fatalf("stats %s: %v", name, err)
	}
	return s
}

// counted is a rule's counters as Counts reads them.
func counted(t testing.TB, d *Datapath, name string) Stats {
	t.Helper()
	var s *Stats
	if err := d.Counts(func(r *Rule, st *Stats) {
		if r.Name == name {
			s = new(*st)
		}
	}); err != nil {
		t.Fatalf("counts: %v", err)
	}
	if s == nil {
		t.Fatalf("counts: no rule %s", name)
	}
	return *s
}

// waitLive waits until the rule's live count is want and returns the
// stats that showed it: releases at TCP_CLOSE happen in softirq context
// shortly after close() returns.
func waitLive(t testing.TB, d *Datapath, name string, want int64) Stats {
	t.Helper()
	var s Stats
	clocktest.Eventually(t, fmt.Sprintf("rule %s's live count to be %d", name, want), func() bool {
		s = stats(t, d, name)
		return s.Live == want
	})
	return s
}

// serve accepts on addr until the test ends, handing each connection to
// handle; connections still open at the end are closed.
func serve(t testing.TB, network, addr string, handle func(net.Conn)) netip.AddrPort {
	t.Helper()
	ln, err := net.Listen(network, addr)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var conns []net.Conn
	done := false
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			if done {
				// Accepted while the cleanup closed the others: a handler
				// started now would wait forever for a client that may
				// never close, and the cleanup with it.
				mu.Unlock()
				c.Close()
				return
			}
			conns = append(conns, c)
			mu.Unlock()
			wg.Go(func() { handle(c) })
		}
	})
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		done = true
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return netip.MustParseAddrPort(ln.Addr().String())
}

// listen accepts and holds connections until the test ends.
func listen(t testing.TB, network, addr string) netip.AddrPort {
	t.Helper()
	return serve(t, network, addr, func(c net.Conn) { io.Copy(io.Discard, c) })
}

// connect opens a TCP connection with plain syscalls, so that addresses
// the net package rewrites (v4-mapped IPv6 on an AF_INET6 socket) reach
// the kernel as written.
func connect(ap netip.AddrPort) (io.Closer, error) {
	var family int
	var sa unix.Sockaddr
	if ap.Addr().Is4() {
		family, sa = unix.AF_INET, &unix.SockaddrInet4{Port: int(ap.Port()), Addr: ap.Addr().As4()}
	} else {
		family, sa = unix.AF_INET6, &unix.SockaddrInet6{Port: int(ap.Port()), Addr: ap.Addr().As16()}
	}
	fd, err := unix.Socket(family, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	if err := unix.Connect(fd, sa); err != nil {
		unix.Close(fd)
		return nil, err
	}
	return &fdCloser{fd: fd}, nil
}

// fdCloser closes its descriptor once. A second close of the number
// could close whatever took it since - an accepted connection, a map -
// and a test closes a connection and then closes it again in its cleanup.
type fdCloser struct {
	once sync.Once
	fd   int
}

func (c *fdCloser) Close() error {
	var err error = syscall.EBADF
	c.once.Do(func() { err = unix.Close(c.fd) })
	return err
}

// echoServer answers each byte with itself: a request and its response.
func echoServer(t testing.TB) netip.AddrPort {
	return serve(t, "tcp4", "127.0.0.1:0", echo)
}

func echo(c net.Conn) {
	buf := make([]byte, 1)
	for {
		if _, err := c.Read(buf); err != nil {
			return
		}
		if _, err := c.Write(buf); err != nil {
			return
		}
	}
}

func dial(t *testing.T, ap netip.AddrPort) io.Closer {
	t.Helper()
	c, err := connect(ap)
	if err != nil {
		t.Fatalf("dial %s: %v", ap, err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func dialRefused(t *testing.T, ap netip.AddrPort, want syscall.Errno) {
	t.Helper()
	c, err := connect(ap)
	if err == nil {
		c.Close()
		t.Fatalf("dial %s: admitted, want %v", ap, want)
	}
	if !errors.Is(err, want) {
		t.Fatalf("dial %s: %v, want %v", ap, err, want)
	}
}

func scopeOf(t testing.TB, dir string) Scope {
	t.Helper()
	id, err := cgroups.ID(dir)
	if err != nil {
		t.Fatal(err)
	}
	lvl, err := cgroups.Level(dir)
	if err != nil {
		t.Fatal(err)
	}
	return Scope{CgroupID: id, Level: uint32(lvl)}
}
