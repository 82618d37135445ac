package controlserver_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/egressd/egressd/internal/controlserver"
	"github.com/egressd/egressd/internal/pipenet"
	"github.com/egressd/egressd/internal/privtest"
	"github.com/egressd/egressd/pkg/control"
)

const helperEnv = "EGRESSD_CONTROL_TEST_HELPER"

// quiet drops the server's logs; the tests check what clients see.
var quiet = slog.New(slog.DiscardHandler)

// TestMain runs the test binary as a control client when a test started it
// as one (under another uid, to present real non-root credentials), and as
// the tests otherwise.
func TestMain(m *testing.M) {
	if os.Getenv(helperEnv) == "call" {
		os.Exit(helperCall(os.Args[1:]))
	}
	os.Exit(m.Run())
}

// callResult is what the helper prints: the answer or how the call failed.
type callResult struct {
	Kind string          `json:"kind"` // ok, denied, not_running, api, other
	Err  string          `json:"err,omitempty"`
	Body json.RawMessage `json:"body,omitempty"`
}

// helperCall: SOCKET METHOD ROUTE [BODY].
func helperCall(args []string) int {
	if len(args) < 3 {
		fmt.Fprintln(os.Stderr, "call: want SOCKET METHOD ROUTE [BODY]")
		return 2
	}
	c := &control.Client{Socket: args[0], Timeout: 10 * time.Second}
	var in any
	if len(args) > 3 {
		in = json.RawMessage(args[3])
	}
	var out json.RawMessage
	err := c.Do(context.Background(), args[1], args[2], in, &out)
	res := callResult{Kind: "ok", Body: out}
	if err != nil {
		res.Err = err.Error()
		switch {
		case errors.Is(err, control.ErrAccessDenied):
			res.Kind = "denied"
		case errors.Is(err, control.ErrNotRunning):
			res.Kind = "not_running"
		default:
			res.Kind = "other"
			if _, ok := control.AsAPIError(err); ok {
				res.Kind = "api"
			}
		}
	}
	json.NewEncoder(os.Stdout).Encode(res)
	return 0
}

// sockDir is a short directory for sockets (a socket path has a 108-byte
// limit that t.TempDir's names can pass), removed when the test ends.
func sockDir(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "egc")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// whoami is what the whoami route answers.
type whoami struct {
	Peer   controlserver.Peer `json:"peer"`
	Access string             `json:"access"`
}

// echoIn is the body of the echo and decode routes.
type echoIn struct {
	Name string   `json:"name"`
	Port uint16   `json:"port"`
	Tags []string `json:"tags,omitempty"`
}

// testRoutes is a route table exercising each feature; calls counts the
// handler invocations per route.
type testRoutes struct {
	mu    sync.Mutex
	calls map[string]int
	// streamDone receives once per events handler that returns.
	streamDone chan error
}

func (tr *testRoutes) count(name string) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	tr.calls[name]++
}

func (tr *testRoutes) called(name string) int {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	return tr.calls[name]
}

var errPlain = errors.New("disk on fire")

func (tr *testRoutes) table() map[string]controlserver.Route {
	return map[string]controlserver.Route{
		"whoami": {Method: http.MethodGet, Handler: controlserver.JSON(func(r *http.Request, _ struct{}) (whoami, error) {
			tr.count("whoami")
			p, _ := controlserver.PeerFrom(r.Context())
			return whoami{Peer: p, Access: controlserver.AccessFrom(r.Context()).String()}, nil
		})},
		"echo": {Method: http.MethodPost, Write: true, Handler: controlserver.JSON(func(r *http.Request, in echoIn) (echoIn, error) {
			tr.count("echo")
			return in, nil
		})},
		"decode": {Method: http.MethodPost, Handler: func(w http.ResponseWriter, r *http.Request) error {
			tr.count("decode")
			var in echoIn
			if err := controlserver.Decode(r, &in); err != nil {
				return err
			}
			return controlserver.WriteJSON(w, http.StatusOK, in)
		}},
		"fail": {Method: http.MethodGet, Handler: func(w http.ResponseWriter, r *http.Request) error {
			tr.count("fail")
			switch how := r.URL.Query().Get("how"); how {
			case "panic":
				panic("boom")
			case "plain":
				return fmt.Errorf("check disk: %w", errPlain)
			case "wrapped-not-found":
				return fmt.Errorf("rule %q: %w", "payments", control.ErrNotFound)
			default:
				return control.Errorf(control.Code(how), "failed with %s", how)
			}
		}},
		"slow": {Method: http.MethodGet, Handler: func(w http.ResponseWriter, r *http.Request) error {
			select {
			case <-r.Context().Done():
			case <-time.After(10 * time.Second):
			}
			return nil
		}},
		"events": {Method: http.MethodGet, Stream: true, Handler: func(w http.ResponseWriter, r *http.Request) (err error) {
			tr.count("events")
			defer func() {
				if tr.streamDone != nil {
					tr.streamDone <- err
				}
			}()
			q := r.URL.Query()
			if q.Get("missing") != "" {
				return control.Errorf(control.CodeNotFound, "no such rule %q", q.Get("missing"))
			}
			sw, err := controlserver.NewStreamWriter(w)
			if err != nil {
				return err
			}
			for i := 0; ; i++ {
				if q.Get("follow") == "" && i >= 3 {
					return nil
				}
				if q.Get("break") != "" && i == 1 {
					return errors.New("ring buffer gone")
				}
				if q.Get("keepalive") != "" {
					if err := sw.Keepalive(); err != nil {
						return err
					}
				}
				if q.Get("big") != "" {
					if err := sw.Send(map[string]string{"fill": strings.Repeat("x", 64<<10)}); err != nil {
						return err
					}
				}
				send := sw.Send
				if q.Get("queue") != "" {
					send = sw.Queue
				}
				if err := send(map[string]int{"seq": i}); err != nil {
					return err
				}
				if q.Get("follow") != "" {
					select {
					case <-r.Context().Done():
						if q.Get("ctxerr") != "" {
							return r.Context().Err()
						}
						return nil
					case <-time.After(10 * time.Millisecond):
					}
				}
			}
		}},
	}
}

// harness is a server on a real socket and a client for it.
type harness struct {
	srv    *controlserver.Server
	sock   string
	routes *testRoutes
	client *control.Client
}

// start serves the test routes on a new socket until the test ends.
func start(t testing.TB, cfg controlserver.Config) *harness {
	t.Helper()
	tr := &testRoutes{calls: map[string]int{}}
	if cfg.Socket == "" {
		cfg.Socket = filepath.Join(sockDir(t), "egressd.sock")
	}
	cfg.Routes = tr.table()
	if cfg.Logger == nil {
		cfg.Logger = quiet
	}
	srv, err := controlserver.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	serve(t, srv)
	c := &control.Client{Socket: cfg.Socket, Timeout: 10 * time.Second}
	t.Cleanup(c.CloseIdleConnections)
	return &harness{srv: srv, sock: cfg.Socket, routes: tr, client: c}
}

// dialer opens a connection to a server.
type dialer func(ctx context.Context) (net.Conn, error)

// serve listens and serves with srv until the test ends, and returns a
// dialer of its socket.
func serve(t testing.TB, srv *controlserver.Server) dialer {
	t.Helper()
	ln, err := srv.Listen()
	if err != nil {
		t.Fatal(err)
	}
	serveUntilEnd(t, srv, func() error { return srv.Serve(ln) })
	return func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", ln.Addr().String())
	}
}

// serveInMemory serves with srv on an in-memory network until the test
// ends, every connection's peer root, and returns a dialer of it: for a
// test in a synctest bubble, whose clock a goroutine blocked on a unix
// socket would keep still.
func serveInMemory(t testing.TB, srv *controlserver.Server) dialer {
	t.Helper()
	var n pipenet.Network
	ln, err := n.Listen("egressd.sock")
	if err != nil {
		t.Fatal(err)
	}
	serveUntilEnd(t, srv, func() error { return controlserver.ServeAs(srv, ln, controlserver.Peer{}) })
	return func(ctx context.Context) (net.Conn, error) { return n.DialContext(ctx, "unix", "egressd.sock") }
}

// serveUntilEnd runs serve until the test ends, and then closes srv.
func serveUntilEnd(t testing.TB, srv *controlserver.Server, serve func() error) {
	done := make(chan error, 1)
	go func() { done <- serve() }()
	t.Cleanup(func() {
		srv.Close()
		if err := <-done; err != nil {
			t.Errorf("serve: %v", err)
		}
	})
}

// raw sends a hand-made request over the socket and returns the status,
// the error body (if any) and the headers.
func (h *harness) raw(t testing.TB, method, path, body string, header http.Header) (int, map[string]string, http.Header) {
	t.Helper()
	tr := &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", h.sock)
	}}
	defer tr.CloseIdleConnections()
	req, err := http.NewRequest(method, "http://egressd"+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range header {
		req.Header[k] = v
	}
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	var e map[string]string
	if resp.StatusCode >= 300 {
		if err := json.Unmarshal(b, &e); err != nil {
			t.Fatalf("%s %s: status %d, body is not a JSON error: %q", method, path, resp.StatusCode, b)
		}
		if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
			t.Errorf("%s %s: error Content-Type %q", method, path, ct)
		}
	}
	return resp.StatusCode, e, resp.Header
}

func requireRoot(t testing.TB) {
	t.Helper()
	privtest.RequireHostRoot(t, "starts clients under other uids and chowns sockets")
}
