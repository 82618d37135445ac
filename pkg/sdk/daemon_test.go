package sdk

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"testing"
	"testing/synctest"
	"time"

	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/internal/pipenet"
	"github.com/egressd/egressd/pkg/control"
)

// refusedByDaemon is the daemon's answer to every question in these tests.
const refusedByDaemon = `{"refused":true,"rule":"payments","retryAfterSeconds":0.05}`

// daemonNet is a control socket on an in-memory network, for the tests that
// run in synctest bubbles: a goroutine blocked on a unix socket would keep
// the bubble's clock from moving.
type daemonNet struct{ n pipenet.Network }

const daemonAddr = "egressd.sock"

// client returns a control client of the socket, its idle connections
// closed when the test ends.
func (d *daemonNet) client(t *testing.T) *control.Client {
	c := &control.Client{Socket: daemonAddr, Dial: func(ctx context.Context) (net.Conn, error) {
		return d.n.DialContext(ctx, "unix", daemonAddr)
	}}
	t.Cleanup(c.CloseIdleConnections)
	return c
}

// listen listens on the socket until the test ends.
func (d *daemonNet) listen(t *testing.T) net.Listener {
	t.Helper()
	l, err := d.n.Listen(daemonAddr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

// serveDaemon answers attribution questions on d with refusedByDaemon, and
// counts them.
func serveDaemon(t *testing.T, d *daemonNet) *atomic.Int32 {
	t.Helper()
	return answeringDaemon(t, d, func() string { return refusedByDaemon })
}

func refusedDialTo(port int) error {
	return &net.OpError{Op: "dial", Net: "tcp", Addr: &net.TCPAddr{IP: net.IPv4(10, 0, 0, 1), Port: port}, Err: os.NewSyscallError("connect", syscall.EPERM)}
}

// A question that failed - the attempt's context ended during it, the
// daemon was not there yet - is no answer: the next refusal asks again,
// rather than being taken for a firewall's.
func TestDaemonAttributorAsksAgainAfterAFailedQuestion(t *testing.T) {
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	tests := []struct {
		name         string
		ctx          context.Context
		daemonBefore bool
	}{
		{"context ended", cancelled, true},
		{"no daemon yet", context.Background(), false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var d daemonNet
			var asked *atomic.Int32
			if tt.daemonBefore {
				asked = serveDaemon(t, &d)
			}
			attr := DaemonAttributor(d.client(t))
			if _, ok := attr(tt.ctx, refusedDialTo(443)); ok {
				t.Fatal("attributed without an answer")
			}
			if !tt.daemonBefore {
				asked = serveDaemon(t, &d)
			}
			rl, ok := attr(context.Background(), refusedDialTo(443))
			if !ok || rl.Limiter != "payments" || asked.Load() != 1 {
				t.Errorf("second refusal: %v, %v, daemon asked %d times; want the daemon's rule, asked once", rl, ok, asked.Load())
			}
		})
	}
}

// A cached "yes" hands out the time left until the kernel's retry hint, not
// the hint as it was when the daemon was asked.
func TestDaemonAttributorHintCountsDown(t *testing.T) {
	synctest.Test(t, testDaemonAttributorHintCountsDown)
}

func testDaemonAttributorHintCountsDown(t *testing.T) {
	var d daemonNet
	asked := serveDaemon(t, &d)
	start := time.Now()
	attr := DaemonAttributor(d.client(t))
	for _, step := range []struct {
		advance time.Duration
		want    time.Duration
		asked   int32
	}{
		{0, 50 * time.Millisecond, 1},
		{30 * time.Millisecond, 20 * time.Millisecond, 1},
		{40 * time.Millisecond, time.Nanosecond, 1}, // past the hint: due now
		{attributedFor, 50 * time.Millisecond, 2},   // asked again
	} {
		clocktest.Advance(step.advance)
		rl, ok := attr(context.Background(), refusedDialTo(443))
		if !ok || rl.RetryAfter != step.want || asked.Load() != step.asked {
			t.Errorf("at %v: %v, %v, daemon asked %d times; want retry after %v, asked %d", time.Since(start), rl, ok, asked.Load(), step.want, step.asked)
		}
	}
}

// silentDaemon accepts connections on d and reads what it is sent, but
// never answers: a daemon stopped under a debugger, or deadlocked. It counts
// the connections.
func silentDaemon(t *testing.T, d *daemonNet) *atomic.Int32 {
	t.Helper()
	lis := d.listen(t)
	accepted := new(atomic.Int32)
	go func() {
		for {
			c, err := lis.Accept()
			if err != nil {
				return
			}
			accepted.Add(1)
			go io.Copy(io.Discard, c) // until the asker hangs up
		}
	}()
	return accepted
}

// A daemon that takes the question and never answers costs a refused
// connect a short wait of the question's own, not the caller's deadline (or,
// with none, forever), and the refusals that come soon after do not wait
// for it again. Unanswered, the refusal stays Permanent.
func TestDaemonAttributorBoundsASilentDaemon(t *testing.T) {
	synctest.Test(t, testDaemonAttributorBoundsASilentDaemon)
}

func testDaemonAttributorBoundsASilentDaemon(t *testing.T) {
	var d daemonNet
	accepted := silentDaemon(t, &d)
	attr := DaemonAttributor(d.client(t))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)

	start := time.Now()
	if rl, ok := attr(ctx, refusedDialTo(443)); ok {
		t.Fatalf("attributed to %v without an answer", rl)
	}
	if took := time.Since(start); ctx.Err() != nil || took != askTimeout {
		t.Errorf("the first refusal waited %v (the caller's context: %v); want the question's %v", took, ctx.Err(), askTimeout)
	}
	if rl, ok := attr(ctx, refusedDialTo(444)); ok {
		t.Fatalf("attributed to %v without an answer", rl)
	}
	if n := accepted.Load(); n > 1 {
		t.Errorf("the next refusal asked the daemon again: asked %d times, want once", n)
	}
}

// A silent daemon and callers whose deadlines are shorter than the
// question's: the first caller gives up at its deadline, the question goes
// on, and its silence quiets the questions after, so that later refusals
// do not each wait out their deadline on the daemon.
func TestDaemonAttributorSilentDaemonShortDeadlines(t *testing.T) {
	synctest.Test(t, testDaemonAttributorSilentDaemonShortDeadlines)
}

func testDaemonAttributorSilentDaemonShortDeadlines(t *testing.T) {
	var d daemonNet
	accepted := silentDaemon(t, &d)
	a := newDaemonAttributor(d.client(t))
	refuse := func(port int) bool {
		ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
		defer cancel()
		_, ok := a.attribute(ctx, refusedDialTo(port))
		return ok
	}
	if refuse(443) {
		t.Fatal("attributed without an answer")
	}
	// The question's own deadline passes: the daemon is silent.
	synctest.Wait()
	if n := accepted.Load(); n != 1 {
		t.Fatalf("the question reached the daemon %d times; want once", n)
	}
	clocktest.Advance(askTimeout)
	a.mu.Lock()
	quiet := time.Now().Before(a.quiet)
	a.mu.Unlock()
	if !quiet {
		t.Fatal("the question outlived its deadline, or its silence did not quiet the next ones")
	}
	start := time.Now()
	for port := 444; port < 454; port++ {
		if refuse(port) {
			t.Fatal("attributed without an answer")
		}
	}
	if n, took := accepted.Load(), time.Since(start); n != 1 || took != 0 {
		t.Errorf("10 refusals while quiet: the daemon asked %d times in all, they took %v; want once, before them, and no wait", n, took)
	}
}

// Refusals to one destination that come while its question is in flight
// wait for that question: one connection to the daemon, one answer.
func TestDaemonAttributorOneQuestionAtATime(t *testing.T) {
	synctest.Test(t, testDaemonAttributorOneQuestionAtATime)
}

func testDaemonAttributorOneQuestionAtATime(t *testing.T) {
	var d daemonNet
	lis := d.listen(t)
	var asked atomic.Int32
	release := make(chan struct{})
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		asked.Add(1)
		<-release
		w.Header().Set("Content-Type", "application/json")
		w.Write([]byte(refusedByDaemon))
	})}
	go srv.Serve(lis)
	t.Cleanup(func() { srv.Close() })
	a := newDaemonAttributor(d.client(t))
	const refusals = 8
	results := make(chan bool, refusals)
	for range refusals {
		go func() {
			_, ok := a.attribute(context.Background(), refusedDialTo(443))
			results <- ok
		}()
	}
	synctest.Wait() // every refusal is waiting, and every question sent has arrived
	if n := asked.Load(); n != 1 {
		t.Fatalf("%d questions reached the daemon while the first was unanswered; want 1", n)
	}
	close(release)
	for range refusals {
		if !<-results {
			t.Error("a refusal was not attributed")
		}
	}
	if n := asked.Load(); n != 1 {
		t.Errorf("the daemon was asked %d times, want once", n)
	}
}

// answeringDaemon answers attribution questions on d with what answer
// returns at the time, and counts them.
func answeringDaemon(t *testing.T, d *daemonNet, answer func() string) *atomic.Int32 {
	t.Helper()
	lis := d.listen(t)
	asked := new(atomic.Int32)
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		asked.Add(1)
		w.Header().Set("Content-Type", "application/json")
		w.Write([]byte(answer()))
	})}
	go srv.Serve(lis)
	t.Cleanup(func() { srv.Close() })
	return asked
}

// An EPERM is the daemon's only if the daemon refused this process's
// connect() to the destination after the attempt was made: one of an
// attempt made after the latest refusal came from elsewhere (seccomp, a
// firewall), though the daemon refused the destination a moment before.
// A cached "yes" vouches for attempts made up to attributedFor after the
// refusal it names; later ones ask again. Without the attempt's start (a
// Classify outside the executor) any recent refusal counts.
func TestDaemonAttributorRefusalAfterTheAttempt(t *testing.T) {
	synctest.Test(t, testDaemonAttributorRefusalAfterTheAttempt)
}

func testDaemonAttributorRefusalAfterTheAttempt(t *testing.T) {
	var d daemonNet
	asked := answeringDaemon(t, &d, func() string {
		return `{"refused":true,"rule":"payments","secondsAgo":0.5}`
	})
	a := newDaemonAttributor(d.client(t))
	startedAgo := func(d time.Duration) context.Context {
		return context.WithValue(context.Background(), attemptStartKey{}, time.Now().Add(-d))
	}
	for i, step := range []struct {
		ctx     context.Context
		advance time.Duration
		want    bool
		asked   int32
	}{
		// Each answer names a refusal 0.5 s before it.
		{startedAgo(time.Second), 0, true, 1},
		{startedAgo(400 * time.Millisecond), 0, true, 1},  // made within 100 ms of it: the cache vouches
		{startedAgo(300 * time.Millisecond), 0, false, 2}, // made after: asked, and the daemon's refusal is older
		{context.Background(), 0, true, 2},                // start not known: the cached refusal counts
		{startedAgo(time.Second), 0, true, 2},
		{startedAgo(300 * time.Millisecond), attributedFor + time.Millisecond, false, 3},
		{startedAgo(600 * time.Millisecond), 0, true, 3},
	} {
		clocktest.Advance(step.advance)
		_, ok := a.attribute(step.ctx, refusedDialTo(443))
		if ok != step.want || asked.Load() != step.asked {
			t.Errorf("step %d: attributed %v, daemon asked %d times; want %v, %d", i, ok, asked.Load(), step.want, step.asked)
		}
	}
}

// An error marked with its dial's start is judged by that, not by the
// attempt's: a call failed fast with the error of a dial refused before
// it began is the refusal's still.
func TestDaemonAttributorDialStart(t *testing.T) { synctest.Test(t, testDaemonAttributorDialStart) }

func testDaemonAttributorDialStart(t *testing.T) {
	var d daemonNet
	answeringDaemon(t, &d, func() string {
		return `{"refused":true,"rule":"payments","secondsAgo":0.5}`
	})
	c := d.client(t)
	for _, tc := range []struct {
		dialedAgo time.Duration // 0: not marked
		want      bool
	}{{0, false}, {time.Second, true}, {400 * time.Millisecond, false}} {
		a := newDaemonAttributor(c)
		ctx := context.WithValue(context.Background(), attemptStartKey{}, time.Now().Add(-300*time.Millisecond))
		err := error(refusedDialTo(443))
		if tc.dialedAgo != 0 {
			err = WithDialStart(err, time.Now().Add(-tc.dialedAgo))
		}
		if _, ok := a.attribute(ctx, err); ok != tc.want {
			t.Errorf("attempt begun after the refusal, dial begun %v before the answer: attributed %v, want %v", tc.dialedAgo, ok, tc.want)
		}
	}
}

// The executor tells the Attributor when the attempt was made.
func TestAttributorToldAttemptStart(t *testing.T) {
	var got time.Time
	var told bool
	p := &Policy{MaxAttempts: 1, Classifier: DefaultClassifier().WithAttributor(func(ctx context.Context, err error) (*RateLimitedError, bool) {
		got, told = attemptStarted(ctx)
		return nil, false
	})}
	before := time.Now()
	var called time.Time
	Run(context.Background(), p, func(context.Context) (struct{}, error) {
		called = time.Now()
		return struct{}{}, refusedDialTo(443)
	})
	if !told || got.Before(before) || got.After(called) {
		t.Errorf("attempt start %v (told %v), want between %v and the call, %v", got, told, before, called)
	}
}

// The refusals the daemon is asked about: an EPERM of a TCP or UDP dial,
// or of a UDP write (a QUIC client's first packet), each asked about as
// the protocol it is; a TCP write's EPERM, another errno or an error
// without an address is nobody's question.
func TestRefusedFlow(t *testing.T) {
	eperm := os.NewSyscallError("connect", syscall.EPERM)
	sendEPERM := os.NewSyscallError("sendmsg", syscall.EPERM)
	udp := &net.UDPAddr{IP: net.IPv4(10, 0, 0, 1), Port: 443}
	mapped := &net.UDPAddr{IP: net.IPv4(10, 0, 0, 1).To16(), Port: 443}
	tcp := &net.TCPAddr{IP: net.IPv4(10, 0, 0, 1), Port: 443}
	dest := netip.MustParseAddrPort("10.0.0.1:443")
	tests := []struct {
		name string
		err  error
		want flow
		ok   bool
	}{
		{"TCP dial", &net.OpError{Op: "dial", Net: "tcp", Addr: tcp, Err: eperm}, flow{"tcp", dest}, true},
		{"UDP dial", &net.OpError{Op: "dial", Net: "udp", Addr: udp, Err: eperm}, flow{"udp", dest}, true},
		{"UDP write", &net.OpError{Op: "write", Net: "udp", Addr: mapped, Err: sendEPERM}, flow{"udp", dest}, true},
		{"UDP write, wrapped", fmt.Errorf("quic dial: %w", &net.OpError{Op: "write", Net: "udp", Addr: udp, Err: sendEPERM}), flow{"udp", dest}, true},
		{"TCP write", &net.OpError{Op: "write", Net: "tcp", Addr: tcp, Err: sendEPERM}, flow{}, false},
		{"UDP read", &net.OpError{Op: "read", Net: "udp", Addr: udp, Err: eperm}, flow{}, false},
		{"another errno", &net.OpError{Op: "dial", Net: "tcp", Addr: tcp, Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}, flow{}, false},
		{"no address", &net.OpError{Op: "dial", Net: "unix", Addr: &net.UnixAddr{Name: "/s"}, Err: eperm}, flow{}, false},
		{"not an OpError", syscall.EPERM, flow{}, false},
	}
	for _, tt := range tests {
		got, ok := refusedFlow(tt.err)
		if got != tt.want || ok != tt.ok {
			t.Errorf("%s: refusedFlow = %v, %v; want %v, %v", tt.name, got, ok, tt.want, tt.ok)
		}
	}
}

// A UDP refusal is asked about as UDP: the daemon tells a QUIC flow's
// refusal from a TCP connect()'s to the same address.
func TestDaemonAttributorAsksTheProtocol(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "s")
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	protos := make(chan string, 2)
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		protos <- r.URL.Query().Get("proto")
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, refusedByDaemon)
	})}
	go srv.Serve(lis)
	t.Cleanup(func() { srv.Close() })
	attr := DaemonAttributor(&control.Client{Socket: sock})
	udp := &net.OpError{Op: "write", Net: "udp", Addr: &net.UDPAddr{IP: net.IPv4(10, 0, 0, 1), Port: 443}, Err: os.NewSyscallError("sendmsg", syscall.EPERM)}
	for _, tt := range []struct {
		err   error
		proto string
	}{{udp, "udp"}, {refusedDialTo(443), "tcp"}} {
		if rl, ok := attr(context.Background(), tt.err); !ok || rl.Limiter != "payments" {
			t.Fatalf("%v: attributed %v, %v; want to rule payments", tt.err, rl, ok)
		}
		if got := <-protos; got != tt.proto {
			t.Errorf("%v: asked about proto %q, want %q", tt.err, got, tt.proto)
		}
	}
}
