package daemon

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/egressd/egressd/pkg/control"
	"github.com/egressd/egressd/pkg/loader"
)

// Peers as the control server sees them when the daemon runs as root:
// uid 0 writes, any other uid without the socket's group only reads.
var (
	writerPeer = control.Peer{PID: 4241, UID: 0, GID: 0}
	readerPeer = control.Peer{PID: 4242, UID: 1234, GID: 1234}
)

// serveAs answers a GET of route for peer, through the control server's
// access checks, and returns the status and body.
func (td *testDaemon) serveAs(t *testing.T, peer control.Peer, route string) (int, string) {
	t.Helper()
	srv, err := control.NewServer(control.Config{Routes: td.routes(), Logger: td.log})
	if err != nil {
		t.Fatal(err)
	}
	rec := httptest.NewRecorder()
	req := httptest.NewRequest("GET", control.Prefix+route, nil)
	srv.ServeHTTP(rec, req.WithContext(control.WithPeer(req.Context(), peer)))
	return rec.Code, rec.Body.String()
}

// TestLimitsHideRedisPasswordsFromReaders: a shared rule's Redis
// passwords, the user's and a Sentinel primary's, are hidden from a caller
// who may only read; a writer sees the rule whole, to set it again.
func TestLimitsHideRedisPasswordsFromReaders(t *testing.T) {
	td := newTestDaemon(t)
	td.apply(t, "rules:\n  - {name: s, destination: 10.0.0.1, port: 80, concurrency: 10, shared: {redis: \"redis+sentinel://user:s3cret@127.0.0.1:1/0?master_name=m&password=pr1mary\", key: k, replicas: 1}}\n")
	tests := []struct {
		name, route  string
		peer         control.Peer
		want, hidden string
	}{
		{"reader, every rule", "limits", readerPeer, "user:xxxxx@", "s3cret"},
		{"reader, every rule, the primary's", "limits", readerPeer, "password=xxxxx", "pr1mary"},
		{"reader, one rule", "limit?name=s", readerPeer, "user:xxxxx@", "s3cret"},
		{"reader, one rule, the primary's", "limit?name=s", readerPeer, "password=xxxxx", "pr1mary"},
		{"writer, every rule", "limits", writerPeer, "user:s3cret@", "xxxxx"},
		{"writer, one rule", "limit?name=s", writerPeer, "password=pr1mary", "xxxxx"},
	}
	for _, tt := range tests {
		status, body := td.serveAs(t, tt.peer, tt.route)
		if status != 200 || !strings.Contains(body, tt.want) || strings.Contains(body, tt.hidden) {
			t.Errorf("%s: status %d, body %s; want %q in it and no %q", tt.name, status, body, tt.want, tt.hidden)
		}
	}
}

// streamRecorder is a ResponseWriter whose body may be read while a
// handler streams to it.
type streamRecorder struct {
	header http.Header
	mu     sync.Mutex
	body   strings.Builder
}

func (w *streamRecorder) Header() http.Header { return w.header }
func (w *streamRecorder) WriteHeader(int)     {}
func (w *streamRecorder) Flush()              {}

func (w *streamRecorder) Write(b []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.body.Write(b)
}

func (w *streamRecorder) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.body.String()
}

// TestEventsShowReadersTheirOwn: a caller who may only read is listed and
// followed its own process's refusals only, as attribution tells it of
// its own connections only; a writer sees every process's.
func TestEventsShowReadersTheirOwn(t *testing.T) {
	td := newTestDaemon(t)
	refuse := func(pid int32, rule string) {
		td.events.add(loader.Refusal{Time: time.Now(), PID: uint32(pid), Rule: rule, Dest: netip.MustParseAddrPort("10.0.0.1:80")})
	}
	refuse(readerPeer.PID, "mine")
	refuse(7, "theirs")
	srv, err := control.NewServer(control.Config{Routes: td.routes(), Logger: td.log})
	if err != nil {
		t.Fatal(err)
	}
	follow := func(peer control.Peer) (w *streamRecorder, stop func()) {
		ctx, cancel := context.WithCancel(control.WithPeer(context.Background(), peer))
		req := httptest.NewRequestWithContext(ctx, "GET", control.Prefix+control.RouteEvents+"?follow=true", nil)
		w = &streamRecorder{header: http.Header{}}
		done := make(chan struct{})
		go func() { defer close(done); srv.ServeHTTP(w, req) }()
		return w, func() { cancel(); <-done }
	}
	reader, stopReader := follow(readerPeer)
	defer stopReader()
	writer, stopWriter := follow(writerPeer)
	defer stopWriter()
	td.events.await(t, 2)
	refuse(7, "theirs-later")
	refuse(readerPeer.PID, "mine-later") // after theirs-later: once it is seen, so was that
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(reader.String(), "mine-later") || !strings.Contains(writer.String(), "mine-later") {
		if time.Now().After(deadline) {
			t.Fatalf("refusals not followed:\nreader: %s\nwriter: %s", reader, writer)
		}
		time.Sleep(10 * time.Millisecond)
	}
	tests := []struct {
		name string
		got  string
		want []string
	}{
		{"reader", reader.String(), []string{"mine", "mine-later"}},
		{"writer", writer.String(), []string{"mine", "theirs", "theirs-later", "mine-later"}},
	}
	for _, tt := range tests {
		var rules []string
		for line := range strings.Lines(tt.got) {
			var r control.Refusal
			if err := json.Unmarshal([]byte(line), &r); err != nil {
				t.Fatalf("%s: %q: %v", tt.name, line, err)
			}
			rules = append(rules, r.Rule)
		}
		if !slices.Equal(rules, tt.want) {
			t.Errorf("%s was shown %q, want %q", tt.name, rules, tt.want)
		}
	}
}

// await waits until n clients follow l.
func (l *eventLog) await(t *testing.T, n int) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		l.mu.Lock()
		got := len(l.followers)
		l.mu.Unlock()
		if got == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d clients follow events, want %d", got, n)
		}
	}
}

// TestLimitViewsWhileLimitMoves: the views of a rule (`limit get`, `limit
// ls`) read it while its adaptive loop pushes new limits to the kernel,
// which rewrites the rule's kernel rule under the table's lock. Run with
// -race.
func TestLimitViewsWhileLimitMoves(t *testing.T) {
	td := newTestDaemon(t)
	td.apply(t, adaptivePolicy)
	td.mu.Lock()
	c := td.entries["dep"].ctrl
	td.mu.Unlock()
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		list := httptest.NewRequest("GET", control.Prefix+control.RouteLimits, nil)
		for {
			select {
			case <-stop:
				return
			default:
			}
			if _, err := td.limitView("dep", false); err != nil {
				t.Error(err)
				return
			}
			if _, err := td.handleLimits(list, struct{}{}); err != nil {
				t.Error(err)
				return
			}
		}
	})
	now := time.Now()
	moves := 0
	for i := range 400 {
		// Rounds of fast calls, then of slow ones: the limit rises and falls.
		latency := time.Millisecond
		if i/20%2 == 1 {
			latency = time.Second
		}
		before := c.Limit()
		c.Constrained()
		c.Sample(now.Add(time.Duration(i)*time.Millisecond), latency)
		if c.Limit() != before {
			moves++
		}
	}
	close(stop)
	wg.Wait()
	if moves == 0 {
		t.Fatal("the limit never moved")
	}
}
