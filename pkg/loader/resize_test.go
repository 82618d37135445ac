//go:build linux

package loader

import (
	"errors"
	"io"
	"net"
	"net/netip"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/egressd/egressd/internal/privtest"
)

// Resizing the rule tables under churn loses no count: the connections
// the old programs admitted give their slots back to the new tables, the
// limit holds throughout, a restart asking for another size gets it, and
// a size that would cut off a rule is refused.
func TestResizeCarriesCounts(t *testing.T) {
	privtest.RequireRoot(t)
	cg, pins := privtest.Cgroup(t, "resize"), privtest.PinDir(t)
	d, err := Open(&Config{Cgroup: cg, PinDir: pins, MaxRules: 8})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Uninstall() })
	srv := listen(t, "tcp4", "127.0.0.1:0")
	// The churn's servers close at once: 20,000 held would run out of
	// descriptors.
	closing := func(c net.Conn) { c.Close() }
	other := serve(t, "tcp4", "127.0.0.1:0", closing)
	busy := serve(t, "tcp4", "127.0.0.1:0", closing)
	const limit = 5
	put(t, d, Rule{Name: "conc", Dests: []netip.Prefix{netip.PrefixFrom(srv.Addr(), 32)}, Port: srv.Port(), Limit: limit})
	put(t, d, Rule{Name: "window", Dests: []netip.Prefix{netip.PrefixFrom(other.Addr(), 32)}, Port: other.Port(), Shape: ShapePerWindow, Limit: 1 << 20, Window: time.Minute})
	// Far above what the churn can hold: a connection the test server has
	// not yet accepted is live, and a loaded machine's accept backlog can
	// hold thousands.
	put(t, d, Rule{Name: "busy", Dests: []netip.Prefix{netip.PrefixFrom(busy.Addr(), 32)}, Port: busy.Port(), Limit: 1 << 20})
	privtest.Join(t, cg)
	var held []io.Closer
	for range 3 {
		held = append(held, dial(t, srv))
	}

	// Helpers churn through two rules while the tables move.
	type reply struct {
		line string
		err  error
	}
	done := make(chan reply, 2)
	for _, target := range []netip.AddrPort{other, busy} {
		churn := privtest.Spawn(t, cg, "agent")
		go func() {
			line, err := churn.Send("loop %s 10000", target)
			done <- reply{line, err}
		}()
	}
	for _, n := range []int{64, 16, 4096} {
		if err := d.Resize(n); err != nil {
			t.Fatalf("resize to %d: %v", n, err)
		}
		if d.MaxRules() != n {
			t.Fatalf("MaxRules %d after resizing to %d", d.MaxRules(), n)
		}
		if s := stats(t, d, "conc"); s.Live != 3 {
			t.Fatalf("after resizing to %d: live %d, want the 3 held", n, s.Live)
		}
		t.Logf("resized to %d with %d of the churn's connects made", n, stats(t, d, "busy").Admitted)
	}
	for range 2 {
		if r := <-done; r.err != nil || !strings.HasPrefix(r.line, "ok") {
			// Which rule refused, and what it held, says where to look.
			t.Fatalf("churn: %q, %v; conc %+v; window %+v; busy %+v", r.line, r.err, stats(t, d, "conc"), stats(t, d, "window"), stats(t, d, "busy"))
		}
	}
	held = append(held, dial(t, srv), dial(t, srv))
	dialRefused(t, srv, syscall.EPERM)
	if w := stats(t, d, "window"); w.Admitted != 10000 || w.Live != 0 {
		t.Fatalf("window rule after the churn: %+v, want 10000 admitted and none live", w)
	}
	if b := waitLive(t, d, "busy", 0); b.Admitted != 10000 || b.Released != 10000 {
		t.Fatalf("busy rule after the churn: %+v, want 10000 admitted and released", b)
	}

	// A restart that asks for another size gets it, counts and all.
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	d, err = Open(&Config{Cgroup: cg, PinDir: pins, MaxRules: 32})
	if err != nil {
		t.Fatal(err)
	}
	if n, _ := d.pinnedSize("rules"); d.MaxRules() != 32 || n != 32 {
		t.Fatalf("adopted with MaxRules 32: size %d, pinned %d", d.MaxRules(), n)
	}
	if s := stats(t, d, "conc"); s.Live != limit {
		t.Fatalf("after the restart: live %d, want %d", s.Live, limit)
	}
	for _, c := range held {
		c.Close()
	}
	s := waitLive(t, d, "conc", 0)
	if s.Admitted != s.Released || s.Admitted != limit {
		t.Fatalf("conc: %+v, want %d admitted and released", s, limit)
	}
	checkRecount(t, d, "conc", 0)

	// Slots keep their numbers: a size below a rule's slot is refused.
	put(t, d, Rule{Name: "late", Dests: prefixes("10.9.0.0/16"), Limit: 1})
	if err := d.Resize(2); !errors.Is(err, ErrFull) {
		t.Fatalf("resize below a rule's slot: %v, want ErrFull", err)
	}
}

// A state the copy took before it was started, and which the old programs
// then started, carries on in the new tables: a sliding window and a
// bucket first used between the copy and the swap keep what they counted
// (once, CI saw a window's count wrap and refuse everything: the new
// state, still unstarted, was started afresh by its first use).
func TestResizeStartedAfterCopy(t *testing.T) {
	privtest.RequireRoot(t)
	cg, pins := privtest.Cgroup(t, "resize-start"), privtest.PinDir(t)
	d, err := Open(&Config{Cgroup: cg, PinDir: pins, MaxRules: 8})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Uninstall() })
	closing := func(c net.Conn) { c.Close() }
	window, bucket := serve(t, "tcp4", "127.0.0.1:0", closing), serve(t, "tcp4", "127.0.0.1:0", closing)
	const permits, burst = 5, 20
	put(t, d, Rule{Name: "window", Dests: []netip.Prefix{netip.PrefixFrom(window.Addr(), 32)}, Port: window.Port(), Shape: ShapePerWindow, Limit: permits, Window: time.Hour})
	put(t, d, Rule{Name: "bucket", Dests: []netip.Prefix{netip.PrefixFrom(bucket.Addr(), 32)}, Port: bucket.Port(), Shape: ShapePerSecond, Limit: 1, Burst: burst})
	privtest.Join(t, cg)
	connectN := func(ap netip.AddrPort, n int) (admitted int) {
		for range n {
			c, err := connect(ap)
			if err == nil {
				c.Close()
				admitted++
			} else if !errors.Is(err, syscall.EPERM) {
				t.Errorf("connect %s: %v", ap, err)
			}
		}
		return admitted
	}
	var first time.Time
	d.fault = func(step string) error {
		if step == "copied" {
			first = time.Now()
			if n := connectN(window, 3); n != 3 {
				t.Errorf("between copy and swap: window admitted %d of 3", n)
			}
			if n := connectN(bucket, 10); n != 10 {
				t.Errorf("between copy and swap: bucket admitted %d of 10", n)
			}
		}
		return nil
	}
	if err := d.Resize(64); err != nil {
		t.Fatal(err)
	}
	d.fault = nil
	if first.IsZero() {
		t.Fatal("the resize never reached its copy")
	}
	if n := connectN(window, 2*permits); n != permits-3 {
		t.Errorf("window after the resize admitted %d, want %d: the 3 before it are forgotten", n, permits-3)
	}
	n := 10 + connectN(bucket, 2*burst)
	// The bucket refills one a second.
	if most := burst + int(time.Since(first)/time.Second) + 1; n > most {
		t.Errorf("bucket admitted %d in %v, at most %d: the 10 before the resize are forgotten", n, time.Since(first), most)
	}
}

// A resize cut short while it replaces the pinned maps, as by a crash,
// leaves one whole set pinned, old or new: the next start adopts it, with
// the rule's connections still counted, and removes the other set. A
// resize that could not pin its tables, and goes on, pins them when the
// datapath is closed.
func TestResizeCutShortLeavesWholePins(t *testing.T) {
	privtest.RequireRoot(t)
	srv := listen(t, "tcp4", "127.0.0.1:0")
	crash := func(d *Datapath) error { return d.closeFDs() } // no Close: nothing more runs
	for _, tt := range []struct {
		name, step string
		end        func(*Datapath) error
		maxRules   int
	}{
		{"crash before the exchange", "pinned", crash, 8},
		{"crash after the exchange", "exchanged", crash, 64},
		{"closed after a failed pin", "pinned", (*Datapath).Close, 64},
	} {
		t.Run(tt.name, func(t *testing.T) {
			cg, pins := privtest.Cgroup(t, "resize-cut"), privtest.PinDir(t)
			d, err := Open(&Config{Cgroup: cg, PinDir: pins, MaxRules: 8})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { Uninstall(pins) })
			put(t, d, Rule{Name: "conc", Dests: []netip.Prefix{netip.PrefixFrom(srv.Addr(), 32)}, Port: srv.Port(), Limit: 2})
			privtest.Join(t, cg)
			for range 2 {
				c := dial(t, srv)
				t.Cleanup(func() { c.Close() })
			}
			cut := errors.New("cut short")
			d.fault = func(step string) error {
				if step == tt.step {
					return cut
				}
				return nil
			}
			if err := d.Resize(64); !errors.Is(err, cut) {
				t.Fatalf("resize: %v, want it cut short at %s", err, tt.step)
			}
			d.fault = nil
			if err := tt.end(d); err != nil {
				t.Fatal(err)
			}

			d, err = Open(&Config{Cgroup: cg, PinDir: pins})
			if err != nil {
				t.Fatalf("start after a resize cut short at %s: %v", tt.step, err)
			}
			t.Cleanup(func() { d.Close() })
			if d.MaxRules() != tt.maxRules {
				t.Errorf("adopted %d rule slots, want the whole set of %d", d.MaxRules(), tt.maxRules)
			}
			if s := stats(t, d, "conc"); s.Live != 2 {
				t.Errorf("adopted live %d, want 2", s.Live)
			}
			dialRefused(t, srv, syscall.EPERM)
			if _, err := os.Stat(d.mapsDir() + nextSuffix); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("the other set of pins is still there: %v", err)
			}
		})
	}
}
