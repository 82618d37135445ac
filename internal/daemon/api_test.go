package daemon

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/internal/controlserver"
	"github.com/egressd/egressd/pkg/control"
	"github.com/egressd/egressd/pkg/loader"
)

// Peers as the control server sees them when the daemon runs as root:
// uid 0 writes, any other uid without the socket's group only reads.
var (
	writerPeer = controlserver.Peer{PID: 4241, UID: 0, GID: 0}
	readerPeer = controlserver.Peer{PID: 4242, UID: 1234, GID: 1234}
)

// server is a control server of td's routes, to call through ServeHTTP.
func (td *testDaemon) server(t *testing.T) *controlserver.Server {
	t.Helper()
	srv, err := controlserver.New(controlserver.Config{Routes: td.api.routes(), Logger: td.log})
	if err != nil {
		t.Fatal(err)
	}
	return srv
}

// serveAs answers a GET of route for peer, through the control server's
// access checks, and returns the status and body.
func (td *testDaemon) serveAs(t *testing.T, peer controlserver.Peer, route string) (int, string) {
	t.Helper()
	srv := td.server(t)
	rec := httptest.NewRecorder()
	req := httptest.NewRequest("GET", control.Prefix+route, nil)
	srv.ServeHTTP(rec, req.WithContext(controlserver.WithPeer(req.Context(), peer)))
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
		peer         controlserver.Peer
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
// handler streams to it; status, if not nil, is sent the status.
type streamRecorder struct {
	header http.Header
	status chan int
	mu     sync.Mutex
	body   strings.Builder
}

func (w *streamRecorder) Header() http.Header { return w.header }
func (w *streamRecorder) Flush()              {}

func (w *streamRecorder) WriteHeader(code int) {
	if w.status != nil {
		w.status <- code
	}
}

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
		td.events.add(event{Refusal: loader.Refusal{Time: time.Now(), PID: uint32(pid), Rule: rule, Dest: netip.MustParseAddrPort("10.0.0.1:80")}})
	}
	refuse(readerPeer.PID, "mine")
	refuse(7, "theirs")
	srv := td.server(t)
	follow := func(peer controlserver.Peer) (w *streamRecorder, stop func()) {
		ctx, cancel := context.WithCancel(controlserver.WithPeer(context.Background(), peer))
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
	clocktest.Eventually(t, "the reader and the writer to follow mine-later", func() bool {
		return strings.Contains(reader.String(), "mine-later") && strings.Contains(writer.String(), "mine-later")
	})
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
			var r control.Event
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

// followAs asks srv to follow events for peer and returns the status it
// was answered with. A stream it was given ends with the test.
func followAs(t *testing.T, srv *controlserver.Server, peer controlserver.Peer) int {
	t.Helper()
	ctx, cancel := context.WithCancel(controlserver.WithPeer(context.Background(), peer))
	req := httptest.NewRequestWithContext(ctx, "GET", control.Prefix+control.RouteEvents+"?follow=true", nil)
	w := &streamRecorder{header: http.Header{}, status: make(chan int, 1)}
	done := make(chan struct{})
	go func() { defer close(done); srv.ServeHTTP(w, req) }()
	t.Cleanup(func() { cancel(); <-done })
	return <-w.status
}

// TestEventsFollowSlotsKeptForWriters: peers that may only read (the
// socket widened to 0666 for services' SDKs) cannot take every follow
// slot, however many they are and under whichever uids: root's `events
// --follow` still streams.
func TestEventsFollowSlotsKeptForWriters(t *testing.T) {
	tests := []struct {
		name string
		uid  func(i int) uint32
	}{
		{"one uid", func(int) uint32 { return readerPeer.UID }},
		{"a uid each", func(i int) uint32 { return readerPeer.UID + uint32(i) }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			td := newTestDaemon(t)
			srv := td.server(t)
			for i := range maxFollowers {
				p := readerPeer
				p.UID, p.GID = tt.uid(i), tt.uid(i)
				followAs(t, srv, p)
			}
			if code := followAs(t, srv, writerPeer); code != http.StatusOK {
				t.Errorf("root follows events after %d readers tried: status %d", maxFollowers, code)
			}
		})
	}
}

// TestAdmitFollower: who may follow events beside those who do; a refusal
// says which bound was reached.
func TestAdmitFollower(t *testing.T) {
	writer := follower{}
	reader := follower{reader: true, uid: 1234}
	other := follower{reader: true, uid: 1235}
	tests := []struct {
		name      string
		following []follower
		who       follower
		want      string // the refusal; "" for admitted
	}{
		{"writer, readers in every readers' place", slices.Repeat([]follower{other}, readerFollowers), writer, ""},
		{"writer, every place taken", slices.Repeat([]follower{writer}, maxFollowers), writer, "64 clients follow events already, the most egressd serves; try again when one stops"},
		{"reader, its uid below its bound", slices.Repeat([]follower{reader}, uidFollowers-1), reader, ""},
		{"reader, its uid at its bound", slices.Repeat([]follower{reader}, uidFollowers), reader, "uid 1234 follows events 8 times already, the most egressd serves one uid without write access; try again when one stops"},
		{"reader, another uid at its bound", slices.Repeat([]follower{other}, uidFollowers), reader, ""},
		{"reader, readers in every readers' place", slices.Repeat([]follower{other}, readerFollowers), reader, "48 clients without write access follow events already, the most egressd serves them (the other 16 places are kept for writers); try again when one stops"},
		{"reader, writers in the readers' places", slices.Repeat([]follower{writer}, readerFollowers), reader, ""},
		{"reader, writers in every place", slices.Repeat([]follower{writer}, maxFollowers), reader, "64 clients follow events already, the most egressd serves; try again when one stops"},
	}
	for _, tt := range tests {
		if got := fmt.Sprint(admitFollower(tt.following, tt.who)); got != cmp.Or(tt.want, "<nil>") {
			t.Errorf("%s: %s, want %s", tt.name, got, cmp.Or(tt.want, "admitted"))
		}
	}
}

// await waits until n clients follow l.
func (l *eventLog) await(t *testing.T, n int) {
	t.Helper()
	clocktest.Eventually(t, fmt.Sprint(n, " clients following events"), func() bool {
		l.mu.Lock()
		defer l.mu.Unlock()
		return len(l.followers) == n
	})
}

// TestLimitViewsWhileLimitMoves: the views of a rule (`limit get`, `limit
// ls`) read it while its adaptive loop pushes new limits to the kernel,
// which rewrites the rule's kernel rule under the table's lock. Run with
// -race.
func TestLimitViewsWhileLimitMoves(t *testing.T) {
	td := newTestDaemon(t)
	td.apply(t, adaptivePolicy)
	td.table.mu.Lock()
	c := td.table.entries["dep"].ctrl
	td.table.mu.Unlock()
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
			}
			if _, err := td.api.limitView("dep", false); err != nil {
				t.Error(err)
				return
			}
			if err := td.listEach(control.LimitsQuery{}, func(control.Limit) {}); err != nil {
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

// TestEventsShowPolicyShape: a refusal shows its rule's shape as the
// policy gives it, not the kernel's (an adaptive rule's is
// "concurrency", a shared rate's "granted").
func TestEventsShowPolicyShape(t *testing.T) {
	td := newTestDaemon(t)
	td.apply(t, "rules:\n  - {name: ad, destination: 10.0.0.1, adaptive: {}}\n")
	td.events.add(event{Refusal: loader.Refusal{Time: time.Now(), PID: 7, Rule: "ad", Dest: netip.MustParseAddrPort("10.0.0.1:80"), Shape: loader.ShapeConcurrency, Shadow: true}})
	td.events.add(event{Refusal: loader.Refusal{Time: time.Now(), PID: 7, Rule: "gone", Dest: netip.MustParseAddrPort("10.0.0.2:80"), Shape: loader.ShapePerWindow}})
	ctx := controlserver.WithPeer(context.Background(), writerPeer)
	req := httptest.NewRequestWithContext(ctx, "GET", control.Prefix+control.RouteEvents, nil)
	w := &streamRecorder{header: http.Header{}}
	td.server(t).ServeHTTP(w, req)
	var shapes []string
	for line := range strings.Lines(w.String()) {
		var r control.Event
		if err := json.Unmarshal([]byte(line), &r); err != nil {
			t.Fatalf("%q: %v", line, err)
		}
		shapes = append(shapes, r.Rule+" "+r.Shape)
	}
	// A rule no longer in the table keeps the kernel's shape.
	if want := []string{"ad adaptive", "gone per_window"}; !slices.Equal(shapes, want) {
		t.Errorf("events show %q, want %q", shapes, want)
	}
}
