package daemon

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/internal/dns"
	"github.com/egressd/egressd/pkg/loader"
	"golang.org/x/net/dns/dnsmessage"
)

// TestHostRuleFollowsTTL: a host-name rule is looked up again when its TTL
// runs out and moves to the new addresses; a lookup that fails keeps the
// last addresses rather than lifting the limit.
func TestHostRuleFollowsTTL(t *testing.T) {
	td := newTestDaemon(t)
	writeFile(t, td.hosts, "127.0.0.2 svc.test\n")
	now := time.Now()
	td.applyAt(t, now, "rules:\n  - name: svc\n    destination: svc.test\n    concurrency: 3\n")
	ctx := context.Background()
	steps := []struct {
		name    string
		hosts   string
		advance time.Duration
		want    string
	}{
		{"resolved at install", "", 0, "127.0.0.2/32 concurrency 3 (policy)"},
		{"the TTL (a second here) has not run out", "127.0.0.3 svc.test\n", 999 * time.Millisecond, "127.0.0.2/32 concurrency 3 (policy)"},
		{"it has: the new addresses", "127.0.0.3 svc.test\n127.0.0.4 svc.test\n", time.Millisecond, "127.0.0.3/32,127.0.0.4/32 concurrency 3 (policy)"},
		// The name vanishes from the hosts file and the DNS server does
		// not answer: the rule keeps its addresses.
		{"a failed lookup", "-", time.Second, "127.0.0.3/32,127.0.0.4/32 concurrency 3 (policy)"},
		{"another", "-", 2 * time.Second, "127.0.0.3/32,127.0.0.4/32 concurrency 3 (policy)"},
	}
	for _, s := range steps {
		td.setHosts(t, s.hosts)
		now = now.Add(s.advance)
		td.refreshAll(ctx, now, false)
		if got := td.state()["svc"]; got != s.want {
			t.Fatalf("%s: svc is %q, want %q", s.name, got, s.want)
		}
	}
}

// silentServer is a DNS server that reads each question and answers none
// until fail, which answers SERVFAIL to each question asked and every one
// after, until silence: a lookup waiting on it fails when the test says.
// asked receives a value a question.
type silentServer struct {
	asked         <-chan struct{}
	fail, silence func()
}

// silentDNS points td's lookups at a silentServer, each question waiting
// timeout before the resolver gives up on it.
func (td *testDaemon) silentDNS(t *testing.T, timeout time.Duration) silentServer {
	t.Helper()
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pc.Close() })
	type question struct {
		id   uint16
		q    dnsmessage.Question
		from net.Addr
	}
	var (
		mu      sync.Mutex
		failing bool
		waiting []question
	)
	servfail := func(q question) {
		m := dnsmessage.Message{Header: dnsmessage.Header{ID: q.id, Response: true, RCode: dnsmessage.RCodeServerFailure}, Questions: []dnsmessage.Question{q.q}}
		if b, err := m.Pack(); err == nil {
			pc.WriteTo(b, q.from)
		}
	}
	ch := make(chan struct{}, 64)
	go func() {
		buf := make([]byte, 512)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			var p dnsmessage.Parser
			h, err := p.Start(buf[:n])
			if err != nil {
				continue
			}
			q, err := p.Question()
			if err != nil {
				continue
			}
			mu.Lock()
			if failing {
				servfail(question{h.ID, q, from})
			} else {
				waiting = append(waiting, question{h.ID, q, from})
			}
			mu.Unlock()
			select {
			case ch <- struct{}{}:
			default:
			}
		}
	}()
	td.useResolver(&dns.Resolver{HostsFile: td.hosts, Servers: []string{pc.LocalAddr().String()}, Timeout: timeout, MinTTL: time.Second, MaxTTL: time.Second})
	return silentServer{asked: ch, fail: func() {
		mu.Lock()
		defer mu.Unlock()
		failing = true
		for _, q := range waiting {
			servfail(q)
		}
		waiting = nil
	}, silence: func() {
		mu.Lock()
		defer mu.Unlock()
		failing = false
	}}
}

// TestLookupOutsideTheLock: while a DNS server takes its time answering,
// the rule table is not locked: the API and the metrics go on.
func TestLookupOutsideTheLock(t *testing.T) {
	td := newTestDaemon(t)
	srv := td.silentDNS(t, time.Minute)
	done := make(chan error, 1)
	go func() {
		done <- td.table.install(context.Background(), parse(t, "rules:\n  - {name: slow, destination: slow.test, concurrency: 1}\n"), time.Now())
	}()
	<-srv.asked
	if !td.table.mu.TryLock() {
		t.Fatal("the rule table is locked while a host name is looked up")
	}
	td.table.mu.Unlock()
	if _, err := td.api.handleStatus(nil, struct{}{}); err != nil {
		t.Errorf("status while a lookup waits: %v", err)
	}
	srv.fail()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if got := td.state()["slow"]; got != "pending: host slow.test has no addresses yet" {
		t.Errorf("a name that did not resolve: %q", got)
	}
}

// TestLookupsAtOnce: the host names of an install are looked up together,
// so that many names during a DNS outage take the time of one lookup, not
// of each in turn: every name's questions reach the silent server while
// the first still waits for its answer.
func TestLookupsAtOnce(t *testing.T) {
	td := newTestDaemon(t)
	srv := td.silentDNS(t, time.Minute)
	var b strings.Builder
	b.WriteString("rules:\n")
	const names = 4
	for i := range names {
		fmt.Fprintf(&b, "  - {name: r%d, destination: svc%d.test, concurrency: 1}\n", i, i)
	}
	done := make(chan error, 1)
	go func() { done <- td.table.install(context.Background(), parse(t, b.String()), time.Now()) }()
	// An A and an AAAA question a name. A bound for a hang only: one
	// name at a time would ask the second after the minute.
	for i := range 2 * names {
		select {
		case <-srv.asked:
		case <-time.After(20 * time.Second):
			t.Fatalf("%d questions reached the DNS server, want %d: the names are looked up one after another", i, 2*names)
		}
	}
	srv.fail()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// TestLookupsSurviveAnotherChange: a change applied while another still
// looks names up (a limit set during a reload's slow lookup) leaves the
// addresses the other has found, though its own table does not use them:
// the other's rule is then installed, not planned pending.
func TestLookupsSurviveAnotherChange(t *testing.T) {
	td := newTestDaemon(t)
	srv := td.silentDNS(t, time.Minute)
	writeFile(t, td.hosts, "10.0.0.9 fast.test\n")
	writeFile(t, td.cfg.PolicyFile, "rules:\n  - {name: api, destination: 10.0.0.1, concurrency: 3}\n")
	if _, err := td.reloadPolicy(context.Background()); err != nil {
		t.Fatal(err)
	}
	// api moves to a host name the hosts file has; a new rule's host
	// name waits on the DNS server.
	writeFile(t, td.cfg.PolicyFile, "rules:\n  - {name: api, destination: fast.test, concurrency: 3}\n  - {name: slow, destination: slow.test, concurrency: 1}\n")
	done := td.reloadAsync(context.Background())
	<-srv.asked // fast.test is found, slow.test is being asked
	if err := td.table.set(context.Background(), parse(t, "rules:\n  - {name: other, destination: 10.0.0.7, concurrency: 1}\n").Rules[0], time.Now()); err != nil {
		t.Fatal(err)
	}
	srv.fail()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	want := map[string]string{
		"api":   "10.0.0.9/32 concurrency 3 (policy)",
		"slow":  "pending: host slow.test has no addresses yet",
		"other": "10.0.0.7/32 concurrency 1 (cli)",
	}
	if got := td.state(); !equalMaps(got, want) {
		t.Errorf("table %v, want %v", got, want)
	}
	td.names.mu.Lock()
	defer td.names.mu.Unlock()
	if len(td.names.held) != 0 {
		t.Errorf("names still held after every change applied: %v", td.names.held)
	}
}

// TestRefreshPlansOnlyWhatMoved: the table (which may hold 100,000 rules)
// is planned and written again only when a host name resolved to other
// addresses or a scope's cgroup moved, not each time a TTL runs out or the
// units are looked up.
func TestRefreshPlansOnlyWhatMoved(t *testing.T) {
	td := newTestDaemon(t)
	writeFile(t, td.hosts, "127.0.0.2 a.test\n127.0.0.3 a.test\n")
	now := time.Now()
	td.applyAt(t, now, "rules:\n  - {name: a, destination: a.test, concurrency: 3}\n  - {name: svc, destination: 10.0.0.1, unit: egressd-test-absent.service, concurrency: 1}\n")
	syncs := func() int {
		td.fake.mu.Lock()
		defer td.fake.mu.Unlock()
		return td.fake.syncs
	}
	ctx := context.Background()
	steps := []struct {
		name    string
		hosts   string
		advance time.Duration
		units   bool
		planned bool
	}{
		{"units looked up again, none moved", "", 0, true, false},
		{"a TTL ran out: the same addresses, in another order", "127.0.0.3 a.test\n127.0.0.2 a.test\n", time.Second, false, false},
		{"both", "", time.Second, true, false},
		{"other addresses", "127.0.0.4 a.test\n", time.Second, false, true},
		{"a failed lookup keeps them", "-", time.Second, true, false},
	}
	for _, s := range steps {
		td.setHosts(t, s.hosts)
		now = now.Add(s.advance)
		before := syncs()
		td.refreshAll(ctx, now, s.units)
		if planned := syncs() > before; planned != s.planned {
			t.Errorf("%s: planned again %v, want %v", s.name, planned, s.planned)
		}
	}
	if got, want := td.state()["a"], "127.0.0.4/32 concurrency 3 (policy)"; got != want {
		t.Errorf("a is %q, want %q", got, want)
	}
}

// setHosts writes the hosts file: "" keeps it, "-" empties it.
func (td *testDaemon) setHosts(t *testing.T, hosts string) {
	t.Helper()
	switch hosts {
	case "":
	case "-":
		writeFile(t, td.hosts, "")
	default:
		writeFile(t, td.hosts, hosts)
	}
}

// TestNewNameGetsNoOldAddresses: a rule whose destination changes to a
// host name that does not resolve is pending, and so is every rule on that
// name: the addresses of the rule's old destination, which the kernel
// still enforces, are not the new name's.
func TestNewNameGetsNoOldAddresses(t *testing.T) {
	for _, tc := range []struct{ name, before, hosts string }{
		{"from a prefix", "10.0.0.0/8", ""},
		{"from another name", "old.test", "192.0.2.7 old.test\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			td := newTestDaemon(t)
			writeFile(t, td.hosts, tc.hosts)
			td.apply(t, "rules:\n  - {name: api, destination: "+tc.before+", concurrency: 3}\n")
			// new.test is in neither the hosts file nor DNS.
			td.apply(t, "rules:\n  - {name: api, destination: new.test, concurrency: 3}\n")
			td.apply(t, "rules:\n  - {name: api, destination: new.test, concurrency: 3}\n  - {name: other, destination: new.test, port: 443, concurrency: 1}\n")
			want := map[string]string{"api": "pending: host new.test has no addresses yet", "other": "pending: host new.test has no addresses yet"}
			if got := td.state(); !equalMaps(got, want) {
				t.Errorf("table %v, want %v", got, want)
			}
		})
	}
}

// TestStartDuringOutage: a daemon started while no host name resolves
// enforces a name's rules with the addresses the last run saved for that
// name; a name it has none saved for, or a saved file it cannot read,
// leaves the rules pending and the daemon starts all the same.
func TestStartDuringOutage(t *testing.T) {
	// The last run resolved api.test and saved its addresses.
	last := newTestDaemon(t)
	writeFile(t, last.hosts, "192.0.2.8 api.test\n192.0.2.7 api.test\n")
	last.apply(t, "rules:\n  - {name: api, destination: api.test, concurrency: 4}\n")
	saved, err := os.ReadFile(namesPath(last.cfg.StateDir))
	if err != nil {
		t.Fatal(err)
	}
	const pending = "pending: host api.test has no addresses yet"
	for _, tc := range []struct{ name, file, want string }{
		{"saved by the last run", string(saved), "192.0.2.7/32,192.0.2.8/32 concurrency 4 (policy)"},
		{"no file", "", pending},
		{"a corrupt file", `{"hosts": {"api.test": [`, pending},
		{"a prefix is no address", `{"hosts": {"api.test": ["10.0.0.0/8"]}}`, pending},
		{"an empty address", `{"hosts": {"api.test": [""]}}`, pending},
	} {
		t.Run(tc.name, func(t *testing.T) {
			td := newTestDaemon(t)
			td.saveNames(t, tc.file)
			writeFile(t, td.cfg.PolicyFile, "rules:\n  - {name: api, destination: api.test, concurrency: 4}\n  - {name: new, destination: new.test, port: 443, concurrency: 1}\n")
			td.start(t)
			want := map[string]string{"api": tc.want, "new": "pending: host new.test has no addresses yet"}
			if got := td.state(); !equalMaps(got, want) {
				t.Errorf("table %v, want %v", got, want)
			}
		})
	}
}

// saveNames writes the saved host addresses as the last run left them:
// file, or none for "".
func (td *testDaemon) saveNames(t *testing.T, file string) {
	t.Helper()
	if file == "" {
		return
	}
	if err := os.MkdirAll(td.cfg.StateDir, 0o700); err != nil {
		t.Fatal(err)
	}
	writeFile(t, namesPath(td.cfg.StateDir), file)
}

// TestRestartDuringOutageKeepsEnforced: a daemon restarted while no host
// name resolves and with no saved addresses to read (the file lost,
// unreadable, or never written on a full disk) keeps enforcing a host-name
// rule with the addresses the previous daemon's kernel rule of that name
// has, rather than lifting its limit. A file it reads that lacks the name
// says the name is new to the rule, and a kernel rule for another port is
// another destination: neither is taken. Once the name resolves, it moves.
func TestRestartDuringOutageKeepsEnforced(t *testing.T) {
	const pending = "pending: host api.test has no addresses yet"
	for _, tc := range []struct {
		name, file string
		port       uint16
		want       string
	}{
		{"no file", "", 0, "192.0.2.7/32,192.0.2.8/32 concurrency 4 (policy)"},
		{"a corrupt file", `{"hosts": {"api.test": [`, 0, "192.0.2.7/32,192.0.2.8/32 concurrency 4 (policy)"},
		{"a file without the name", `{"hosts": {"other.test": ["192.0.2.9"]}}`, 0, pending},
		{"the kernel rule is for another port", "", 443, pending},
	} {
		t.Run(tc.name, func(t *testing.T) {
			td := newTestDaemon(t)
			td.saveNames(t, tc.file)
			td.fake.adopted = true
			td.fake.rules["api"] = loader.Rule{Name: "api", Port: tc.port, Dests: []netip.Prefix{netip.MustParsePrefix("192.0.2.7/32"), netip.MustParsePrefix("192.0.2.8/32")}, Limit: 4}
			writeFile(t, td.cfg.PolicyFile, "rules:\n  - {name: api, destination: api.test, concurrency: 4}\n")
			td.start(t)
			if got := td.state()["api"]; got != tc.want {
				t.Fatalf("after the restart api is %q, want %q", got, tc.want)
			}
			// A change of another rule before the name resolves keeps it.
			if err := td.table.set(context.Background(), parse(t, "rules:\n  - {name: other, destination: 10.0.0.1, concurrency: 1}\n").Rules[0], time.Now()); err != nil {
				t.Fatal(err)
			}
			if got := td.state()["api"]; got != tc.want {
				t.Fatalf("after another change api is %q, want %q", got, tc.want)
			}
			td.setHosts(t, "192.0.2.10 api.test\n")
			td.refreshAll(context.Background(), time.Now().Add(time.Minute), false) // past the TTL of every lookup so far
			if got, want := td.state()["api"], "192.0.2.10/32 concurrency 4 (policy)"; got != want {
				t.Errorf("once the name resolves api is %q, want %q", got, want)
			}
		})
	}
}

// TestFailedSaveRetried: addresses that could not be saved (a full disk)
// are saved by a later refresh, though no name moved since.
func TestFailedSaveRetried(t *testing.T) {
	td := newTestDaemon(t)
	path := namesPath(td.cfg.StateDir)
	// A directory where the file goes makes its rename fail.
	if err := os.MkdirAll(path, 0o700); err != nil {
		t.Fatal(err)
	}
	writeFile(t, td.hosts, "192.0.2.7 api.test\n")
	now := time.Now()
	td.applyAt(t, now, "rules:\n  - {name: api, destination: api.test, concurrency: 4}\n")
	if fi, err := os.Stat(path); err != nil || !fi.IsDir() {
		t.Fatalf("the save that must fail did not: %v, %v", fi, err)
	}
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	td.refreshAll(context.Background(), now, false)
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("a refresh after the failed save: %v", err)
	}
	if got, want := string(b), `{"hosts":{"api.test":["192.0.2.7"]}}`; got != want {
		t.Errorf("saved %s, want %s", got, want)
	}
}

// TestSetAbandonedWhileLookingUp: a `limit set` whose caller gives up (its
// timeout) while the rule's host name is still being looked up changes
// nothing, neither the table nor the saved run-time limits, as the caller
// was told; and the lookup it cut short is not kept as a failed one, so
// the next set of the rule looks the name up again.
func TestSetAbandonedWhileLookingUp(t *testing.T) {
	td := newTestDaemon(t)
	td.apply(t, "rules: []\n")
	srv := td.silentDNS(t, time.Minute)
	rule := parse(t, "rules:\n  - {name: slow, destination: slow.test, concurrency: 1}\n").Rules[0]
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- td.table.set(ctx, rule, time.Now()) }()
	<-srv.asked
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("set abandoned by its caller: %v, want %v", err, context.Canceled)
	}
	if got, ok := td.state()["slow"]; ok {
		t.Errorf("the abandoned set is in the table: %q", got)
	}
	if o, err := loadOverrides(td.cfg.StateDir); err != nil || len(o.Set) != 0 {
		t.Errorf("saved run-time limits after the abandoned set: %+v, %v", o.Set, err)
	}
	writeFile(t, td.hosts, "192.0.2.5 slow.test\n")
	if err := td.table.set(context.Background(), rule, time.Now()); err != nil {
		t.Fatal(err)
	}
	if got, want := td.state()["slow"], "192.0.2.5/32 concurrency 1 (cli)"; got != want {
		t.Errorf("set again: %q, want %q", got, want)
	}
}

// familyDNS is a DNS server that answers the questions of a type it has
// addresses for with them (none: NODATA) and any other with SERVFAIL.
type familyDNS struct {
	mu      sync.Mutex
	answers map[dnsmessage.Type][]netip.Addr
}

// familyDNS points td's lookups at a familyDNS, TTL a second.
func (td *testDaemon) familyDNS(t *testing.T) *familyDNS {
	t.Helper()
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pc.Close() })
	f := &familyDNS{}
	go func() {
		buf := make([]byte, 512)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			var p dnsmessage.Parser
			h, err := p.Start(buf[:n])
			if err != nil {
				continue
			}
			if q, err := p.Question(); err == nil {
				pc.WriteTo(f.reply(h.ID, q), from)
			}
		}
	}()
	td.useResolver(&dns.Resolver{HostsFile: td.hosts, Servers: []string{pc.LocalAddr().String()}, Timeout: time.Minute, MinTTL: time.Second, MaxTTL: time.Second})
	return f
}

func (f *familyDNS) set(answers map[dnsmessage.Type][]netip.Addr) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.answers = answers
}

func (f *familyDNS) reply(id uint16, q dnsmessage.Question) []byte {
	f.mu.Lock()
	defer f.mu.Unlock()
	m := dnsmessage.Message{
		Header:    dnsmessage.Header{ID: id, Response: true, RecursionDesired: true, RecursionAvailable: true},
		Questions: []dnsmessage.Question{q},
	}
	addrs, ok := f.answers[q.Type]
	if !ok {
		m.RCode = dnsmessage.RCodeServerFailure
	}
	for _, a := range addrs {
		h := dnsmessage.ResourceHeader{Name: q.Name, Class: dnsmessage.ClassINET, TTL: 1}
		var body dnsmessage.ResourceBody = &dnsmessage.AAAAResource{AAAA: a.As16()}
		if a.Is4() {
			body = &dnsmessage.AResource{A: a.As4()}
		}
		m.Answers = append(m.Answers, dnsmessage.Resource{Header: h, Body: body})
	}
	b, err := m.Pack()
	if err != nil {
		panic(err)
	}
	return b
}

// TestOneFamilyUnanswered: a name whose A or AAAA question goes unanswered
// resolves to the other family's answer, an empty one included, and keeps
// the unanswered family's last addresses: a forwarder that fails AAAA
// questions does not leave a rule pending.
func TestOneFamilyUnanswered(t *testing.T) {
	td := newTestDaemon(t)
	srv := td.familyDNS(t)
	v4, v6 := dnsmessage.TypeA, dnsmessage.TypeAAAA
	ip := func(s string) []netip.Addr { return []netip.Addr{netip.MustParseAddr(s)} }
	steps := []struct {
		name    string
		answers map[dnsmessage.Type][]netip.Addr
		want    string
	}{
		{"AAAA fails at the first lookup", map[dnsmessage.Type][]netip.Addr{v4: ip("127.0.0.2")}, "127.0.0.2/32 concurrency 3 (policy)"},
		{"both answer", map[dnsmessage.Type][]netip.Addr{v4: ip("127.0.0.2"), v6: ip("::2")}, "127.0.0.2/32,::2/128 concurrency 3 (policy)"},
		{"A fails: its last address stays", map[dnsmessage.Type][]netip.Addr{v6: ip("::3")}, "127.0.0.2/32,::3/128 concurrency 3 (policy)"},
		{"AAAA fails, no A records", map[dnsmessage.Type][]netip.Addr{v4: nil}, "::3/128 concurrency 3 (policy)"},
	}
	now := time.Now()
	for i, s := range steps {
		srv.set(s.answers)
		if i == 0 {
			td.applyAt(t, now, "rules:\n  - {name: svc, destination: svc.test, concurrency: 3}\n")
		} else {
			now = now.Add(time.Second) // the names' TTL
			td.refreshAll(context.Background(), now, false)
		}
		if got := td.state()["svc"]; got != s.want {
			t.Fatalf("%s: svc is %q, want %q", s.name, got, s.want)
		}
	}
}

// refreshAll refreshes at now and applies what the lookups it started
// found, once they are done.
func (td *testDaemon) refreshAll(ctx context.Context, now time.Time, units bool) {
	td.table.refresh(ctx, now, units)
	td.names.wait()
	td.table.refresh(ctx, now, false)
}

// TestSlowNameHoldsBackNoOther: a refresh does not wait for a name whose
// DNS server does not answer: another name's new addresses are applied
// while that lookup goes on.
func TestSlowNameHoldsBackNoOther(t *testing.T) {
	td := newTestDaemon(t)
	srv := td.silentDNS(t, time.Minute)
	writeFile(t, td.hosts, "127.0.0.2 fast.test\n")
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(func() { cancel(); td.names.wait() })
	// slow.test's first lookup fails: pending.
	now := time.Now()
	done := make(chan error, 1)
	go func() {
		done <- td.table.install(ctx, parse(t, "rules:\n  - {name: fast, destination: fast.test, concurrency: 3}\n  - {name: slow, destination: slow.test, port: 443, concurrency: 3}\n"), now)
	}()
	<-srv.asked
	srv.fail()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	srv.silence()
	writeFile(t, td.hosts, "127.0.0.3 fast.test\n")
	now = now.Add(time.Second) // the names' TTL
	refreshed := make(chan struct{})
	go func() { td.table.refresh(ctx, now, false); close(refreshed) }()
	select {
	case <-refreshed:
	case <-time.After(10 * time.Second): // a minute if it waits
		t.Fatal("a refresh waits for slow.test's lookup")
	}
	clocktest.Eventually(t, "fast.test's lookup in the background", func() bool {
		return slices.Equal(td.names.addrs("fast.test"), []netip.Addr{netip.MustParseAddr("127.0.0.3")})
	})
	td.table.refresh(ctx, now, false)
	want := map[string]string{"fast": "127.0.0.3/32 concurrency 3 (policy)", "slow": "pending: host slow.test has no addresses yet"}
	if got := td.state(); !equalMaps(got, want) {
		t.Errorf("table %v, want %v", got, want)
	}
	td.names.mu.Lock()
	defer td.names.mu.Unlock()
	if !td.names.inflight["slow.test"] {
		t.Error("slow.test's lookup is over: the test shows nothing")
	}
}
