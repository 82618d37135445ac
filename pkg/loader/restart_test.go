//go:build linux

package loader

import (
	"errors"
	"io"
	"net/netip"
	"os"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/egressd/egressd/internal/privtest"
)

// TestRestartAdoptsPins kills the process that loaded the datapath and
// checks that enforcement never stopped and that a new loader carries on
// with the same counts.
func TestRestartAdoptsPins(t *testing.T) {
	privtest.RequireRoot(t)
	cg := privtest.Cgroup(t, "restart")
	pins := privtest.PinDir(t)
	srv := listen(t, "tcp4", "127.0.0.1:0")
	const limit = 2

	daemon := privtest.Spawn(t, cg, "datapath", cg, pins, "127.0.0.1/32,::1/128", "2")
	if line := daemon.Line(t); line != "ready" {
		t.Fatalf("datapath helper: %q", line)
	}
	privtest.Join(t, cg)
	var held []io.Closer
	for range limit {
		held = append(held, dial(t, srv))
	}
	daemon.Kill(t)

	// Nobody holds the programs but their pins: still enforced.
	dialRefused(t, srv, syscall.EPERM)

	d, err := Open(&Config{Cgroup: cg, PinDir: pins})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := d.Uninstall(); err != nil {
			t.Errorf("uninstall: %v", err)
		}
	})
	if !d.Adopted() || d.MaxRules() != 64 {
		t.Fatalf("adopted %v with %d rules, want the pinned table of 64", d.Adopted(), d.MaxRules())
	}
	r, err := d.Rule("restart")
	if err != nil || r.Limit != limit || !slices.ContainsFunc(r.Dests, func(p netip.Prefix) bool { return p == netip.MustParsePrefix("127.0.0.1/32") }) || len(r.Dests) != 2 {
		t.Fatalf("adopted rule %+v, %v", r, err)
	}
	s := stats(t, d, "restart")
	if s.Live != limit || s.Admitted != limit || s.Refused != 1 {
		t.Fatalf("adopted counts %+v", s)
	}

	// The adopted datapath changes the limit in place: counts stay.
	r.Limit = limit + 1
	put(t, d, r)
	held = append(held, dial(t, srv))
	dialRefused(t, srv, syscall.EPERM)
	for _, c := range held {
		c.Close()
	}
	s = waitLive(t, d, "restart", 0)
	if s.Admitted != limit+1 || s.Refused != 2 {
		t.Fatalf("counts after the change %+v", s)
	}
	checkRecount(t, d, "restart", 0)

	// A second restart, in process this time, also adopts.
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	d2, err := Open(&Config{Cgroup: cg, PinDir: pins})
	if err != nil {
		t.Fatal(err)
	}
	if got := stats(t, d2, "restart"); got.Admitted != s.Admitted || got.Refused != s.Refused {
		t.Fatalf("second adoption %+v, want %+v", got, s)
	}
	for range limit + 1 {
		held = append(held, dial(t, srv))
	}
	dialRefused(t, srv, syscall.EPERM)

	// Uninstall ends enforcement and leaves nothing pinned.
	if err := d2.Uninstall(); err != nil {
		t.Fatal(err)
	}
	dial(t, srv)
	if _, err := os.Stat(pins); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("pins left after uninstall: %v", err)
	}
}

// A datapath pinned on one cgroup is not silently moved to another.
func TestAdoptRefusesOtherCgroup(t *testing.T) {
	d, _ := open(t)
	other := privtest.Cgroup(t, "other")
	if _, err := Open(&Config{Cgroup: other, PinDir: d.PinDir()}); !errors.Is(err, ErrBusy) {
		t.Fatalf("second open while the first holds the pins: %v, want ErrBusy", err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	_, err := Open(&Config{Cgroup: other, PinDir: d.PinDir()})
	if err == nil || errors.Is(err, ErrBusy) {
		t.Fatalf("adopting a datapath pinned on another cgroup: %v", err)
	}
	t.Logf("refused: %v", err)
}

// TestAdoptKeepsUnevenWindow: a window its segments do not divide evenly
// (a minute in 7) is stored as whole segments; a restart that syncs the
// same policy keeps the window's count rather than starting it again.
func TestAdoptKeepsUnevenWindow(t *testing.T) {
	privtest.RequireRoot(t)
	cg := privtest.Cgroup(t, "window")
	pins := privtest.PinDir(t)
	srv := listen(t, "tcp4", "127.0.0.1:0")
	rule := Rule{Name: "window", Dests: []netip.Prefix{netip.PrefixFrom(srv.Addr(), 32)}, Port: srv.Port(),
		Shape: ShapePerWindow, Limit: 3, Window: time.Minute, Segments: 7}
	d, err := Open(&Config{Cgroup: cg, PinDir: pins, MaxRules: 64})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { Uninstall(pins) })
	put(t, d, rule)
	privtest.Join(t, cg)
	for range rule.Limit {
		dial(t, srv).Close()
	}
	dialRefused(t, srv, syscall.EPERM)
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}

	d, err = Open(&Config{Cgroup: cg, PinDir: pins})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	if err := d.Sync([]Rule{rule}); err != nil {
		t.Fatal(err)
	}
	dialRefused(t, srv, syscall.EPERM)
	if got, err := d.Rule("window"); err != nil || got.Window != time.Minute/7*7 {
		t.Errorf("adopted window %v (%v), want %v: whole segments", got.Window, err, time.Minute/7*7)
	}
}
