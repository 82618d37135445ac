//go:build linux

package loader

import (
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"reflect"
	"runtime"
	"slices"
	"strings"
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
	put(t, d, Rule{Name: "shadow", Dests: []netip.Prefix{netip.PrefixFrom(srv.Addr(), 32)}, Limit: 1, Shadow: true})
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
	put(t, d, Rule{Name: "busy", Dests: []netip.Prefix{netip.PrefixFrom(srv.Addr(), 32)}, Port: srv.Port(), Limit: 1, Errno: syscall.EAGAIN})
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
	want := Refusal{Time: e.Time, PID: uint32(os.Getpid()), Cgroup: cgID, Rule: "busy", Dest: srv, Shape: ShapeConcurrency, Protocol: ProtoTCP, Count: 1}
	if e != want {
		t.Fatalf("event %+v, want %+v", e, want)
	}
	if e.Time.Before(before.Add(-10*time.Millisecond)) || e.Time.After(time.Now().Add(10*time.Millisecond)) {
		t.Fatalf("event time %v, refused at %v", e.Time, before)
	}

	// The kernel notes the latest refusal of each process and destination
	// before connect() returns, for the SDK's question.
	last, ok, err := d.LastRefusal(uint32(os.Getpid()), ProtoTCP, srv)
	if err != nil || !ok || last.Rule != "busy" || last.Time.Before(before.Add(-10*time.Millisecond)) || last.Shadow {
		t.Fatalf("LastRefusal = %+v, %v, %v; want the refusal by busy", last, ok, err)
	}
	if _, ok, err := d.LastRefusal(uint32(os.Getpid()), ProtoTCP, netip.AddrPortFrom(srv.Addr(), srv.Port()+1)); ok || err != nil {
		t.Fatalf("LastRefusal of another destination: %v, %v", ok, err)
	}
}

// A refusal's time, read back, is never before the connect() it refused
// began: the SDK takes a refusal that seems older than its attempt for
// another's. Two busy processes beside it make the scheduler preempt the
// test's threads, which is when a conversion that read the two clocks
// each time was off by milliseconds (13 and 26 of 50,000 before).
func TestRefusalTimeNotBeforeConnect(t *testing.T) {
	d, cg := open(t)
	srv := listen(t, "tcp4", "127.0.0.1:0")
	privtest.Join(t, cg)
	put(t, d, Rule{Name: "none", Dests: []netip.Prefix{netip.PrefixFrom(srv.Addr(), 32)}, Port: srv.Port(), Limit: 0})
	for range 2 {
		hog := exec.Command("sh", "-c", "while :; do :; done")
		if err := hog.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { hog.Process.Kill(); hog.Wait() })
	}
	early, worst := 0, time.Duration(0)
	const n = 20000
	for range n {
		start := time.Now()
		dialRefused(t, srv, syscall.EPERM)
		r, ok, err := d.LastRefusal(uint32(os.Getpid()), ProtoTCP, srv)
		if err != nil || !ok {
			t.Fatalf("LastRefusal = %v, %v", ok, err)
		}
		if r.Time.Before(start) {
			early, worst = early+1, max(worst, start.Sub(r.Time))
		}
	}
	if early > 0 {
		t.Errorf("%d of %d refusals read back as before their connect() began, by up to %v", early, n, worst)
	}
}

// Refusals of one process to one destination send an event per interval
// that counts them; none is lost from the counts.
func TestRefusalEventsCount(t *testing.T) {
	privtest.RequireRoot(t)
	cg := privtest.Cgroup(t, "events")
	const interval = 200 * time.Millisecond
	d, err := Open(&Config{Cgroup: cg, PinDir: privtest.PinDir(t), MaxRules: 4, EventInterval: interval})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Uninstall() })
	srv := listen(t, "tcp4", "127.0.0.1:0")
	privtest.Join(t, cg)
	put(t, d, Rule{Name: "none", Dests: []netip.Prefix{netip.PrefixFrom(srv.Addr(), 32)}, Limit: 0})
	events, err := d.Refusals()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { events.Close() })

	// The first refusal's event goes at once; the burst after it, in one
	// event for all of it once an interval has passed since the first.
	events.SetDeadline(time.Now().Add(10 * time.Second))
	read := func() Refusal {
		t.Helper()
		e, err := events.Read()
		if err != nil {
			t.Fatal(err)
		}
		if e.Dest != srv {
			t.Fatalf("event %+v: destination %v, want %v (the rule is for any port)", e, e.Dest, srv)
		}
		return e
	}
	start := time.Now()
	dialRefused(t, srv, syscall.EPERM)
	if e := read(); e.Count != 1 {
		t.Fatalf("the first refusal's event counts %d, want 1", e.Count)
	}
	const burst = 49
	for range burst {
		dialRefused(t, srv, syscall.EPERM)
	}
	var got uint64
	var n int
	for got < burst {
		got += read().Count
		n++
	}
	if took := time.Since(start); took < interval {
		t.Errorf("the burst's events came %v after the first refusal, within the %v interval", took, interval)
	}
	if s := stats(t, d, "none"); got != burst || s.Refused != burst+1 {
		t.Fatalf("events after the first count %d refusals, the rule %d in all; want %d and %d", got, s.Refused, burst, burst+1)
	}
	t.Logf("%d refusals in %d events after the first", got, n)
	if n >= burst {
		t.Fatalf("%d events for %d refusals: not aggregated", n, got)
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
	fins := make(chan struct{}, 4) // a client's close, as the server read it
	srv := serve(t, "tcp4", "127.0.0.1:0", func(c net.Conn) {
		io.Copy(io.Discard, c)
		fins <- struct{}{}
	})
	privtest.Join(t, cg)

	put(t, d, Rule{Name: "old", Dests: []netip.Prefix{netip.PrefixFrom(srv.Addr(), 32)}, Limit: 5})
	var held []io.Closer
	for range 3 {
		held = append(held, dial(t, srv))
	}
	if err := d.Put(Rule{Name: "extra", Dests: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}, Limit: 1}); !errors.Is(err, ErrFull) {
		t.Fatalf("put into a full table: %v, want ErrFull", err)
	}
	if err := d.Delete("old"); err != nil {
		t.Fatal(err)
	}
	if err := d.Delete("old"); !errors.Is(err, ErrUnknownRule) {
		t.Fatalf("second delete: %v", err)
	}
	// One closes while the new rule is written, just after its slot's
	// counts are zeroed: by then the slot must be the new rule's.
	d.fault = func(step string) error {
		if step == "reset rule states" {
			held[0].Close()
		}
		return nil
	}
	put(t, d, Rule{Name: "new", Dests: []netip.Prefix{netip.PrefixFrom(srv.Addr(), 32)}, Limit: 1})
	d.fault = nil
	dial(t, srv)
	for _, c := range held[1:] {
		c.Close()
	}
	// A client's FIN reaches the server after every program its close
	// runs has run.
	for range held {
		select {
		case <-fins:
		case <-time.After(10 * time.Second):
			t.Fatal("the server saw no close of an old connection in 10s")
		}
	}
	s := stats(t, d, "new")
	if s.Live != 1 || s.Released != 0 {
		t.Fatalf("new rule counted the old rule's closes: %+v", s)
	}
	dialRefused(t, srv, syscall.EPERM)
	checkRecount(t, d, "new", 1)
}

func TestRuleChanges(t *testing.T) {
	d, cg := open(t)
	srv := listen(t, "tcp4", "0.0.0.0:0")
	privtest.Join(t, cg)
	at := func(addr string) netip.AddrPort { return netip.AddrPortFrom(netip.MustParseAddr(addr), srv.Port()) }
	r := Rule{Name: "r", Dests: []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}, Limit: 2}
	put(t, d, r)
	dial(t, at("127.0.0.1"))

	// New limit and even a new shape: counts carry on.
	r.Shape, r.Limit = ShapePerSecond, 1
	put(t, d, r)
	if s := stats(t, d, "r"); s.Live != 1 || s.Admitted != 1 {
		t.Fatalf("after a shape change %+v", s)
	}
	dial(t, at("127.0.0.1"))
	dialRefused(t, at("127.0.0.1"), syscall.EPERM)

	// New destinations, as when a host name resolves anew: the rule keeps
	// its counts, the old address is free, and the new ones share one
	// budget.
	r.Shape, r.Limit = ShapeConcurrency, 3
	r.Dests = []netip.Prefix{netip.MustParsePrefix("127.0.0.2/32"), netip.MustParsePrefix("127.0.0.3/32")}
	put(t, d, r)
	if s := stats(t, d, "r"); s.Live != 2 || s.Admitted != 2 {
		t.Fatalf("after new destinations %+v", s)
	}
	dial(t, at("127.0.0.1"))
	dial(t, at("127.0.0.2"))
	dialRefused(t, at("127.0.0.3"), syscall.EPERM)
	got, err := d.Rule("r")
	if err != nil || len(got.Dests) != 2 {
		t.Fatalf("rule %+v, %v", got, err)
	}

	// Two rules may not match the same traffic, however it is spelt.
	err = d.Put(Rule{Name: "twin", Dests: []netip.Prefix{netip.MustParsePrefix("::ffff:127.0.0.3/128")}, Limit: 1})
	if !errors.Is(err, ErrConflict) {
		t.Fatalf("twin: %v, want ErrConflict", err)
	}
	// Nothing of a bad batch is applied.
	err = d.PutMany([]Rule{{Name: "fine", Dests: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}, Limit: 1}, {Name: "bad"}})
	if !errors.Is(err, ErrInvalidRule) {
		t.Fatalf("bad batch: %v", err)
	}
	if _, err := d.Rule("fine"); !errors.Is(err, ErrUnknownRule) {
		t.Fatalf("half of a bad batch applied: %v", err)
	}
	// A destination can move from one rule to another in one batch.
	err = d.PutMany([]Rule{
		{Name: "r", Dests: []netip.Prefix{netip.MustParsePrefix("127.0.0.2/32")}, Limit: 3},
		{Name: "taker", Dests: []netip.Prefix{netip.MustParsePrefix("127.0.0.3/32")}, Limit: 1},
	})
	if err != nil {
		t.Fatal(err)
	}
	dial(t, at("127.0.0.3"))
	dialRefused(t, at("127.0.0.3"), syscall.EPERM)
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
	put(t, d, Rule{Name: "plain", Dests: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}, Limit: 1})
	if attached() {
		t.Fatal("request programs attached without a rule tracking requests")
	}
	put(t, d, Rule{Name: "tracked", Dests: []netip.Prefix{netip.MustParsePrefix("10.1.0.0/16")}, Limit: 1, Requests: true})
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

// TestPutManyLoadsAFullTable fills a table in one batch, large enough to
// be written in parts over four CPUs whatever this machine has, half the
// keys exact and half prefixes: the kernel must then hold what the loader
// says.
func TestPutManyLoadsAFullTable(t *testing.T) {
	privtest.RequireRoot(t)
	const n = 4 * batchPart
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(4))
	d, err := Open(&Config{Cgroup: privtest.Cgroup(t, "batch"), PinDir: privtest.PinDir(t), MaxRules: n})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Uninstall() })
	rules := manyRules(n)
	for i := range rules[:n/2] {
		rules[i].Dests = []netip.Prefix{netip.PrefixFrom(netip.AddrFrom4([4]byte{11, byte(i >> 8), byte(i), 0}), 24)}
	}
	if err := d.PutMany(rules); err != nil {
		t.Fatal(err)
	}
	if got := len(d.Rules()); got != len(rules) {
		t.Fatalf("%d rules loaded, want %d", got, len(rules))
	}
	checkKernelAgrees(t, d)
}

// manyRules makes n distinct host-wide /32 rules on varied ports.
func manyRules(n int) []Rule {
	rules := make([]Rule, n)
	for i := range rules {
		addr := netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)})
		rules[i] = Rule{Name: fmt.Sprintf("r%d", i), Dests: []netip.Prefix{netip.PrefixFrom(addr, 32)}, Port: uint16(1 + i%1000), Limit: 100}
	}
	return rules
}

// Sync replaces the whole rule set at once, or changes nothing.
func TestSync(t *testing.T) {
	d, _ := open(t)
	prefix := func(s string) []netip.Prefix { return []netip.Prefix{netip.MustParsePrefix(s)} }
	if err := d.Sync([]Rule{{Name: "a", Dests: prefix("10.0.0.0/8"), Limit: 1}, {Name: "b", Dests: prefix("10.1.0.0/16"), Limit: 2}}); err != nil {
		t.Fatal(err)
	}
	// b takes a's destination as a leaves: legal in one sync.
	if err := d.Sync([]Rule{{Name: "b", Dests: prefix("10.0.0.0/8"), Limit: 3}, {Name: "c", Dests: prefix("10.2.0.0/16"), Limit: 4}}); err != nil {
		t.Fatal(err)
	}
	names := func() []string {
		var out []string
		for _, r := range d.Rules() {
			out = append(out, fmt.Sprintf("%s=%d", r.Name, r.Limit))
		}
		slices.Sort(out)
		return out
	}
	if got := names(); !slices.Equal(got, []string{"b=3", "c=4"}) {
		t.Fatalf("after sync: %v", got)
	}
	// A conflict anywhere leaves everything as it was.
	err := d.Sync([]Rule{{Name: "d", Dests: prefix("10.5.0.0/16"), Limit: 1}, {Name: "e", Dests: prefix("10.5.0.0/16"), Limit: 1}})
	if !errors.Is(err, ErrConflict) {
		t.Fatalf("conflicting sync: %v", err)
	}
	if got := names(); !slices.Equal(got, []string{"b=3", "c=4"}) {
		t.Fatalf("after a refused sync: %v", got)
	}
	// So does a name given twice, even for different traffic.
	err = d.Sync([]Rule{{Name: "d", Dests: prefix("10.6.0.0/16"), Limit: 1}, {Name: "d", Dests: prefix("10.7.0.0/16"), Limit: 1}})
	if !errors.Is(err, ErrConflict) || !strings.Contains(err.Error(), `name "d" given twice`) {
		t.Fatalf("sync naming a rule twice: %v", err)
	}
	if got := names(); !slices.Equal(got, []string{"b=3", "c=4"}) {
		t.Fatalf("after a sync naming a rule twice: %v", got)
	}
}

// A granted rule admits exactly the permits user space gave it, and
// Reclaim takes back only unspent ones.
func TestGrantedPermits(t *testing.T) {
	d, cg := open(t)
	srv := listen(t, "tcp4", "127.0.0.1:0")
	privtest.Join(t, cg)
	r := Rule{Name: "granted", Dests: []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}, Port: srv.Port(), Shape: ShapeGranted, Granted: 3}
	put(t, d, r)
	for range 3 {
		dial(t, srv).Close()
	}
	dialRefused(t, srv, syscall.EPERM)
	if s := stats(t, d, r.Name); s.Spent != 3 || s.Admitted != 3 || s.Refused != 1 {
		t.Fatalf("after 3 granted: %+v", s)
	}

	r.Granted = 8 // five more
	put(t, d, r)
	dial(t, srv).Close()
	taken, granted, err := d.Reclaim(r.Name, 1)
	if err != nil || taken != 3 || granted != 5 {
		t.Fatalf("Reclaim keeping 1 of 4 unspent: took %d, granted %d, %v; want 3, 5", taken, granted, err)
	}
	if got, _ := d.Rule(r.Name); got.Granted != 5 {
		t.Fatalf("Rule says granted %d after Reclaim, want 5", got.Granted)
	}
	dial(t, srv).Close()
	dialRefused(t, srv, syscall.EPERM)
	if taken, granted, err := d.Reclaim(r.Name, 0); err != nil || taken != 0 || granted != 5 {
		t.Fatalf("Reclaim with nothing unspent: took %d, granted %d, %v", taken, granted, err)
	}
	if spent, err := d.Spent(r.Name); err != nil || spent != 5 {
		t.Fatalf("Spent %d, %v; want 5", spent, err)
	}
	// Another shape keeps the count: granting again later starts from it.
	r.Shape, r.Granted, r.Limit = ShapeConcurrency, 0, 1
	put(t, d, r)
	if _, _, err := d.Reclaim(r.Name, 0); err == nil {
		t.Fatal("Reclaim on a concurrency rule succeeded")
	}
	r.Shape, r.Granted, r.Limit = ShapeGranted, 6, 0
	put(t, d, r)
	dial(t, srv).Close()
	dialRefused(t, srv, syscall.EPERM)
}

// Every kernel write of a change can fail: the change is undone whole,
// and when the undo fails too the loader reads the kernel back. Either
// way Rules() says what the kernel enforces.
func TestWritesAreAllOrNothing(t *testing.T) {
	d, cg := open(t)
	srv := listen(t, "tcp4", "127.0.0.1:0")
	privtest.Join(t, cg)
	base := []Rule{
		{Name: "a", Dests: prefixes("10.0.0.0/8"), Limit: 1},
		{Name: "b", Dests: []netip.Prefix{netip.PrefixFrom(srv.Addr(), 32)}, Port: srv.Port(), Limit: 1},
		{Name: "c", Dests: prefixes("10.1.0.0/16"), Port: 443, Limit: 2},
	}
	// Every step: keys go and come, a new slot, new metadata, new hints,
	// and the request programs attach.
	change := []Rule{
		{Name: "b", Dests: prefixes("127.0.0.2/32"), Port: srv.Port(), Limit: 1, Requests: true},
		{Name: "c", Dests: prefixes("10.1.0.0/16"), Port: 444, Limit: 3},
		{Name: "d", Dests: []netip.Prefix{netip.PrefixFrom(srv.Addr(), 32)}, Port: srv.Port(), Limit: 0},
	}
	if err := d.Sync(base); err != nil {
		t.Fatal(err)
	}
	before := sortedRules(d.Rules())
	failAt := func(k int, undos bool) func(string) error {
		n := 0
		return func(step string) error {
			if strings.HasPrefix(step, "undo ") {
				if undos {
					return errors.New("injected undo failure")
				}
				return nil
			}
			n++
			if n == k {
				return errors.New("injected failure")
			}
			return nil
		}
	}
	steps := 0
	for k := 1; ; k++ {
		d.fault = failAt(k, false)
		err := d.Sync(change)
		if err == nil {
			steps = k - 1
			break
		}
		if !strings.Contains(err.Error(), "injected failure") {
			t.Fatalf("write %d: %v", k, err)
		}
		if got := sortedRules(d.Rules()); !reflect.DeepEqual(got, before) {
			t.Fatalf("write %d failed: rules %+v, want them as before %+v", k, got, before)
		}
		checkKernelAgrees(t, d)
		// b still admits one connection: its old key and hints hold.
		dial(t, srv).Close()
		waitLive(t, d, "b", 0)
	}
	d.fault = nil
	if steps < 6 {
		t.Fatalf("the change took %d writes; the test means to fail each of at least 6", steps)
	}
	dialRefused(t, srv, syscall.EPERM) // d now
	if err := d.Sync(base); err != nil {
		t.Fatal(err)
	}

	t.Logf("the change takes %d writes", steps)

	// Undo fails as well: the loader reads back what the kernel holds,
	// part of the change.
	partial := 0
	for k := 1; k <= steps; k++ {
		d.fault = failAt(k, true)
		if err := d.Sync(change); err == nil || !strings.Contains(err.Error(), "injected undo failure") {
			t.Fatalf("write %d with failing undo: %v", k, err)
		}
		checkKernelAgrees(t, d)
		if !reflect.DeepEqual(sortedRules(d.Rules()), before) {
			partial++
		}
		d.fault = nil
		if err := d.Sync(base); err != nil {
			t.Fatalf("sync after a failed undo at write %d: %v", k, err)
		}
		if got := sortedRules(d.Rules()); !reflect.DeepEqual(got, before) {
			t.Fatalf("after recovering from write %d: %+v", k, got)
		}
		checkKernelAgrees(t, d)
	}
	if partial == 0 {
		t.Fatal("no failed undo left a part of the change in the kernel")
	}
}

// checkKernelAgrees reads the rules, lookup hints and request programs
// back from the kernel and compares them with the loader's table.
func checkKernelAgrees(t *testing.T, d *Datapath) {
	t.Helper()
	d.mu.Lock()
	defer d.mu.Unlock()
	kt, err := d.readTable()
	if err != nil {
		t.Fatal(err)
	}
	if got, want := sortedRules(kt.rules()), sortedRules(d.t.rules()); !reflect.DeepEqual(got, want) {
		t.Fatalf("kernel holds %+v, loader says %+v", got, want)
	}
	if !maps.Equal(kt.byName, d.t.byName) || !maps.Equal(kt.byKey, d.t.byKey) {
		t.Fatalf("kernel holds names %v keys %v, loader says %v and %v", kt.byName, kt.byKey, d.t.byName, d.t.byKey)
	}
	kh, err := d.readHints()
	if err != nil {
		t.Fatal(err)
	}
	if want := d.t.uses.hints(); !reflect.DeepEqual(kh, want) || !reflect.DeepEqual(d.hints, want) {
		t.Fatalf("kernel hints %+v, cached %+v, want %+v", kh, d.hints, want)
	}
	if _, attached := d.links["egress"]; attached != (d.t.uses.requests > 0) {
		t.Fatalf("request programs attached %v with %d rules tracking requests", attached, d.t.uses.requests)
	}
}

// sortedRules orders rules by name and their destinations, as the kernel
// gives them back in its own order.
func sortedRules(rules []Rule) []Rule {
	out := slices.Clone(rules)
	for i := range out {
		out[i].Dests = slices.Clone(out[i].Dests)
		slices.SortFunc(out[i].Dests, func(a, b netip.Prefix) int { return a.Addr().Compare(b.Addr()) })
	}
	slices.SortFunc(out, func(a, b Rule) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// TestStatusReadsEveryRule: Status, Counts and Recount read a dense
// table in batches and a sparse one slot by slot, and all say what Stats
// says of each rule (Counts without its histograms).
func TestStatusReadsEveryRule(t *testing.T) {
	d, cg := open(t)
	privtest.Join(t, cg)
	var servers []netip.AddrPort
	for range 3 {
		servers = append(servers, listen(t, "tcp4", "127.0.0.1:0"))
	}
	// Three counted rules among 37 others: at slots 0, 20 and 39.
	var rules []Rule
	for i := range 40 {
		rules = append(rules, Rule{Name: fmt.Sprintf("idle%d", i), Dests: prefixes(fmt.Sprintf("10.9.0.%d/32", i)), Limit: 5})
	}
	for i, at := range []int{0, 20, 39} {
		srv := servers[i]
		rules[at] = Rule{Name: fmt.Sprintf("busy%d", i), Dests: []netip.Prefix{netip.PrefixFrom(srv.Addr(), 32)}, Port: srv.Port(), Limit: 5}
	}
	if err := d.PutMany(rules); err != nil {
		t.Fatal(err)
	}
	for i, srv := range servers {
		for range i + 1 {
			dial(t, srv)
		}
	}
	check := func(when string, want int) {
		t.Helper()
		status, err := d.Status()
		if err != nil {
			t.Fatal(err)
		}
		rc, err := d.Recount()
		if err != nil {
			t.Fatal(err)
		}
		counted := map[string]Stats{}
		if err := d.Counts(func(r *Rule, s *Stats) { counted[r.Name] = *s }); err != nil {
			t.Fatal(err)
		}
		if len(status) != want || len(rc) != want || len(counted) != want {
			t.Fatalf("%s: Status has %d rules, Counts %d and Recount %d, want %d", when, len(status), len(counted), len(rc), want)
		}
		for _, s := range status {
			if one := stats(t, d, s.Name); s.Stats != one {
				t.Errorf("%s: Status of %s %+v, Stats %+v", when, s.Name, s.Stats, one)
			}
			noLatency := s.Stats
			noLatency.ConnectLatency, noLatency.RequestLatency = Histogram{}, Histogram{}
			if c := counted[s.Name]; c != noLatency {
				t.Errorf("%s: Counts of %s %+v, Status %+v", when, s.Name, c, s.Stats)
			}
			if r := rc[s.Name]; r.Live != s.Stats.Live || r.Counted != s.Stats.Live {
				t.Errorf("%s: Recount of %s %+v, live %d", when, s.Name, r, s.Stats.Live)
			}
		}
		for i := range servers {
			if s := stats(t, d, fmt.Sprintf("busy%d", i)); s.Admitted != uint64(i+1) || s.Live != int64(i+1) {
				t.Errorf("%s: busy%d %+v, want %d admitted and live", when, i, s, i+1)
			}
		}
	}
	check("dense", 40)
	for i := range 40 {
		if i != 0 && i != 20 && i != 39 {
			if err := d.Delete(fmt.Sprintf("idle%d", i)); err != nil {
				t.Fatal(err)
			}
		}
	}
	check("sparse", 3)
}

// A table of kernel tables just made is the one readTable would read
// back from them.
func TestEmptyTableIsReadBack(t *testing.T) {
	privtest.RequireRoot(t)
	d, err := Open(&Config{Cgroup: privtest.Cgroup(t, "empty"), PinDir: privtest.PinDir(t), MaxRules: 64})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Uninstall() })
	if d.Adopted() {
		t.Fatal("a datapath in a new pin directory was adopted")
	}
	read, err := d.readTable()
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(read, emptyTable(64, 64*keysPerRule)) {
		t.Fatalf("read back %+v, want the empty table", read)
	}
}

// Counts and Status read a table of more slots than egressd_counts copies
// at once (statsChunk) in parts: the rules either side of a part's edge
// and in the last slot read what a lookup of each reads, before and after
// a resize loads the programs and their counts map again.
func TestCountsReadInParts(t *testing.T) {
	privtest.RequireRoot(t)
	cg := privtest.Cgroup(t, "parts")
	const n = 2*statsChunk + 100
	d, err := Open(&Config{Cgroup: cg, PinDir: privtest.PinDir(t), MaxRules: n})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Uninstall() })
	privtest.Join(t, cg)
	busy := []int{0, statsChunk - 1, statsChunk, n - 1}
	rules := make([]Rule, n)
	for i := range rules {
		rules[i] = Rule{Name: fmt.Sprintf("idle%d", i), Dests: prefixes(fmt.Sprintf("10.%d.%d.%d/32", i>>16&255, i>>8&255, i&255)), Limit: 5}
	}
	servers := make([]netip.AddrPort, len(busy))
	for i, at := range busy {
		servers[i] = listen(t, "tcp4", "127.0.0.1:0")
		rules[at] = Rule{Name: fmt.Sprintf("busy%d", i), Dests: []netip.Prefix{netip.PrefixFrom(servers[i].Addr(), 32)}, Port: servers[i].Port(), Limit: 5}
	}
	if err := d.PutMany(rules); err != nil {
		t.Fatal(err)
	}
	for i, srv := range servers {
		for range i + 1 {
			dial(t, srv)
		}
	}
	check := func(when string) {
		t.Helper()
		counted := map[string]Stats{}
		if err := d.Counts(func(r *Rule, s *Stats) { counted[r.Name] = *s }); err != nil {
			t.Fatal(err)
		}
		status, err := d.Status()
		if err != nil {
			t.Fatal(err)
		}
		if len(counted) != n || len(status) != n {
			t.Fatalf("%s: Counts has %d rules and Status %d, want %d", when, len(counted), len(status), n)
		}
		for _, s := range status {
			noLatency := s.Stats
			noLatency.ConnectLatency, noLatency.RequestLatency = Histogram{}, Histogram{}
			if c := counted[s.Name]; c != noLatency {
				t.Errorf("%s: Counts of %s %+v, Status %+v", when, s.Name, c, s.Stats)
			}
		}
		for i, at := range busy {
			name := fmt.Sprintf("busy%d", i)
			if d.t.byName[name] != uint32(at) {
				t.Fatalf("%s: %s in slot %d, want %d", when, name, d.t.byName[name], at)
			}
			one := stats(t, d, name)
			if c := counted[name]; c.Admitted != uint64(i+1) || c.Live != int64(i+1) || c.Admitted != one.Admitted || c.Live != one.Live {
				t.Errorf("%s: Counts of %s (slot %d) %+v, a lookup %+v; want %d admitted and live", when, name, at, c, one, i+1)
			}
		}
	}
	check("dense")
	if err := d.Resize(n + statsChunk); err != nil {
		t.Fatal(err)
	}
	check("resized")
}

// A refusal reader that finds nothing reads ever less often, up to
// quietPollEvery, and sleeps between its reads until the kernel rings its
// bell; a read at its deadline still finds a refusal, and a refusal
// brings it back to pollEvery (a tenth of it for the first read after).
func TestRefusalReaderQuiet(t *testing.T) {
	d, cg := open(t)
	srv := listen(t, "tcp4", "127.0.0.1:0")
	privtest.Join(t, cg)
	put(t, d, Rule{Name: "one", Dests: []netip.Prefix{netip.PrefixFrom(srv.Addr(), 32)}, Port: srv.Port(), Limit: 1})
	events, err := d.Refusals()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { events.Close() })
	// Each Read ends with a read of the runs at its deadline.
	var periods []time.Duration
	for events.every < quietPollEvery {
		if len(periods) == 10 {
			t.Fatalf("periods %v: never %v", periods, quietPollEvery)
		}
		events.SetDeadline(time.Now().Add(10 * time.Millisecond))
		if e, err := events.Read(); !errors.Is(err, ErrDeadline) {
			t.Fatalf("a quiet read: %+v, %v", e, err)
		}
		periods = append(periods, events.every)
	}
	if want := []time.Duration{2 * pollEvery, 4 * pollEvery, 8 * pollEvery, quietPollEvery}; !slices.Equal(periods, want) {
		t.Errorf("periods %v, want %v", periods, want)
	}
	dial(t, srv)
	dialRefused(t, srv, syscall.EPERM)
	events.SetDeadline(time.Now().Add(10 * time.Millisecond))
	if e, err := events.Read(); err != nil || e.Rule != "one" || e.Count != 1 {
		t.Fatalf("the refusal read at the deadline: %+v, %v", e, err)
	}
	// Woken, it reads again soon to see how fast refusals come, then
	// every pollEvery while the process's pair lasts.
	if events.every != pollEvery/10 {
		t.Errorf("after the first refusal the reader reads every %v, want %v", events.every, pollEvery/10)
	}
	events.SetDeadline(time.Now().Add(pollEvery / 10))
	if e, err := events.Read(); !errors.Is(err, ErrDeadline) {
		t.Fatalf("a read with no more refusals: %+v, %v", e, err)
	}
	if events.every != pollEvery {
		t.Errorf("after a read with no more refusals the reader reads every %v, want %v", events.every, pollEvery)
	}

	// Asleep with its next read an hour away, the reader is woken by a
	// refusal long before the deadline of its Read: the kernel rang the
	// bell (and disarmed it), as nothing else wakes it before the hour.
	for i := 0; len(events.pairs) > 0 || !events.asleep; i++ {
		// The pair of the refusal above is forgotten an event interval
		// after its event, at a read of the runs.
		if i == 20 {
			t.Fatalf("the reader never went to sleep: every %v, %d pairs", events.every, len(events.pairs))
		}
		events.SetDeadline(time.Now().Add(d.cfg.EventInterval / 2))
		if e, err := events.Read(); !errors.Is(err, ErrDeadline) {
			t.Fatalf("a quiet read: %+v, %v", e, err)
		}
	}
	events.every = time.Hour
	dialRefused(t, srv, syscall.EPERM)
	start := time.Now()
	events.SetDeadline(start.Add(time.Minute))
	if e, err := events.Read(); err != nil || e.Rule != "one" {
		t.Fatalf("the refusal that rang: %+v, %v", e, err)
	}
	if waited := time.Since(start); waited > 30*time.Second {
		t.Errorf("the reader woke %v after the refusal, at its deadline: the bell did not ring", waited)
	}
	var armed [4]byte
	if _, err := events.armed.ReadAt(armed[:], 0); err != nil || armed != [4]byte{} {
		t.Errorf("bell armed %v after it rang (%v), want 0", armed, err)
	}
}
