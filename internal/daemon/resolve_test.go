package daemon

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/egressd/egressd/internal/dns"
	"github.com/egressd/egressd/internal/privtest"
	"github.com/egressd/egressd/pkg/control"
)

// TestHostRuleFollowsTTL: a host-name rule is looked up again when its TTL
// runs out and moves to the new addresses, keeping its counts; a lookup
// that fails keeps the last addresses rather than lifting the limit.
func TestHostRuleFollowsTTL(t *testing.T) {
	privtest.RequireRoot(t)
	dir := t.TempDir()
	hosts := filepath.Join(dir, "hosts")
	write := func(path, text string) {
		t.Helper()
		if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write(hosts, "127.0.0.2 svc.test\n")
	pol := filepath.Join(dir, "policy.yaml")
	write(pol, "rules:\n  - name: svc\n    destination: svc.test\n    concurrency: 3\n")
	socket := filepath.Join(dir, "sock")

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- Run(ctx, Config{
			PolicyFile: pol, Cgroup: privtest.Cgroup(t, "ttl"), PinDir: privtest.PinDir(t), Socket: socket,
			StateDir: filepath.Join(dir, "state"), DetachOnExit: true, Logger: slog.New(slog.DiscardHandler),
			// The hosts file answers with a TTL of MaxTTL here; no DNS
			// server is asked (a closed loopback port stands in).
			Resolver: &dns.Resolver{HostsFile: hosts, Servers: []string{"127.0.0.1:1"}, MinTTL: time.Second, MaxTTL: time.Second},
		})
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("run: %v", err)
		}
	})

	c := &control.Client{Socket: socket, Timeout: time.Second}
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

	write(hosts, "127.0.0.3 svc.test\n127.0.0.4 svc.test\n")
	wait("127.0.0.3/32", "127.0.0.4/32")

	// The name vanishes from the hosts file and the DNS server does not
	// answer: the rule keeps its addresses.
	write(hosts, "")
	time.Sleep(2500 * time.Millisecond)
	if got := dests(); !slices.Equal(got, []string{"127.0.0.3/32", "127.0.0.4/32"}) {
		t.Fatalf("after a failed lookup: destinations %v", got)
	}
}
