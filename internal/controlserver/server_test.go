package controlserver_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/internal/controlserver"
	"github.com/egressd/egressd/pkg/control"
)

func TestRealPeerCredentials(t *testing.T) {
	h := start(t, controlserver.Config{})
	var got whoami
	if err := h.client.Get(context.Background(), "whoami", &got); err != nil {
		t.Fatal(err)
	}
	if got.Peer.PID != int32(os.Getpid()) || got.Peer.UID != uint32(os.Geteuid()) || got.Peer.GID != uint32(os.Getegid()) {
		t.Errorf("peer = %+v, want pid %d uid %d gid %d", got.Peer, os.Getpid(), os.Geteuid(), os.Getegid())
	}
	if got.Peer.Groups == nil {
		t.Errorf("peer groups unknown; want them from SO_PEERGROUPS or /proc")
	}
	// The daemon's own uid (root here, or whoever runs the test) writes.
	if got.Access != "write" {
		t.Errorf("access = %s, want write", got.Access)
	}
	in := echoIn{Name: "payments", Port: 443, Tags: []string{"a"}}
	var out echoIn
	if err := h.client.Post(context.Background(), "echo", in, &out); err != nil {
		t.Fatal(err)
	}
	if out.Name != in.Name || out.Port != in.Port || len(out.Tags) != 1 {
		t.Errorf("echo = %+v, want %+v", out, in)
	}
}

func TestBrowserRequestsRefused(t *testing.T) {
	h := start(t, controlserver.Config{})
	for _, hdr := range []string{"Origin", "Referer", "Sec-Fetch-Site"} {
		t.Run(hdr, func(t *testing.T) {
			status, body, _ := h.raw(t, http.MethodGet, "/v1/whoami", "", http.Header{hdr: {"http://evil.example"}})
			if status != http.StatusForbidden || body["code"] != "forbidden" || !strings.Contains(body["error"], hdr) {
				t.Errorf("status %d body %v, want 403 forbidden naming %s", status, body, hdr)
			}
		})
	}
	// Also before routing: a browser learns nothing about which routes exist.
	status, _, _ := h.raw(t, http.MethodGet, "/v1/nope", "", http.Header{"Origin": {"null"}})
	if status != http.StatusForbidden {
		t.Errorf("unknown route with Origin: status %d, want 403", status)
	}
	if n := h.routes.called("whoami"); n != 0 {
		t.Errorf("handler called %d times for browser requests", n)
	}
}

func TestRouting(t *testing.T) {
	h := start(t, controlserver.Config{})
	tests := []struct {
		method, path string
		status       int
		code, msg    string
		allow        string
	}{
		{"GET", "/v1/nope", 404, "not_found", `unknown route "/v1/nope"`, ""},
		{"GET", "/v1/", 404, "not_found", "unknown route", ""},
		{"GET", "/v2/whoami", 404, "not_found", "under /v1/", ""},
		{"GET", "/whoami", 404, "not_found", "under /v1/", ""},
		{"GET", "/v1/whoami/", 404, "not_found", "unknown route", ""},
		{"POST", "/v1/whoami", 405, "invalid", "method POST not allowed on /v1/whoami (use GET)", "GET"},
		{"GET", "/v1/echo", 405, "invalid", "use POST", "POST"},
		{"DELETE", "/v1/echo", 405, "invalid", "use POST", "POST"},
	}
	for _, tt := range tests {
		status, body, hdr := h.raw(t, tt.method, tt.path, "", nil)
		if status != tt.status || body["code"] != tt.code || !strings.Contains(body["error"], tt.msg) || hdr.Get("Allow") != tt.allow {
			t.Errorf("%s %s: %d %v Allow %q, want %d %s containing %q Allow %q",
				tt.method, tt.path, status, body, hdr.Get("Allow"), tt.status, tt.code, tt.msg, tt.allow)
		}
	}
}

func TestMalformedRequests(t *testing.T) {
	h := start(t, controlserver.Config{})
	big := `{"name":"` + strings.Repeat("x", controlserver.MaxBodyBytes) + `"}`
	tests := []struct {
		name, body, msg string
	}{
		{"truncated", `{"name":`, "malformed JSON: the body ends inside a value"},
		{"syntax", `{"name" "x"}`, "malformed JSON at byte 9"},
		{"not json", `nul`, "malformed JSON"},
		{"unknown field", `{"name":"x","bogus":1}`, `unknown field "bogus"`},
		{"second value", `{"name":"x"} {"name":"y"}`, "data after the JSON value"},
		{"trailing garbage", `{"name":"x"} garbage`, "data after the JSON value"},
		{"type", `{"port":"80"}`, `field "port": cannot use JSON string as uint16`},
		{"range", `{"port":70000}`, `field "port": cannot use JSON number 70000 as uint16`},
		{"nested type", `{"tags":[1]}`, `field "tags`},
		{"array body", `[1,2]`, "request body: cannot use JSON array"},
		{"empty", ``, "request body is empty"},
		{"white space", " \n\t", "request body is empty"},
		{"oversize", big, "larger than 1 MiB"},
		{"oversize padding", `{}` + strings.Repeat(" ", controlserver.MaxBodyBytes), "larger than 1 MiB"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			status, body, _ := h.raw(t, http.MethodPost, "/v1/decode", tt.body, nil)
			if status != http.StatusBadRequest || body["code"] != "invalid" || !strings.Contains(body["error"], tt.msg) {
				t.Errorf("status %d body %v, want 400 invalid containing %q", status, body, tt.msg)
			}
		})
	}
	// The same through the client: a typed error matching ErrInvalid.
	err := h.client.Post(context.Background(), "decode", map[string]any{"name": "x", "bogus": true}, nil)
	ae, ok := control.AsAPIError(err)
	if !ok || ae.Status != 400 || !errors.Is(err, control.ErrInvalid) || err.Error() != `unknown field "bogus"` {
		t.Errorf("client error = %#v (%v), want *APIError 400 invalid", err, err)
	}
	// A body that is just right still works after all that.
	status, _, _ := h.raw(t, http.MethodPost, "/v1/decode", `{"name":"x","port":443}`+" \n", nil)
	if status != http.StatusOK {
		t.Errorf("valid body: status %d", status)
	}
}

func TestJSONEmptyBodyIsZeroValue(t *testing.T) {
	h := start(t, controlserver.Config{})
	var out echoIn
	if err := h.client.Post(context.Background(), "echo", nil, &out); err != nil {
		t.Fatal(err)
	}
	if out.Name != "" || out.Port != 0 {
		t.Errorf("echo of nothing = %+v", out)
	}
}

func TestHandlerErrors(t *testing.T) {
	h := start(t, controlserver.Config{})
	tests := []struct {
		how      string
		status   int
		code     string
		msg      string
		sentinel error
	}{
		{"invalid", 400, "invalid", "failed with invalid", control.ErrInvalid},
		{"not_found", 404, "not_found", "failed with not_found", control.ErrNotFound},
		{"conflict", 409, "conflict", "failed with conflict", control.ErrConflict},
		{"forbidden", 403, "forbidden", "failed with forbidden", control.ErrAccessDenied},
		{"unavailable", 503, "unavailable", "failed with unavailable", control.ErrUnavailable},
		{"internal", 500, "internal", "failed with internal", nil},
		{"made_up", 500, "made_up", "failed with made_up", nil},
		{"plain", 500, "internal", "check disk: disk on fire", nil},
		{"wrapped-not-found", 404, "not_found", `rule "payments": not found`, control.ErrNotFound},
		{"panic", 500, "internal", "panic: boom", nil},
	}
	for _, tt := range tests {
		t.Run(tt.how, func(t *testing.T) {
			status, body, _ := h.raw(t, http.MethodGet, "/v1/fail?how="+tt.how, "", nil)
			if status != tt.status || body["code"] != tt.code || !strings.Contains(body["error"], tt.msg) {
				t.Errorf("status %d body %v, want %d %s containing %q", status, body, tt.status, tt.code, tt.msg)
			}
			err := h.client.Get(context.Background(), "fail?how="+tt.how, nil)
			if err == nil || !strings.Contains(err.Error(), tt.msg) {
				t.Fatalf("client error %v, want one containing %q", err, tt.msg)
			}
			if tt.sentinel != nil && !errors.Is(err, tt.sentinel) {
				t.Errorf("client error %v does not match %v", err, tt.sentinel)
			}
			for _, s := range []error{control.ErrInvalid, control.ErrNotFound, control.ErrConflict, control.ErrUnavailable, control.ErrAccessDenied, control.ErrNotRunning} {
				if s != tt.sentinel && errors.Is(err, s) {
					t.Errorf("client error %v also matches %v", err, s)
				}
			}
		})
	}
	// A panic did not take the server down.
	if err := h.client.Get(context.Background(), "whoami", nil); err != nil {
		t.Errorf("after panic: %v", err)
	}
}

// ServeHTTP works without a socket when the test supplies the peer; the
// permission decision follows the peer.
func TestServeHTTPWithPeer(t *testing.T) {
	tr := &testRoutes{calls: map[string]int{}}
	srv, err := controlserver.New(controlserver.Config{Routes: tr.table(), Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	// Someone who is neither root nor the test's own uid (the "daemon's").
	someone := controlserver.Peer{PID: 42, UID: 54321, GID: 54321}
	tests := []struct {
		name   string
		ctx    context.Context
		method string
		path   string
		status int
	}{
		{"no peer", context.Background(), "GET", "/v1/whoami", 403},
		{"read as someone", controlserver.WithPeer(context.Background(), someone), "GET", "/v1/whoami", 200},
		{"write as someone", controlserver.WithPeer(context.Background(), someone), "POST", "/v1/echo", 403},
		{"write as root", controlserver.WithPeer(context.Background(), controlserver.Peer{PID: 1}), "POST", "/v1/echo", 200},
	}
	for _, tt := range tests {
		rec := httptest.NewRecorder()
		req := httptest.NewRequestWithContext(tt.ctx, tt.method, tt.path, nil)
		srv.ServeHTTP(rec, req)
		if rec.Code != tt.status {
			t.Errorf("%s: status %d (%s), want %d", tt.name, rec.Code, rec.Body, tt.status)
		}
	}
	rec := httptest.NewRecorder()
	srv.ServeHTTP(rec, httptest.NewRequestWithContext(controlserver.WithPeer(context.Background(), someone), "POST", "/v1/echo", nil))
	if !strings.Contains(rec.Body.String(), "needs root") || !strings.Contains(rec.Body.String(), "you are uid 54321") {
		t.Errorf("write refusal does not say who may write: %s", rec.Body)
	}
}

// A connection that is not a unix socket has no credentials, so nothing is
// answered on it, even if someone serves the API on TCP by mistake.
func TestNoCredentialsNoAccess(t *testing.T) {
	tr := &testRoutes{calls: map[string]int{}}
	srv, err := controlserver.New(controlserver.Config{Routes: tr.table(), Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	t.Cleanup(func() { srv.Close(); <-done })
	resp, err := http.Get("http://" + ln.Addr().String() + "/v1/whoami")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusForbidden || tr.called("whoami") != 0 {
		t.Errorf("over TCP: status %d, handler calls %d; want 403 and none", resp.StatusCode, tr.called("whoami"))
	}
}

func TestNewServerListsEveryProblem(t *testing.T) {
	ok := func(http.ResponseWriter, *http.Request) error { return nil }
	_, err := controlserver.New(controlserver.Config{
		Mode:  0o4660,
		Group: "no-such-group-egressd-test",
		Routes: map[string]controlserver.Route{
			"":         {Method: "GET", Handler: ok},
			"/status":  {Method: "GET", Handler: ok},
			"a b":      {Method: "GET", Handler: ok},
			"limits":   {Method: "get", Handler: ok},
			"nohandle": {Method: "POST"},
			"fine/one": {Method: "GET", Handler: ok},
		},
	})
	if err == nil {
		t.Fatal("no error")
	}
	for _, want := range []string{
		"mode", `group "no-such-group-egressd-test"`, `route "": empty name`, `route "/status": name must not start`,
		`route "a b": name has ' '`, `route "limits": method "get"`, `route "nohandle": no handler`,
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %q", err, want)
		}
	}
	if strings.Contains(err.Error(), "fine/one") {
		t.Errorf("error %q mentions a good route", err)
	}
	if _, err := controlserver.New(controlserver.Config{}); err == nil || !strings.Contains(err.Error(), "no routes") {
		t.Errorf("no routes: %v", err)
	}
}

// TestBodyNotSentInTime: a request whose body does not come is answered
// once the body's time is up, and a slow handler, with a body it has read
// or without one, is not cut by that deadline.
func TestBodyNotSentInTime(t *testing.T) { synctest.Test(t, testBodyNotSentInTime) }

func testBodyNotSentInTime(t *testing.T) {
	const body, work = 100 * time.Millisecond, 300 * time.Millisecond
	tr := &testRoutes{calls: map[string]int{}}
	routes := tr.table()
	routes["slowecho"] = controlserver.Route{Method: http.MethodPost, Handler: controlserver.JSON(func(r *http.Request, in echoIn) (echoIn, error) {
		return in, clocktest.Latency(r.Context(), work)
	})}
	routes["slowget"] = controlserver.Route{Method: http.MethodGet, Handler: controlserver.JSON(func(r *http.Request, _ struct{}) (struct{}, error) {
		return struct{}{}, clocktest.Latency(r.Context(), work)
	})}
	srv, err := controlserver.New(controlserver.Config{Routes: routes, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	controlserver.SetBodyTimeout(srv, body)
	dial := serveInMemory(t, srv)

	c, err := dial(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	start := time.Now()
	if _, err := io.WriteString(c, "POST /v1/decode HTTP/1.1\r\nHost: egressd\r\nContent-Length: 1048576\r\n\r\n{"); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("no answer to a request whose body does not come: %v", err)
	}
	if took := time.Since(start); resp.StatusCode != http.StatusBadRequest || took != body {
		t.Errorf("status %d after %v, want 400 after the body's %v", resp.StatusCode, took, body)
	}

	client := &control.Client{Timeout: 5 * time.Second, Dial: dial}
	t.Cleanup(client.CloseIdleConnections)
	var out echoIn
	start = time.Now()
	if err := client.Do(context.Background(), http.MethodPost, "slowecho", echoIn{Name: "a"}, &out); err != nil || out.Name != "a" || time.Since(start) != work {
		t.Errorf("slow handler after its body: %+v, %v after %v; want it after %v", out, err, time.Since(start), work)
	}
	start = time.Now()
	if err := client.Get(context.Background(), "slowget", nil); err != nil || time.Since(start) != work {
		t.Errorf("slow handler without a body: %v after %v; want it after %v", err, time.Since(start), work)
	}
}

// A peer that asks for a stream and stops reading fails the stream's next
// write once the write timeout has passed: the handler returns, where it
// would otherwise hold its goroutine, and a stop, for ever.
func TestStreamWriteTimesOut(t *testing.T) {
	tr := &testRoutes{calls: map[string]int{}, streamDone: make(chan error, 1)}
	srv, err := controlserver.New(controlserver.Config{Socket: filepath.Join(sockDir(t), "egressd.sock"), Routes: tr.table(), Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	controlserver.SetWriteTimeout(srv, 200*time.Millisecond)
	get(t, serve(t, srv), "/v1/events?follow=1&big=1")
	// Never read: the socket's buffers fill and the handler's write blocks.
	awaitWriteTimeout(t, tr.streamDone)
}

// get sends a GET of path on a connection of its own, which it returns
// unread. The test ends with the connection closed.
func get(t *testing.T, dial dialer, path string) net.Conn {
	t.Helper()
	c, err := dial(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if _, err := io.WriteString(c, "GET "+path+" HTTP/1.1\r\nHost: egressd\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	return c
}

// awaitWriteTimeout waits for a handler writing to a peer that does not
// read to return, failed by its write's deadline.
func awaitWriteTimeout(t *testing.T, done <-chan error) {
	t.Helper()
	select {
	case err := <-done:
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Errorf("handler returned %v, want its write's deadline exceeded", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the handler still writes to a peer that has not read for 5 s")
	}
}

// bigAnswer is a server, not yet serving, of route "big": a JSON answer
// of about n bytes, as `limit ls` is for a daemon with many rules. done
// receives what each call of the handler returned.
func bigAnswer(t *testing.T, n int, timeout time.Duration) (srv *controlserver.Server, done chan error) {
	t.Helper()
	done = make(chan error, 1)
	srv, err := controlserver.New(controlserver.Config{Socket: filepath.Join(sockDir(t), "egressd.sock"), Logger: quiet, Routes: map[string]controlserver.Route{
		"big": {Method: http.MethodGet, Handler: func(w http.ResponseWriter, r *http.Request) (err error) {
			defer func() { done <- err }()
			return controlserver.WriteJSON(w, http.StatusOK, strings.Repeat("x", n))
		}},
	}})
	if err != nil {
		t.Fatal(err)
	}
	controlserver.SetWriteTimeout(srv, timeout)
	return srv, done
}

// A peer that asks for a large answer and never reads it fails the
// answer's write once the write timeout has passed: the handler returns
// and the connection is closed, where they would otherwise hold a
// goroutine, the encoded answer and a stop for ever.
func TestUnreadAnswerTimesOut(t *testing.T) {
	srv, done := bigAnswer(t, 8<<20, 200*time.Millisecond)
	c := get(t, serve(t, srv), "/v1/big")
	// Never read: the socket's buffers fill and the handler's write blocks.
	awaitWriteTimeout(t, done)
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.Copy(io.Discard, c); err != nil {
		t.Errorf("reading what was sent: %v, want the connection closed after it", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if err := srv.Shutdown(ctx); err != nil {
		t.Errorf("Shutdown: %v", err)
	}
}

// A peer that reads a large answer slowly, taking more than twice the
// write timeout over the whole of it (256 reads, each after a 20 ms
// pause) but never stalling for as long, gets all of it: the timeout
// bounds a stall, not the answer's size.
func TestSlowReaderGetsWholeAnswer(t *testing.T) { synctest.Test(t, testSlowReaderGetsWholeAnswer) }

func testSlowReaderGetsWholeAnswer(t *testing.T) {
	const n, timeout = 4 << 20, 2 * time.Second
	srv, done := bigAnswer(t, n, timeout)
	c := get(t, serveInMemory(t, srv), "/v1/big")
	start := time.Now()
	resp, err := http.ReadResponse(bufio.NewReaderSize(&slowReader{r: c, every: 20 * time.Millisecond}, 16<<10), nil)
	if err != nil {
		t.Fatal(err)
	}
	var got string
	if err := json.NewDecoder(resp.Body).Decode(&got); err != nil || len(got) != n {
		t.Errorf("answer of %d bytes (%v), want %d", len(got), err, n)
	}
	if err := <-done; err != nil {
		t.Errorf("handler: %v", err)
	}
	if took := time.Since(start); took < 2*timeout {
		t.Errorf("read in %v, too fast to show a slow reader served", took)
	}
}

// slowReader reads at most 16 KiB at a time, each read after a pause of
// the bubble's clock.
type slowReader struct {
	r     io.Reader
	every time.Duration
}

func (s *slowReader) Read(b []byte) (int, error) {
	clocktest.Advance(s.every)
	return s.r.Read(b[:min(len(b), 16<<10)])
}

// A handler that takes longer than the write timeout still has its
// answer sent, the header alone included, which net/http writes after
// the handler returns: the timeout bounds a write, not the request.
func TestSlowHandlerAnswered(t *testing.T) { synctest.Test(t, testSlowHandlerAnswered) }

func testSlowHandlerAnswered(t *testing.T) {
	srv, err := controlserver.New(controlserver.Config{Logger: quiet, Routes: map[string]controlserver.Route{
		"slow": {Method: http.MethodGet, Handler: func(w http.ResponseWriter, r *http.Request) error {
			if err := clocktest.Latency(r.Context(), 300*time.Millisecond); err != nil {
				return err
			}
			w.WriteHeader(http.StatusNoContent)
			return nil
		}},
	}})
	if err != nil {
		t.Fatal(err)
	}
	controlserver.SetWriteTimeout(srv, 100*time.Millisecond)
	resp, err := http.ReadResponse(bufio.NewReader(get(t, serveInMemory(t, srv), "/v1/slow")), nil)
	if err != nil || resp.StatusCode != http.StatusNoContent {
		t.Fatalf("answer of a handler slower than the write timeout: %v, %v", resp, err)
	}
}
