//go:build linux

package loader

import (
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/egressd/egressd/internal/privtest"
	"github.com/egressd/egressd/pkg/cgroups"
)

func TestShadowRefusesNothing(t *testing.T) {
	d, cg := open(t)
	srv := listen(t, "tcp4", "127.0.0.1:0")
	privtest.Join(t, cg)
	put(t, d, Rule{Name: "shadow", Dest: netip.PrefixFrom(srv.Addr(), 32), Limit: 1, Shadow: true})
	events, err := d.Refusals()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { events.Close() })
	for range 3 {
		dial(t, srv)
	}
	s := stats(t, d, "shadow")
	if s.Admitted != 3 || s.Refused != 0 || s.ShadowRefused != 2 || s.Live != 3 {
		t.Fatalf("shadow stats %+v", s)
	}
	events.SetDeadline(time.Now().Add(time.Second))
	e, err := events.Read()
	if err != nil || !e.Shadow || e.Rule != "shadow" {
		t.Fatalf("shadow refusal event %+v, %v", e, err)
	}
}

func TestRefusalErrnoAndEvent(t *testing.T) {
	d, cg := open(t)
	srv := listen(t, "tcp4", "127.0.0.1:0")
	cgID, err := cgroups.ID(cg)
	if err != nil {
		t.Fatal(err)
	}
	privtest.Join(t, cg)
	put(t, d, Rule{Name: "busy", Dest: netip.PrefixFrom(srv.Addr(), 32), Port: srv.Port(), Limit: 1, Errno: syscall.EAGAIN})
	events, err := d.Refusals()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { events.Close() })

	dial(t, srv)
	before := time.Now()
	dialRefused(t, srv, syscall.EAGAIN)
	events.SetDeadline(time.Now().Add(time.Second))
	e, err := events.Read()
	if err != nil {
		t.Fatal(err)
	}
	want := Refusal{Time: e.Time, PID: uint32(os.Getpid()), Cgroup: cgID, Rule: "busy", Dest: srv, Shape: ShapeConcurrency}
	if e != want {
		t.Fatalf("event %+v, want %+v", e, want)
	}
	if e.Time.Before(before.Add(-10*time.Millisecond)) || e.Time.After(time.Now().Add(10*time.Millisecond)) {
		t.Fatalf("event time %v, refused at %v", e.Time, before)
	}
}

// A rule deleted while its connections live on, and a new rule in its
// slot: the old connections' closes never touch the new rule's counts.
func TestSlotReuseKeepsCountsApart(t *testing.T) {
	privtest.RequireRoot(t)
	cg := privtest.Cgroup(t, "reuse")
	d, err := Open(&Config{Cgroup: cg, PinDir: privtest.PinDir(t), MaxRules: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Uninstall() })
	srv := listen(t, "tcp4", "127.0.0.1:0")
	privtest.Join(t, cg)

	put(t, d, Rule{Name: "old", Dest: netip.PrefixFrom(srv.Addr(), 32), Limit: 5})
	var held []io.Closer
	for range 3 {
		held = append(held, dial(t, srv))
	}
	if err := d.Put(Rule{Name: "extra", Dest: netip.MustParsePrefix("10.0.0.0/8"), Limit: 1}); !errors.Is(err, ErrFull) {
		t.Fatalf("put into a full table: %v, want ErrFull", err)
	}
	if err := d.Delete("old"); err != nil {
		t.Fatal(err)
	}
	if err := d.Delete("old"); !errors.Is(err, ErrUnknownRule) {
		t.Fatalf("second delete: %v", err)
	}
	put(t, d, Rule{Name: "new", Dest: netip.PrefixFrom(srv.Addr(), 32), Limit: 1})
	dial(t, srv)
	for _, c := range held {
		c.Close()
	}
	time.Sleep(50 * time.Millisecond)
	s := stats(t, d, "new")
	if s.Live != 1 || s.Released != 0 {
		t.Fatalf("new rule counted the old rule's closes: %+v", s)
	}
	dialRefused(t, srv, syscall.EPERM)
	checkRecount(t, d, "new", 1)
}

func TestRuleChanges(t *testing.T) {
	d, cg := open(t)
	srv := listen(t, "tcp4", "127.0.0.1:0")
	privtest.Join(t, cg)
	r := Rule{Name: "r", Dest: netip.PrefixFrom(srv.Addr(), 32), Limit: 2}
	put(t, d, r)
	dial(t, srv)

	// Same traffic, new limit and even a new shape: counts carry on.
	r.Shape, r.Limit = ShapePerSecond, 1
	put(t, d, r)
	if s := stats(t, d, "r"); s.Live != 1 || s.Admitted != 1 {
		t.Fatalf("after a shape change %+v", s)
	}
	dial(t, srv)
	dialRefused(t, srv, syscall.EPERM)

	// Moved to other traffic: a new rule, counted from zero.
	r.Dest = netip.MustParsePrefix("127.0.0.2/32")
	put(t, d, r)
	if s := stats(t, d, "r"); s.Admitted != 0 || s.Live != 0 {
		t.Fatalf("after a move %+v", s)
	}
	dial(t, srv) // no longer limited

	// Two rules may not match the same traffic.
	err := d.Put(Rule{Name: "twin", Dest: netip.MustParsePrefix("::ffff:127.0.0.2/128"), Limit: 1})
	if !errors.Is(err, ErrConflict) {
		t.Fatalf("twin: %v, want ErrConflict", err)
	}
	// Nothing of a bad batch is applied.
	err = d.PutMany([]Rule{{Name: "fine", Dest: netip.MustParsePrefix("10.0.0.0/8"), Limit: 1}, {Name: "bad"}})
	if !errors.Is(err, ErrInvalidRule) {
		t.Fatalf("bad batch: %v", err)
	}
	if _, err := d.Rule("fine"); !errors.Is(err, ErrUnknownRule) {
		t.Fatalf("half of a bad batch applied: %v", err)
	}
}

// The per-packet programs are attached only while some rule tracks
// requests.
func TestRequestProgramsFollowRules(t *testing.T) {
	d, _ := open(t)
	attached := func() bool {
		st, err := d.ProgramStats()
		if err != nil {
			t.Fatal(err)
		}
		_, ok := st["egress"]
		return ok
	}
	put(t, d, Rule{Name: "plain", Dest: netip.MustParsePrefix("10.0.0.0/8"), Limit: 1})
	if attached() {
		t.Fatal("request programs attached without a rule tracking requests")
	}
	put(t, d, Rule{Name: "tracked", Dest: netip.MustParsePrefix("10.1.0.0/16"), Limit: 1, Requests: true})
	if !attached() {
		t.Fatal("request programs not attached")
	}
	if err := d.Delete("tracked"); err != nil {
		t.Fatal(err)
	}
	if attached() {
		t.Fatal("request programs still attached")
	}
}

func TestPutManyLoadsAFullTable(t *testing.T) {
	privtest.RequireRoot(t)
	d, err := Open(&Config{Cgroup: privtest.Cgroup(t, "batch"), PinDir: privtest.PinDir(t), MaxRules: 10_000})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Uninstall() })
	rules := manyRules(10_000)
	if err := d.PutMany(rules); err != nil {
		t.Fatal(err)
	}
	if got := len(d.Rules()); got != len(rules) {
		t.Fatalf("%d rules loaded, want %d", got, len(rules))
	}
}

// manyRules makes n distinct host-wide /32 rules on varied ports.
func manyRules(n int) []Rule {
	rules := make([]Rule, n)
	for i := range rules {
		addr := netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)})
		rules[i] = Rule{Name: fmt.Sprintf("r%d", i), Dest: netip.PrefixFrom(addr, 32), Port: uint16(1 + i%1000), Limit: 100}
	}
	return rules
}
