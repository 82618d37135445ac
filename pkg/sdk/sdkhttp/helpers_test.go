package sdkhttp

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/egressd/egressd/internal/pipenet"
	"github.com/egressd/egressd/pkg/limit"
	"github.com/egressd/egressd/pkg/sdk"
	"github.com/egressd/egressd/pkg/verdict"
)

// Delays short enough to keep the tests quick and distinct enough to tell
// the curves and a Retry-After apart in the attempt log.
const (
	transientDelay = 2 * time.Millisecond
	throttledDelay = 20 * time.Millisecond
	maxDelay       = 30 * time.Millisecond
)

// testPolicy makes attempts attempts on short curves without jitter, with
// no budget or breaker unless the test adds them.
func testPolicy(attempts int) *sdk.Policy {
	return &sdk.Policy{
		MaxAttempts: attempts,
		Backoff: sdk.Backoff{
			Transient: sdk.Curve{Initial: transientDelay, Multiplier: 1},
			Throttled: sdk.Curve{Initial: throttledDelay, Multiplier: 1},
			MaxDelay:  maxDelay,
		},
	}
}

// The tests' servers and clients meet on an in-memory network, so that
// most tests run in synctest bubbles: their backoffs, hedge delays and
// deadlines pass on a fake clock, which a loopback socket would keep from
// moving. A server is at its own address, srvN.test.
var (
	network pipenet.Network
	servers atomic.Int64
)

// server is an HTTP server on the network whose handler plays a script,
// one step per request, repeating the last step once the script runs out.
type server struct {
	URL  string
	srv  *http.Server
	hits atomic.Int32

	mu     sync.Mutex
	bodies []string
}

func serve(t *testing.T, steps ...http.HandlerFunc) *server {
	t.Helper()
	s := &server{}
	host := fmt.Sprintf("srv%d.test", servers.Add(1))
	l, err := network.Listen(host + ":80")
	if err != nil {
		t.Fatal(err)
	}
	s.URL = "http://" + host
	s.srv = &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := int(s.hits.Add(1)) - 1
		b, _ := io.ReadAll(r.Body)
		s.mu.Lock()
		s.bodies = append(s.bodies, string(b))
		s.mu.Unlock()
		steps[min(n, len(steps)-1)](w, r)
	})}
	go s.srv.Serve(l)
	t.Cleanup(s.Close)
	return s
}

// Close stops the server and closes its connections: dials to it are
// refused from then on.
func (s *server) Close() { s.srv.Close() }

// transport returns a transport that dials the tests' servers, its idle
// connections closed when the test ends.
func transport(t *testing.T) *http.Transport {
	tr := &http.Transport{DialContext: network.DialContext}
	t.Cleanup(tr.CloseIdleConnections)
	return tr
}

func (s *server) received() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.bodies...)
}

// host is the server's quota key.
func (s *server) host() string { return strings.TrimPrefix(s.URL, "http://") }

// reply answers with code, headers given as name, value pairs, and body.
func reply(code int, body string, headers ...string) http.HandlerFunc {
	return func(w http.ResponseWriter, _ *http.Request) {
		for i := 0; i+1 < len(headers); i += 2 {
			w.Header().Set(headers[i], headers[i+1])
		}
		w.WriteHeader(code)
		io.WriteString(w, body)
	}
}

var okReply = reply(http.StatusOK, "ok")

// build builds s, over a transport to the tests' servers unless it has a
// base of its own, failing the test on an error, and closes its idle
// connections when the test ends.
func build(t *testing.T, s *Stack) *http.Client {
	t.Helper()
	if s.base == nil {
		s.base = transport(t)
	}
	rt, err := s.Build()
	if err != nil {
		t.Fatalf("Build: %v", err)
	}
	t.Cleanup(rt.CloseIdleConnections)
	return &http.Client{Transport: rt}
}

// get makes a GET to url with a Result in its context, reads and closes the
// body, and returns the status (0 on an error), the body and the Result.
func get(t *testing.T, c *http.Client, url string) (int, string, Result, error) {
	t.Helper()
	return do(t, c, mustRequest(t, context.Background(), http.MethodGet, url, nil))
}

func do(t *testing.T, c *http.Client, req *http.Request) (int, string, Result, error) {
	t.Helper()
	var res Result
	resp, err := c.Do(req.WithContext(WithResult(req.Context(), &res)))
	if err != nil {
		return 0, "", res, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), res, err
}

func mustRequest(t *testing.T, ctx context.Context, method, url string, body io.Reader) *http.Request {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, method, url, body)
	if err != nil {
		t.Fatal(err)
	}
	return req
}

func kinds(log []verdict.Attempt) []string {
	var ks []string
	for _, a := range log {
		k := a.Kind().String()
		if a.SelfImposed() {
			k += "(self-imposed)"
		}
		ks = append(ks, k)
	}
	return ks
}

// counter is a limit.Observer that counts acquires.
type counter struct {
	acquired, denied atomic.Int64
}

func (c *counter) OnLease(o limit.Outcome) {
	if o == limit.Acquired {
		c.acquired.Add(1)
	} else {
		c.denied.Add(1)
	}
}
func (c *counter) OnWait(time.Duration) {}
func (c *counter) OnLimit(int)          {}

func newLimiter(t *testing.T, opts limit.Options) *limit.Local {
	t.Helper()
	l, err := limit.New(opts)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// trackedBody is a request body that records whether it was closed.
type trackedBody struct {
	io.Reader
	closed atomic.Bool
}

func (b *trackedBody) Close() error { b.closed.Store(true); return nil }

// eperm is the error a dial refused by the kernel returns.
func eperm() error {
	return &net.OpError{Op: "dial", Net: "tcp", Addr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 9}, Err: os.NewSyscallError("connect", syscall.EPERM)}
}
