package daemon

import (
	"context"
	"net"
	"slices"
	"testing"
	"time"

	"github.com/egressd/egressd/internal/dns"
)

// TestHostRuleFollowsTTL: a host-name rule is looked up again when its TTL
// runs out and moves to the new addresses; a lookup that fails keeps the
// last addresses rather than lifting the limit.
func TestHostRuleFollowsTTL(t *testing.T) {
	td := newTestDaemon(t)
	writeFile(t, td.hosts, "127.0.0.2 svc.test\n")
	writeFile(t, td.cfg.PolicyFile, "rules:\n  - name: svc\n    destination: svc.test\n    concurrency: 3\n")
	td.start(t)

	c := td.client()
	dests := func() []string {
		l, err := c.Limit(context.Background(), "svc")
		if err != nil {
			return nil
		}
		return l.Destinations
	}
	wait := func(want ...string) {
		t.Helper()
		for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
			if slices.Equal(dests(), want) {
				return
			}
		}
		t.Fatalf("destinations %v, want %v", dests(), want)
	}
	wait("127.0.0.2/32")

	// The hosts file's TTL is a second here.
	writeFile(t, td.hosts, "127.0.0.3 svc.test\n127.0.0.4 svc.test\n")
	wait("127.0.0.3/32", "127.0.0.4/32")

	// The name vanishes from the hosts file and the DNS server does not
	// answer: the rule keeps its addresses through two more lookups.
	writeFile(t, td.hosts, "")
	expires := func() time.Time {
		td.names.mu.Lock()
		defer td.names.mu.Unlock()
		return td.names.hosts["svc.test"].expires
	}
	before := expires()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if expires().Sub(before) >= 2*time.Second {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the name was not looked up again")
		}
	}
	if got := dests(); !slices.Equal(got, []string{"127.0.0.3/32", "127.0.0.4/32"}) {
		t.Fatalf("after failed lookups: destinations %v", got)
	}
}

// TestLookupOutsideTheLock: while a DNS server takes its time answering,
// the rule table is not locked: the API and the metrics go on.
func TestLookupOutsideTheLock(t *testing.T) {
	td := newTestDaemon(t)
	// A DNS server that reads the question and never answers.
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pc.Close() })
	asked := make(chan struct{}, 8)
	go func() {
		buf := make([]byte, 512)
		for {
			if _, _, err := pc.ReadFrom(buf); err != nil {
				return
			}
			asked <- struct{}{}
		}
	}()
	td.cfg.Resolver = &dns.Resolver{HostsFile: td.hosts, Servers: []string{pc.LocalAddr().String()}, Timeout: 5 * time.Second}
	td.names = newNames(td.cfg.Resolver, td.log)

	done := make(chan error, 1)
	go func() {
		done <- td.install(context.Background(), parse(t, "rules:\n  - {name: slow, destination: slow.test, concurrency: 1}\n"))
	}()
	<-asked
	if !td.mu.TryLock() {
		t.Fatal("the rule table is locked while a host name is looked up")
	}
	td.mu.Unlock()
	if _, err := td.handleStatus(nil, struct{}{}); err != nil {
		t.Errorf("status while a lookup waits: %v", err)
	}
	pc.Close() // the lookup fails
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if got := td.state()["slow"]; got != "pending: host slow.test has no addresses yet" {
		t.Errorf("a name that did not resolve: %q", got)
	}
}
