package privtest

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// runAgent dials and closes connections on command, one per line on stdin:
// "dial ADDR TIMEOUT" answers "ok ID" or "err ERRNO"; "close ID" answers
// "ok"; "loop ADDR N" connects and closes N times with bare syscalls and
// answers "ok NS", the mean time of one connect()+close(); "refused ADDR N"
// does the same with connects that must fail with EPERM; "udp-send ADDR N"
// sends N one-byte datagrams to ADDR from a UDP socket the helper keeps for
// the next udp-send, and answers "ok NS", the mean time of one sendto();
// "udp-open ADDR N" opens a UDP socket, sends it one datagram to ADDR and
// closes it, N times, and answers "ok NS", the mean time of one
// socket()+sendto()+close(); "sendto ADDR" does that once and answers "ok"
// or "err ERRNO"; "echo ADDR N" opens one connection, sends a byte and reads
// one back N times, and answers "ok NS", the mean round trip; "storm PROTO
// ADDR PORTS RATE DURATION" opens a socket of PROTO (tcp or udp) at RATE per
// second for DURATION, connects it (tcp) or sends it a datagram (udp) to
// ADDR's port and the next PORTS-1, one after the other, and closes it, and
// answers "ok N ERRS", the sockets opened and how many of the connects or
// sends failed with EPERM; "until-refused ADDR TIMEOUT" connects and closes
// until a connect fails with EPERM and answers "ok", or "timeout"; "hold
// ADDR N" opens N sockets and connects each to ADDR, port after port,
// keeping them whether connect() succeeds or fails, and answers "ok N" with
// the connects that did not fail with EPERM; "release" closes them; "accept
// ADDR N" listens on ADDR and accepts N connections in the background,
// keeping them, and answers "ok" once it listens; "pin CPU" keeps the
// helper's commands on one CPU.
func runAgent([]string) error {
	conns := map[int]net.Conn{}
	next := 0
	var held []int
	udp := -1 // udp-send's socket
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		f := strings.Fields(in.Text())
		switch {
		case len(f) == 3 && f[0] == "dial":
			timeout, err := time.ParseDuration(f[2])
			if err != nil {
				return err
			}
			c, err := net.DialTimeout("tcp", f[1], timeout)
			if err != nil {
				fmt.Printf("err %d\n", Errno(err))
				continue
			}
			conns[next] = c
			fmt.Printf("ok %d\n", next)
			next++
		case len(f) == 3 && (f[0] == "loop" || f[0] == "refused"):
			per, err := connectLoop(f[1], f[2], f[0] == "refused")
			if err != nil {
				return err
			}
			fmt.Printf("ok %d\n", per.Nanoseconds())
		case len(f) == 3 && f[0] == "udp-send":
			if udp < 0 {
				var err error
				if udp, err = unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0); err != nil {
					return err
				}
			}
			per, err := sendLoop(udp, f[1], f[2])
			if err != nil {
				return err
			}
			fmt.Printf("ok %d\n", per.Nanoseconds())
		case len(f) == 3 && f[0] == "udp-open":
			per, err := sendLoop(-1, f[1], f[2])
			if err != nil {
				return err
			}
			fmt.Printf("ok %d\n", per.Nanoseconds())
		case len(f) == 2 && f[0] == "sendto":
			sa, _, err := parseTarget(f[1], "1")
			if err != nil {
				return err
			}
			if err := try(unix.SOCK_DGRAM, sa); err != nil {
				fmt.Printf("err %d\n", Errno(err))
				continue
			}
			fmt.Println("ok")
		case len(f) == 3 && f[0] == "echo":
			per, err := echoLoop(f[1], f[2])
			if err != nil {
				return err
			}
			fmt.Printf("ok %d\n", per.Nanoseconds())
		case len(f) == 3 && f[0] == "until-refused":
			timeout, err := time.ParseDuration(f[2])
			if err != nil {
				return err
			}
			refused, err := untilRefused(f[1], timeout)
			if err != nil {
				return err
			}
			if refused {
				fmt.Println("ok")
			} else {
				fmt.Println("timeout")
			}
		case len(f) == 3 && f[0] == "hold":
			fds, err := hold(f[1], f[2])
			held = append(held, fds...)
			if err != nil {
				return err
			}
			fmt.Printf("ok %d\n", len(fds))
		case len(f) == 3 && f[0] == "accept":
			n, err := strconv.Atoi(f[2])
			if err != nil {
				return err
			}
			ln, err := net.Listen("tcp4", f[1])
			if err != nil {
				return err
			}
			go func() {
				var kept []net.Conn
				for len(kept) < n {
					c, err := ln.Accept()
					if err != nil {
						return
					}
					kept = append(kept, c)
				}
				ln.Close()
				select {} // keep them until the helper ends
			}()
			fmt.Println("ok")
		case len(f) == 2 && f[0] == "pin":
			cpu, err := strconv.Atoi(f[1])
			if err != nil {
				return err
			}
			runtime.LockOSThread() // the commands run on this goroutine
			var set unix.CPUSet
			set.Set(cpu)
			if err := unix.SchedSetaffinity(0, &set); err != nil {
				return fmt.Errorf("pin: %w", err)
			}
			fmt.Println("ok")
		case len(f) == 1 && f[0] == "release":
			for _, fd := range held {
				unix.Close(fd)
			}
			held = nil
			fmt.Println("ok")
		case len(f) == 6 && f[0] == "storm":
			n, refused, err := refusalStorm(f[1], f[2], f[3], f[4], f[5])
			if err != nil {
				return err
			}
			fmt.Printf("ok %d %d\n", n, refused)
		case len(f) == 2 && f[0] == "close":
			id, _ := strconv.Atoi(f[1])
			if c, ok := conns[id]; ok {
				c.Close()
				delete(conns, id)
			}
			fmt.Println("ok")
		default:
			return fmt.Errorf("agent: bad command %q", in.Text())
		}
	}
	return in.Err()
}

// Errno extracts the errno of a failed dial, or -1 when there is none
// (a timeout, for instance).
func Errno(err error) int {
	var en syscall.Errno
	if errors.As(err, &en) {
		return int(en)
	}
	return -1
}

// runStorm dials ADDR in a loop for DURATION. Each admitted connection says
// hello, holds for up to HOLD, says bye and waits for the server's ack
// before closing, so the server only ever counts connections the client
// still holds. It prints "admitted N refused M failed K".
func runStorm(args []string) error {
	if len(args) != 3 {
		return fmt.Errorf("storm: want ADDR DURATION HOLD, got %q", args)
	}
	d, err := time.ParseDuration(args[1])
	if err != nil {
		return err
	}
	hold, err := time.ParseDuration(args[2])
	if err != nil {
		return err
	}
	var admitted, refused, failed atomic.Int64
	var wg sync.WaitGroup
	deadline := time.Now().Add(d)
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := make([]byte, 1)
			for time.Now().Before(deadline) {
				c, err := net.DialTimeout("tcp", args[0], time.Second)
				if err != nil {
					if errors.Is(err, syscall.EPERM) {
						refused.Add(1)
						time.Sleep(50 * time.Microsecond)
					} else {
						failed.Add(1)
					}
					continue
				}
				admitted.Add(1)
				ok := func() bool {
					if _, err := c.Write([]byte{'h'}); err != nil {
						return false
					}
					time.Sleep(rand.N(hold + 1))
					if _, err := c.Write([]byte{'b'}); err != nil {
						return false
					}
					_, err := io.ReadFull(c, buf)
					return err == nil
				}()
				if !ok {
					failed.Add(1)
				}
				c.Close()
			}
		}()
	}
	wg.Wait()
	fmt.Printf("admitted %d refused %d failed %d\n", admitted.Load(), refused.Load(), failed.Load())
	return nil
}

// CloseEach accepts on ln until the test ends, closing each connection at
// once: a peer that admits connections and holds none. It returns ln's port.
func CloseEach(t testing.TB, ln net.Listener) int {
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	})
	return ln.Addr().(*net.TCPAddr).Port
}

// StormServer accepts the storm protocol and records the most connections
// that were between hello and bye at once.
type StormServer struct {
	Addr   string
	active atomic.Int64
	max    atomic.Int64
	total  atomic.Int64
}

// NewStormServer listens on loopback until the test ends.
func NewStormServer(t testing.TB) *StormServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &StormServer{Addr: ln.Addr().String()}
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				s.serve(c)
			}()
		}
	}()
	return s
}

func (s *StormServer) serve(c net.Conn) {
	buf := make([]byte, 1)
	if _, err := io.ReadFull(c, buf); err != nil || buf[0] != 'h' {
		return
	}
	n := s.active.Add(1)
	s.total.Add(1)
	for {
		m := s.max.Load()
		if n <= m || s.max.CompareAndSwap(m, n) {
			break
		}
	}
	_, err := io.ReadFull(c, buf)
	s.active.Add(-1)
	if err == nil && buf[0] == 'b' {
		c.Write([]byte{'a'})
	}
}

// Max is the most concurrent connections the server saw.
func (s *StormServer) Max() int64 { return s.max.Load() }

// Total is how many connections said hello.
func (s *StormServer) Total() int64 { return s.total.Load() }

// connectLoop connects and closes count times; with refused, each
// connect() must fail with EPERM instead.
func connectLoop(addr, count string, refused bool) (time.Duration, error) {
	sa, n, err := parseTarget(addr, count)
	if err != nil {
		return 0, err
	}
	start := time.Now()
	for range n {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return 0, err
		}
		err = unix.Connect(fd, sa)
		unix.Close(fd)
		if refused && err != unix.EPERM {
			return 0, fmt.Errorf("connect %s: %v, want EPERM", addr, err)
		}
		if !refused && err != nil {
			return 0, fmt.Errorf("connect %s: %w", addr, err)
		}
	}
	return time.Since(start) / time.Duration(n), nil
}

func parseTarget(addr, count string) (*unix.SockaddrInet4, int, error) {
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		return nil, 0, err
	}
	n, err := strconv.Atoi(count)
	if err != nil {
		return nil, 0, err
	}
	return &unix.SockaddrInet4{Port: int(ap.Port()), Addr: ap.Addr().As4()}, n, nil
}

// hold opens n sockets connected (or failing to connect) to addr's port
// and those after it, round robin over eight, and keeps them; it returns
// those a rule did not refuse. N must fit its descriptor limit.
func hold(addr, count string) ([]int, error) {
	sa, n, err := parseTarget(addr, count)
	if err != nil {
		return nil, err
	}
	first := sa.Port
	fds := make([]int, 0, n)
	for i := range n {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return fds, err
		}
		sa.Port = first + i%8
		if unix.Connect(fd, sa) == unix.EPERM {
			unix.Close(fd)
			continue
		}
		fds = append(fds, fd)
	}
	return fds, nil
}

// untilRefused connects and closes until a connect fails with EPERM, for
// at most timeout.
func untilRefused(addr string, timeout time.Duration) (bool, error) {
	sa, _, err := parseTarget(addr, "1")
	if err != nil {
		return false, err
	}
	for deadline := time.Now().Add(timeout); time.Now().Before(deadline); {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return false, err
		}
		err = unix.Connect(fd, sa)
		unix.Close(fd)
		if err == unix.EPERM {
			return true, nil
		}
		time.Sleep(100 * time.Microsecond)
	}
	return false, nil
}

// echoLoop makes count one-byte round trips on one connection.
func echoLoop(addr, count string) (time.Duration, error) {
	sa, n, err := parseTarget(addr, count)
	if err != nil {
		return 0, err
	}
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return 0, err
	}
	defer unix.Close(fd)
	if err := unix.Connect(fd, sa); err != nil {
		return 0, fmt.Errorf("connect %s: %w", addr, err)
	}
	buf := make([]byte, 1)
	start := time.Now()
	for range n {
		if _, err := unix.Write(fd, buf); err != nil {
			return 0, err
		}
		if m, err := unix.Read(fd, buf); err != nil || m != 1 {
			return 0, fmt.Errorf("read: %d bytes, %v", m, err)
		}
	}
	return time.Since(start) / time.Duration(n), nil
}

// sendLoop sends count one-byte datagrams to addr: from fd, or, for a
// negative fd, each from a socket of its own, opened for it and closed
// after.
func sendLoop(fd int, addr, count string) (time.Duration, error) {
	sa, n, err := parseTarget(addr, count)
	if err != nil {
		return 0, err
	}
	buf := []byte{1}
	start := time.Now()
	for range n {
		if fd >= 0 {
			err = unix.Sendto(fd, buf, 0, sa)
		} else {
			err = try(unix.SOCK_DGRAM, sa)
		}
		if err != nil {
			return 0, fmt.Errorf("send to %s: %w", addr, err)
		}
	}
	return time.Since(start) / time.Duration(n), nil
}

// try opens a socket of typ (SOCK_STREAM or SOCK_DGRAM), connects it
// (TCP) or sends it one byte (UDP) to sa, and closes it. It returns what
// connect() or sendto() returned, or the socket's own error wrapped, which
// no caller takes for a refusal (EPERM).
func try(typ int, sa *unix.SockaddrInet4) error {
	fd, err := unix.Socket(unix.AF_INET, typ|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("socket: %w", err)
	}
	defer unix.Close(fd)
	if typ == unix.SOCK_DGRAM {
		return unix.Sendto(fd, []byte{1}, 0, sa)
	}
	return unix.Connect(fd, sa)
}

// stormTypes are the socket types of the storm's protocols.
var stormTypes = map[string]int{"tcp": unix.SOCK_STREAM, "udp": unix.SOCK_DGRAM}

// refusalStorm tries proto's connects (tcp) or first datagrams (udp) at
// rate per second for d to ports consecutive ports from addr's, each from
// a socket of its own, in steps of a millisecond's worth.
func refusalStorm(proto, addr, ports, rate, d string) (n, refused int, err error) {
	typ, ok := stormTypes[proto]
	if !ok {
		return 0, 0, fmt.Errorf("storm: protocol %q, want tcp or udp", proto)
	}
	sa, nports, err := parseTarget(addr, ports)
	if err != nil {
		return 0, 0, err
	}
	perSecond, err := strconv.Atoi(rate)
	if err != nil {
		return 0, 0, err
	}
	dur, err := time.ParseDuration(d)
	if err != nil {
		return 0, 0, err
	}
	first := sa.Port
	start := time.Now()
	for elapsed := time.Duration(0); elapsed < dur; elapsed = time.Since(start) {
		// Catch up to where the rate says we should be.
		for due := int(elapsed.Seconds() * float64(perSecond)); n < due; n++ {
			sa.Port = first + n%nports
			if try(typ, sa) == unix.EPERM {
				refused++
			}
		}
		time.Sleep(time.Millisecond)
	}
	return n, refused, nil
}

// runRequester runs N closed-loop clients against ADDR for DURATION: each
// connects, sends a byte, waits for a byte back and closes, again and
// again; a refused connect() waits 10 ms. It prints
// "done ok N refused M failed K". The clients also stop when stdin closes
// ([Child.CloseInput]). With a fourth argument, a file, it writes there
// every connection's interval as the client saw it (see [Interval]).
func runRequester(args []string) error {
	return RunRequester("requester", args, dialTCP)
}

// A Session is one connection of a requester's client.
type Session interface {
	// Port is the client's own port.
	Port() uint16
	// RoundTrip sends a byte and waits for one back.
	RoundTrip() error
	Close()
}

// RunRequester is runRequester with dial opening each connection, for a
// role named name: a dial that fails with EPERM counts as refused. It
// writes the first failure to stderr.
func RunRequester(name string, args []string, dial func(addr string) (Session, error)) error {
	if len(args) != 3 && len(args) != 4 {
		return fmt.Errorf("%s: want ADDR N DURATION [INTERVALS], got %q", name, args)
	}
	n, err := strconv.Atoi(args[1])
	if err != nil {
		return err
	}
	d, err := time.ParseDuration(args[2])
	if err != nil {
		return err
	}
	var ok, refused, failed atomic.Int64
	var firstErr atomic.Value
	fail := func(err error) {
		firstErr.CompareAndSwap(nil, err.Error())
		failed.Add(1)
	}
	var wg sync.WaitGroup
	held := make([][]Interval, n)
	deadline := time.Now().Add(d)
	var stopped atomic.Bool
	go func() {
		io.Copy(io.Discard, os.Stdin)
		stopped.Store(true)
	}()
	for i := range n {
		wg.Go(func() {
			// Every client tries at least once: a short run on a loaded
			// machine may start after its deadline.
			for first := true; first || time.Now().Before(deadline) && !stopped.Load(); first = false {
				called := Monotonic()
				s, err := dial(args[0])
				if errors.Is(err, syscall.EPERM) {
					refused.Add(1)
					time.Sleep(10 * time.Millisecond)
					continue
				}
				if err != nil {
					fail(err)
					continue
				}
				iv := Interval{Called: called, From: Monotonic(), Port: s.Port()}
				err = s.RoundTrip()
				iv.To = Monotonic()
				s.Close()
				held[i] = append(held[i], iv)
				if err != nil {
					fail(err)
				} else {
					ok.Add(1)
				}
			}
		})
	}
	wg.Wait()
	if len(args) == 4 {
		if err := WriteIntervals(args[3], slices.Concat(held...)); err != nil {
			return err
		}
	}
	if e := firstErr.Load(); e != nil {
		fmt.Fprintf(os.Stderr, "%s: first failure: %s\n", name, e)
	}
	fmt.Printf("done ok %d refused %d failed %d\n", ok.Load(), refused.Load(), failed.Load())
	return nil
}

// tcpSession is a requester's TCP connection.
type tcpSession struct{ net.Conn }

func dialTCP(addr string) (Session, error) {
	c, err := net.DialTimeout("tcp", addr, 2*time.Second)
	if err != nil {
		return nil, err
	}
	return tcpSession{c}, nil
}

func (s tcpSession) Port() uint16 { return uint16(s.LocalAddr().(*net.TCPAddr).Port) }
func (s tcpSession) Close()       { s.Conn.Close() }

func (s tcpSession) RoundTrip() error {
	s.SetDeadline(time.Now().Add(5 * time.Second))
	buf := []byte{1}
	if _, err := s.Write(buf); err != nil {
		return err
	}
	_, err := io.ReadFull(s, buf)
	return err
}
