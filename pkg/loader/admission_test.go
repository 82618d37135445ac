//go:build linux

package loader

import (
	"errors"
	"io"
	"net/netip"
	"syscall"
	"testing"
	"time"

	"github.com/egressd/egressd/internal/privtest"
)

func TestConcurrencyLimit(t *testing.T) {
	d, cg := open(t)
	srv4 := listen(t, "tcp4", "127.0.0.1:0")
	srv6 := listen(t, "tcp6", "[::1]:0")
	srvDual := listen(t, "tcp", "[::]:0")
	privtest.Join(t, cg)

	tests := []struct {
		name   string
		dest   netip.Prefix
		target netip.AddrPort
	}{
		{"ipv4", netip.MustParsePrefix("127.0.0.1/32"), srv4},
		{"ipv6", netip.MustParsePrefix("::1/128"), srv6},
		// An AF_INET6 socket to a v4-mapped address meets the IPv4 rule.
		{"v4-mapped", netip.MustParsePrefix("127.0.0.2/32"), netip.AddrPortFrom(netip.MustParseAddr("::ffff:127.0.0.2"), srvDual.Port())},
	}
	const limit = 3
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			put(t, d, Rule{Name: tt.name, Dests: []netip.Prefix{tt.dest}, Port: tt.target.Port(), Shape: ShapeConcurrency, Limit: limit})
			var held []io.Closer
			for range limit {
				held = append(held, dial(t, tt.target))
			}
			dialRefused(t, tt.target, syscall.EPERM)
			held[0].Close()
			waitLive(t, d, tt.name, limit-1)
			dial(t, tt.target)
			dialRefused(t, tt.target, syscall.EPERM)
			s := stats(t, d, tt.name)
			if live, err := d.Live(tt.name); err != nil || live != s.Live {
				t.Fatalf("Live %d, %v; Stats says %d", live, err, s.Live)
			}
			if s.Admitted != limit+1 || s.Refused != 2 || s.Live != limit {
				t.Fatalf("stats %+v: want admitted %d refused 2 live %d", s, limit+1, limit)
			}
		})
	}
}

// Most specific wins: a deeper scope over host-wide, a port over any
// port, a longer prefix over a shorter one.
func TestPrecedence(t *testing.T) {
	d, cg := open(t)
	srv := listen(t, "tcp4", "127.0.0.1:0")
	other := listen(t, "tcp4", "0.0.0.0:0")
	child := privtest.SubCgroup(t, cg, "child")
	sibling := privtest.SubCgroup(t, cg, "sibling")
	scope := scopeOf(t, child)

	host := func(name, prefix string, port uint16, limit uint32) Rule {
		return Rule{Name: name, Dests: []netip.Prefix{netip.MustParsePrefix(prefix)}, Port: port, Limit: limit}
	}
	put(t, d, host("wide", "127.0.0.0/8", 0, 1))
	put(t, d, host("narrow", "127.0.0.1/32", 0, 2))
	put(t, d, host("port", "127.0.0.0/8", srv.Port(), 3))
	scoped := host("scoped", "127.0.0.0/8", 0, 4)
	scoped.Scope = scope
	put(t, d, scoped)

	// From the sibling cgroup the scoped rule does not apply.
	privtest.Join(t, sibling)
	tests := []struct {
		target netip.AddrPort
		rule   string
		limit  int
	}{
		{srv, "port", 3}, // port beats a longer prefix
		{netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), other.Port()), "narrow", 2}, // /32 beats /8
		{netip.AddrPortFrom(netip.MustParseAddr("127.0.0.2"), other.Port()), "wide", 1},   // only /8 matches
	}
	for _, tt := range tests {
		fillAndRefuse(t, d, tt.target, tt.rule, tt.limit)
	}

	// From the child cgroup the scoped rule beats every host-wide one.
	privtest.Join(t, child)
	fillAndRefuse(t, d, srv, "scoped", 4)
}

// fillAndRefuse opens limit connections, checks the next is refused and
// that the named rule counted them, then closes them.
func fillAndRefuse(t *testing.T, d *Datapath, target netip.AddrPort, rule string, limit int) {
	t.Helper()
	before := stats(t, d, rule)
	var held []io.Closer
	for range limit {
		c, err := connect(target)
		if err != nil {
			t.Fatalf("%s: dial %d of %d: %v", rule, len(held)+1, limit, err)
		}
		held = append(held, c)
	}
	dialRefused(t, target, syscall.EPERM)
	after := stats(t, d, rule)
	if after.Admitted-before.Admitted != uint64(limit) || after.Refused-before.Refused != 1 {
		t.Fatalf("%s to %s: admitted %d refused %d, want %d and 1", rule, target, after.Admitted-before.Admitted, after.Refused-before.Refused, limit)
	}
	for _, c := range held {
		c.Close()
	}
	waitLive(t, d, rule, 0)
}

// TestConcurrencyUntil: a concurrency rule's limit holds until its Until;
// from then connect() is admitted against LimitAfter, with no write from
// user space: what a share does when the daemon that renews it stops.
// Moved on, the limit holds again; none, it holds for good.
func TestConcurrencyUntil(t *testing.T) {
	d, cg := open(t)
	srv := listen(t, "tcp4", "127.0.0.1:0")
	privtest.Join(t, cg)
	local := []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}
	rule := Rule{Name: "share", Dests: local, Port: srv.Port(), Shape: ShapeConcurrency, Limit: 3, LimitAfter: 1}

	rule.Until = time.Now().Add(time.Hour)
	put(t, d, rule)
	var held []io.Closer
	for range 3 {
		held = append(held, dial(t, srv))
	}
	dialRefused(t, srv, syscall.EPERM)
	held[0].Close()
	held[1].Close()
	waitLive(t, d, "share", 1)
	rule.Until = time.Now().Add(100 * time.Millisecond) // renewed, for a short while
	put(t, d, rule)
	// The kernel's clock must pass Until (a millisecond: the wall clock's tie to it).
	time.Sleep(time.Until(rule.Until.Add(time.Millisecond)))
	dialRefused(t, srv, syscall.EPERM) // past it: 1 live is all there may be
	if got, err := d.Rule("share"); err != nil || got.LimitAfter != 1 || got.Until.Sub(rule.Until).Abs() > time.Millisecond {
		t.Errorf("read back: %+v, %v; want until %v, then 1", got, err, rule.Until)
	}

	rule.Until = time.Now().Add(time.Hour) // renewed
	put(t, d, rule)
	held = append(held[2:], dial(t, srv), dial(t, srv))
	dialRefused(t, srv, syscall.EPERM)

	rule.Until, rule.LimitAfter = time.Time{}, 0
	rule.Limit = 4
	put(t, d, rule)
	held = append(held, dial(t, srv))
	dialRefused(t, srv, syscall.EPERM)
	for _, c := range held {
		c.Close()
	}
	if err := d.Put(Rule{Name: "rate", Dests: local, Port: srv.Port() + 1, Shape: ShapePerSecond, Limit: 5, Until: time.Now()}); !errors.Is(err, ErrInvalidRule) {
		t.Errorf("a per-second rule with an until: %v, want %v", err, ErrInvalidRule)
	}
}
