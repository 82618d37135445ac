package daemon

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/pkg/adaptive"
	"github.com/egressd/egressd/pkg/control"
	"github.com/egressd/egressd/pkg/loader"
)

// TestRefusalAttribution: a refusal the kernel reports explains the EPERM
// of that process's connect() to that destination, and no other; a shadow
// rule's refusal explains nothing (the connection went through); every
// refusal is listed by the events route.
func TestRefusalAttribution(t *testing.T) {
	td := newTestDaemon(t)
	td.start(t)
	pid := uint32(os.Getpid())
	db := netip.MustParseAddrPort("10.0.0.1:5432")
	web := netip.MustParseAddrPort("10.0.0.2:80")
	quic := netip.MustParseAddrPort("10.0.0.3:443")
	td.fake.refuse(loader.Refusal{Time: time.Now().Add(-time.Second), PID: pid, Rule: "db", Dest: db, Shape: loader.ShapePerWindow, RetryAfter: 300 * time.Millisecond})
	td.fake.refuse(loader.Refusal{Time: time.Now(), PID: pid, Rule: "web", Dest: web, Shape: loader.ShapeConcurrency, Shadow: true})
	td.fake.refuse(loader.Refusal{Time: time.Now().Add(-time.Second), PID: pid, Rule: "quic", Dest: quic, Shape: loader.ShapeConcurrency, Protocol: loader.ProtoUDP})
	c := td.client()
	ctx := context.Background()
	var listed []control.Event
	td.fake.refusals.drain(t) // each is listed before the next is read
	if err := c.Events(ctx, false, func(r control.Event) error { listed = append(listed, r); return nil }); err != nil {
		t.Fatal(err)
	}
	if len(listed) != 3 || listed[0].Rule != "db" || listed[1].Rule != "web" || !listed[1].Shadow || listed[2].Protocol != "udp" {
		t.Errorf("events = %+v, want db, web (shadow), quic (udp)", listed)
	}
	tests := []struct {
		name  string
		pid   int
		proto string
		dest  netip.AddrPort
		want  control.Attribution
	}{
		{"its refusal", int(pid), "", db, control.Attribution{Refused: true, Rule: "db", RetryAfterSeconds: 0.3}},
		{"its refusal, of TCP", int(pid), "tcp", db, control.Attribution{Refused: true, Rule: "db", RetryAfterSeconds: 0.3}},
		{"the address as IPv4-mapped", int(pid), "", netip.AddrPortFrom(netip.AddrFrom16(db.Addr().As16()), db.Port()), control.Attribution{Refused: true, Rule: "db", RetryAfterSeconds: 0.3}},
		{"another port", int(pid), "", netip.AddrPortFrom(db.Addr(), 5433), control.Attribution{}},
		{"another process", int(pid) + 1, "", db, control.Attribution{}},
		{"the asking process, as pid 0", 0, "", db, control.Attribution{Refused: true, Rule: "db", RetryAfterSeconds: 0.3}},
		{"a shadow refusal", int(pid), "", web, control.Attribution{}},
		{"a UDP flow's refusal", int(pid), "udp", quic, control.Attribution{Refused: true, Rule: "quic"}},
		{"a TCP connect() where a UDP flow was refused", int(pid), "", quic, control.Attribution{}},
		{"a UDP flow where a TCP connect() was refused", int(pid), "udp", db, control.Attribution{}},
	}
	for _, tt := range tests {
		got, err := c.Attribute(ctx, tt.pid, tt.proto, tt.dest)
		// How long ago it was refused: a second, and the time since.
		if ago := got.SecondsAgo; got.Refused && (ago < 1 || ago > 60) {
			t.Errorf("%s: refused %v s ago, want a second and the time the test took", tt.name, ago)
		}
		got.SecondsAgo = 0
		if err != nil || got != tt.want {
			t.Errorf("%s: attribute = %+v, %v; want %+v", tt.name, got, err, tt.want)
		}
	}
	if _, err := c.Attribute(ctx, int(pid), "sctp", db); !errors.Is(err, control.ErrInvalid) {
		t.Errorf("attribute of proto sctp: %v, want invalid", err)
	}
}

// adaptivePolicy is one adaptive rule "dep" on the reference loop (no
// probes), starting at 4, measuring requests (the default).
const adaptivePolicy = "rules:\n  - {name: dep, destination: 10.0.0.2, port: 80, adaptive: {initial: 4, minimum: 2, probeEvery: 0}}\n"

// TestSaturationWatchedOnceAdaptive: the watcher of a table without
// adaptive rules reads no live counts and waits, but one a reload adds is
// watched: live connections at its limit hold callers back, and a fast
// round grows it. In a bubble, each tick of the watcher comes when the
// test moves the clock.
func TestSaturationWatchedOnceAdaptive(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		td := newTestDaemon(t)
		td.apply(t, "rules:\n  - {name: other, destination: 10.0.0.3, concurrency: 5}\n")
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		go td.table.watchSaturation(ctx)
		clocktest.Advance(4 * saturationTick) // a tick found no adaptive rule; the watcher waits for one
		if n := len(td.fake.lives); n != 0 {
			t.Fatalf("%d live counts read without an adaptive rule, want none", n)
		}
		td.apply(t, adaptivePolicy)
		round := func() uint32 { // one round of fast calls, as many as the limit
			for range td.kernelLimit(t, "dep") {
				td.table.sample(loader.Sample{Rule: "dep", Kind: loader.SampleRequest, Latency: time.Millisecond})
			}
			return td.kernelLimit(t, "dep")
		}
		for range 10 { // enough calls for a baseline; nothing held them back
			round()
		}
		if got := td.kernelLimit(t, "dep"); got != 4 {
			t.Fatalf("after unconstrained fast rounds: kernel limit %d, want 4", got)
		}
		set := td.fake.set("dep", loader.Stats{Live: 4})
		clocktest.Advance(saturationTick)
		if r := <-td.fake.lives; r.rule != "dep" || r.set < set {
			t.Fatalf("the tick after the reload read %+v, want dep's live count after set %d", r, set)
		}
		if got := round(); got != 5 {
			t.Fatalf("after a fast round with live at the limit: kernel limit %d, want 5", got)
		}
	})
}

// sendRound sends one round of request samples of latency to rule dep:
// as many as its limit in the kernel.
func (td *testDaemon) sendRound(t *testing.T, latency time.Duration) uint32 {
	t.Helper()
	limit := td.kernelLimit(t, "dep")
	for range limit {
		td.fake.samples.send(loader.Sample{Rule: "dep", Kind: loader.SampleRequest, Latency: latency})
	}
	return limit
}

// roundLimit sends one round of request samples of latency to rule dep,
// waits until the daemon has read them, and returns dep's kernel limit.
func (td *testDaemon) roundLimit(t *testing.T, latency time.Duration) uint32 {
	t.Helper()
	td.sendRound(t, latency)
	td.fake.samples.drain(t)
	return td.kernelLimit(t, "dep")
}

// TestAdaptiveFollowsSamples: an adaptive rule's loop learns from the
// kernel's samples of the kind its rule measures, grows only when the
// limit held callers back (a refusal, or live connections at the limit),
// falls when latency climbs, and every change reaches the kernel.
func TestAdaptiveFollowsSamples(t *testing.T) {
	td := newTestDaemon(t)
	writeFile(t, td.cfg.PolicyFile, adaptivePolicy)
	td.start(t)
	if r, _ := td.fake.rule("dep"); !r.Requests || r.Limit != 4 {
		t.Fatalf("kernel rule %+v: want request tracking (the default samples) at the initial 4", r)
	}
	// Fast rounds that nothing held back: the limit stays, and the
	// window holds enough calls for a baseline.
	for range 10 {
		td.sendRound(t, time.Millisecond)
	}
	// Connect samples are not what the rule measures: ignored.
	for range 20 {
		td.fake.samples.send(loader.Sample{Rule: "dep", Kind: loader.SampleConnect, Latency: time.Second})
	}
	if got := td.roundLimit(t, time.Millisecond); got != 4 {
		t.Fatalf("after unconstrained fast rounds: kernel limit %d, want 4", got)
	}
	// A refusal: the round is constrained and fast, so the limit grows.
	td.fake.refusals.send(loader.Refusal{Time: time.Now(), PID: 1, Rule: "dep", Dest: netip.MustParseAddrPort("10.0.0.2:80")})
	td.fake.refusals.drain(t)
	if got := td.roundLimit(t, time.Millisecond); got != 5 {
		t.Fatalf("after a constrained fast round: kernel limit %d, want 5", got)
	}
	// Live connections at the limit hold callers back too.
	td.fake.awaitLive(t, "dep", td.fake.set("dep", loader.Stats{Live: 5}))
	if got := td.roundLimit(t, time.Millisecond); got != 6 {
		t.Fatalf("after a fast round with live at the limit: kernel limit %d, want 6", got)
	}
	// Latency far above the baseline: the limit falls.
	td.fake.set("dep", loader.Stats{})
	before := td.kernelLimit(t, "dep")
	if got := td.roundLimit(t, time.Second); got >= before {
		t.Errorf("after a slow round: kernel limit %d, want below %d", got, before)
	}
}

// lowerLimit drives c, a loop of adaptivePolicy's rule, straight through
// Sample: fast calls for a baseline, then slow ones, which lower its
// limit below its initial 4.
func lowerLimit(t *testing.T, c *adaptive.Controller) {
	t.Helper()
	now := time.Now()
	for i := range 60 {
		latency := time.Millisecond
		if i >= 40 {
			latency = time.Second
		}
		c.Sample(now.Add(time.Duration(i)*time.Millisecond), latency)
	}
	if c.Limit() >= 4 {
		t.Fatalf("after slow calls the loop's limit is %d, want below 4", c.Limit())
	}
}

// TestReplacedAdaptiveLoopLeavesTheRule: a sample handed to an adaptive
// rule's loop as a reload replaces the rule (followSamples reads the
// table, then feeds the loop without its lock) moves the old loop only,
// not the rule that now has the name.
func TestReplacedAdaptiveLoopLeavesTheRule(t *testing.T) {
	tests := []struct {
		name, replacement, want string
	}{
		{"a fixed limit", "{name: dep, destination: 10.0.0.2, port: 80, concurrency: 50}", "10.0.0.2/32 concurrency 50 (policy)"},
		{"another adaptive loop", "{name: dep, destination: 10.0.0.2, port: 80, adaptive: {initial: 9, probeEvery: 0}}", "10.0.0.2/32 concurrency 9 (policy)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			td := newTestDaemon(t)
			td.apply(t, adaptivePolicy)
			td.table.mu.Lock()
			old := td.table.entries["dep"].ctrl
			td.table.mu.Unlock()
			td.apply(t, "rules:\n  - "+tt.replacement+"\n")
			lowerLimit(t, old)
			if got := td.state()["dep"]; got != tt.want {
				t.Errorf("dep is %q, want %q", got, tt.want)
			}
		})
	}
}

// followRaw opens `events --follow` on a connection of its own, reads the
// response's header and returns the connection and response. The test
// ends with the connection closed.
func followRaw(t *testing.T, socket string) (net.Conn, *http.Response) {
	t.Helper()
	c, err := net.Dial("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if _, err := c.Write([]byte("GET /v1/events?follow=true HTTP/1.1\r\nHost: egressd\r\n\r\n")); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatal(err)
	}
	return c, resp
}

// followers counts the events handlers running.
func followers() int {
	return strings.Count(daemonGoroutines(), "handleEvents")
}

// awaitFollowers waits until n events handlers run.
func awaitFollowers(t *testing.T, n int) {
	t.Helper()
	clocktest.Eventually(t, fmt.Sprint(n, " events handlers running"), func() bool { return followers() == n })
}

// TestEventsFollowerThatLeftEnds: a follower that sends a byte after its
// request and closes leaves net/http unaware (it takes the byte for the
// next request), and with no refusal to send, only a keepalive's failed
// write ends its handler and frees its connection.
func TestEventsFollowerThatLeftEnds(t *testing.T) {
	td := newTestDaemon(t)
	td.cfg.keepalive = 20 * time.Millisecond
	td.start(t)
	c, resp := followRaw(t, td.cfg.Socket)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("follow: status %d", resp.StatusCode)
	}
	awaitFollowers(t, 1)
	if _, err := c.Write([]byte("G")); err != nil {
		t.Fatal(err)
	}
	c.Close()
	awaitFollowers(t, 0)
}

// TestEventsFollowersBounded: past maxFollowers, a follower is refused
// with a reason, and one that stops makes room for another.
func TestEventsFollowersBounded(t *testing.T) {
	td := newTestDaemon(t)
	td.start(t)
	conns := make([]net.Conn, maxFollowers)
	for i := range conns {
		c, resp := followRaw(t, td.cfg.Socket)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("follower %d: status %d", i+1, resp.StatusCode)
		}
		conns[i] = c
	}
	_, resp := followRaw(t, td.cfg.Socket)
	if resp.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("follower %d: status %d, want %d", maxFollowers+1, resp.StatusCode, http.StatusServiceUnavailable)
	}
	var refused struct {
		Error string
		Code  control.Code
	}
	if err := json.NewDecoder(resp.Body).Decode(&refused); err != nil || refused.Code != control.CodeUnavailable || !strings.Contains(refused.Error, "clients follow events already") {
		t.Errorf("follower %d refused with %+v (%v), want code unavailable saying why", maxFollowers+1, refused, err)
	}
	conns[0].Close()
	awaitFollowers(t, maxFollowers-1)
	if _, resp := followRaw(t, td.cfg.Socket); resp.StatusCode != http.StatusOK {
		t.Errorf("follower after one stopped: status %d", resp.StatusCode)
	}
}
