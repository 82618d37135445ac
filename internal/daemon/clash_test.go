package daemon

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/egressd/egressd/internal/privtest"
	"github.com/egressd/egressd/pkg/cgroups"
)

// TestClashingRulesInstall: rules that pass the policy check but match the
// same traffic once host names are resolved (a name and its address, two
// names sharing one) are installed, the later one without what the earlier
// has; one left with nothing is pending and says whose it is.
func TestClashingRulesInstall(t *testing.T) {
	const hosts = "127.0.0.1 local.test\n::1 local.test\n127.0.0.2 a.test\n127.0.0.2 b.test\n127.0.0.5 b.test\n"
	tests := []struct {
		name   string
		policy string
		want   map[string]string
	}{{
		name:   "a name, then one of its addresses",
		policy: "rules:\n  - {name: by-name, destination: local.test, port: 9, concurrency: 4}\n  - {name: by-addr, destination: 127.0.0.1, port: 9, concurrency: 4}\n",
		want: map[string]string{
			"by-name": "127.0.0.1/32,::1/128 concurrency 4 (policy)",
			"by-addr": "pending: destination 127.0.0.1/32 port 9 is rule by-name's",
		},
	}, {
		name:   "an address, then a name that resolves to it",
		policy: "rules:\n  - {name: by-addr, destination: 127.0.0.1, port: 9, concurrency: 4}\n  - {name: by-name, destination: local.test, port: 9, concurrency: 4}\n",
		want: map[string]string{
			"by-addr": "127.0.0.1/32 concurrency 4 (policy)",
			"by-name": "::1/128 concurrency 4 (policy)",
		},
	}, {
		name:   "an address for any port, and a name that resolves to it",
		policy: "rules:\n  - {name: net, destination: 127.0.0.2, concurrency: 4}\n  - {name: a, destination: a.test, concurrency: 4}\n",
		want: map[string]string{
			"net": "127.0.0.2/32 concurrency 4 (policy)",
			"a":   "pending: destination 127.0.0.2/32 (any port) is rule net's",
		},
	}, {
		name:   "two names sharing an address",
		policy: "rules:\n  - {name: a, destination: a.test, port: 443, concurrency: 4}\n  - {name: b, destination: b.test, port: 443, concurrency: 4}\n",
		want: map[string]string{
			"a": "127.0.0.2/32 concurrency 4 (policy)",
			"b": "127.0.0.5/32 concurrency 4 (policy)",
		},
	}, {
		name:   "one name's every address is others'",
		policy: "rules:\n  - {name: four, destination: 127.0.0.1, concurrency: 4}\n  - {name: six, destination: \"::1\", concurrency: 4}\n  - {name: both, destination: local.test, concurrency: 4}\n",
		want: map[string]string{
			"four": "127.0.0.1/32 concurrency 4 (policy)",
			"six":  "::1/128 concurrency 4 (policy)",
			"both": "pending: destination 127.0.0.1/32 (any port) is rule four's; 1 more of its destinations are other rules' too",
		},
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			td := newTestDaemon(t)
			writeFile(t, td.hosts, hosts)
			td.apply(t, tt.policy)
			assertState(t, td.state(), tt.want)
		})
	}
}

func assertState(t *testing.T, got, want map[string]string) {
	t.Helper()
	for name, w := range want {
		if got[name] != w {
			t.Errorf("%s is %q, want %q", name, got[name], w)
		}
	}
}

// TestClashesFollowDNS: a host name that starts resolving to another
// rule's address loses that address, while the table goes on following
// every other name and taking changes; a rule in force keeps its address
// when a name earlier in the file moves onto it.
func TestClashesFollowDNS(t *testing.T) {
	td := newTestDaemon(t)
	ctx := context.Background()
	writeFile(t, td.hosts, "127.0.0.2 a.test\n127.0.0.3 b.test\n127.0.0.9 c.test\n")
	now := time.Now()
	td.applyAt(t, now, "rules:\n  - {name: a, destination: a.test, concurrency: 3}\n  - {name: b, destination: b.test, concurrency: 3}\n  - {name: c, destination: c.test, concurrency: 3}\n")
	refresh := func(hosts string) {
		t.Helper()
		td.setHosts(t, hosts)
		now = now.Add(time.Second + time.Millisecond) // past the names' TTL
		td.refreshAll(ctx, now, false)
	}

	refresh("127.0.0.2 a.test\n127.0.0.2 b.test\n127.0.0.10 c.test\n")
	assertState(t, td.state(), map[string]string{
		"a": "127.0.0.2/32 concurrency 3 (policy)",
		"b": "pending: destination 127.0.0.2/32 (any port) is rule a's",
		"c": "127.0.0.10/32 concurrency 3 (policy)",
	})
	if err := td.table.set(ctx, parse(t, "rules:\n  - {name: z, destination: 10.9.9.9, port: 443, concurrency: 3}\n").Rules[0], now); err != nil {
		t.Errorf("limit set of an unrelated rule: %v", err)
	}

	refresh("127.0.0.3 a.test\n127.0.0.3 b.test\n127.0.0.10 c.test\n")
	assertState(t, td.state(), map[string]string{
		"a": "127.0.0.3/32 concurrency 3 (policy)",
		"b": "pending: destination 127.0.0.3/32 (any port) is rule a's",
	})

	refresh("127.0.0.2 a.test\n127.0.0.3 b.test\n127.0.0.10 c.test\n")
	refresh("127.0.0.3 a.test\n127.0.0.3 b.test\n127.0.0.10 c.test\n")
	assertState(t, td.state(), map[string]string{
		"a": "pending: destination 127.0.0.3/32 (any port) is rule b's",
		"b": "127.0.0.3/32 concurrency 3 (policy)",
		"z": "10.9.9.9/32 concurrency 3 (cli)",
	})
}

// TestClashingCgroupSpellings: a cgroup written from the cgroup2 root and
// from the mount point is one scope in the kernel. (A unit and its
// cgroup's path are one too, found the same way; the policy check refuses
// them as written.)
func TestClashingCgroupSpellings(t *testing.T) {
	privtest.RequireHostRoot(t, "creates cgroups")
	dir := privtest.Cgroup(t, "clash")
	root, err := cgroups.Mount()
	if err != nil {
		t.Fatal(err)
	}
	td := newTestDaemon(t)
	td.apply(t, "rules:\n  - {name: short, destination: 10.0.0.1, port: 9, cgroup: "+strings.TrimPrefix(dir, root)+", concurrency: 4}\n"+
		"  - {name: long, destination: 10.0.0.1, port: 9, cgroup: "+dir+", concurrency: 4}\n")
	assertState(t, td.state(), map[string]string{
		"short": "10.0.0.1/32 concurrency 4 (policy)",
		"long":  "pending: destination 10.0.0.1/32 port 9 in the same cgroup is rule short's",
	})
}
