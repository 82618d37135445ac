package daemon

import (
	"context"
	"log/slog"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/egressd/egressd/internal/dns"
	"github.com/egressd/egressd/pkg/policy"
)

// names owns the host names rules use as destinations: what each resolved
// to, and until when. Lookups (DNS) happen here, before the rule table's
// lock is taken, so a slow DNS server never stalls the API, the metrics or
// the event readers; the table reads the addresses as they stand.
type names struct {
	resolver *dns.Resolver
	log      *slog.Logger

	mu    sync.Mutex
	hosts map[string]hostEntry
	// held counts, by host, the changes of the table that looked the name
	// up and have yet to apply: keep must not forget what they will plan
	// with, or their rule is planned pending and leaves the kernel.
	// (Making each change's lookups and apply one at a time would do too,
	// but then a `limit set` would wait seconds behind a reload's DNS.)
	held map[string]int
}

// hostEntry is what a host name resolved to, until when.
type hostEntry struct {
	addrs   []netip.Addr
	expires time.Time
}

// nameUse is a host name one rule uses.
type nameUse struct{ rule, host string }

func newNames(r *dns.Resolver, log *slog.Logger) *names {
	return &names{resolver: r, log: log, hosts: map[string]hostEntry{}, held: map[string]int{}}
}

// usesOf returns the host names the rules use.
func usesOf(rules ...[]policy.Rule) []nameUse {
	var out []nameUse
	for _, rs := range rules {
		for _, r := range rs {
			if host, ok := r.Destination.Host(); ok {
				out = append(out, nameUse{r.Name, host})
			}
		}
	}
	return out
}

// lookupsAtOnce bounds the lookups resolve has in flight: a start or
// reload of many names during a DNS outage (2 s per nameserver, up to 3,
// each) then waits about as long as one lookup per lookupsAtOnce names,
// not one per name.
const lookupsAtOnce = 16

// resolve looks up each name of uses never looked up or whose TTL ran out
// at now, up to lookupsAtOnce at a time, and reports whether any resolved
// to other addresses than before (in any order): a table of many rules is
// planned again only then. A failed lookup must not lift a limit: the
// addresses last resolved stay, by this run or, for a name it never
// resolved, those the kernel enforces for the first rule that uses it
// (pinned by the daemon before; pinned says which), and the name is asked
// again after the resolver's retry time.
func (n *names) resolve(ctx context.Context, uses []nameUse, pinned func(rule string) []netip.Addr, now time.Time) (changed bool) {
	var due []nameUse
	seen := map[string]bool{}
	n.mu.Lock()
	for _, u := range uses {
		if h, ok := n.hosts[u.host]; (ok && now.Before(h.expires)) || seen[u.host] {
			continue
		}
		seen[u.host] = true
		due = append(due, u)
	}
	n.mu.Unlock()
	var (
		wg    sync.WaitGroup
		moved atomic.Bool
		slots = make(chan struct{}, lookupsAtOnce)
	)
	for _, u := range due {
		slots <- struct{}{}
		wg.Go(func() {
			defer func() { <-slots }()
			if n.lookup(ctx, u, pinned, now) {
				moved.Store(true)
			}
		})
	}
	wg.Wait()
	return moved.Load()
}

// lookup looks u's host name up and keeps what it resolved to, reporting
// whether that differs from before.
func (n *names) lookup(ctx context.Context, u nameUse, pinned func(rule string) []netip.Addr, now time.Time) (changed bool) {
	n.mu.Lock()
	h, ok := n.hosts[u.host]
	n.mu.Unlock()
	addrs, ttl, err := n.resolver.Lookup(ctx, u.host)
	if err != nil {
		addrs = h.addrs
		if len(addrs) == 0 {
			addrs = pinned(u.rule)
		}
		n.log.Warn("host lookup failed; keeping the last addresses", "rule", u.rule, "host", u.host, "err", err, "addresses", len(addrs))
	}
	n.mu.Lock()
	n.hosts[u.host] = hostEntry{addrs: addrs, expires: now.Add(ttl)}
	n.mu.Unlock()
	return !ok || !sameAddrs(addrs, h.addrs)
}

func sameAddrs(a, b []netip.Addr) bool {
	if len(a) != len(b) {
		return false
	}
	sorted := func(x []netip.Addr) []netip.Addr { return slices.SortedFunc(slices.Values(x), netip.Addr.Compare) }
	return slices.Equal(sorted(a), sorted(b))
}

// addrs returns what host last resolved to; nil before it did.
func (n *names) addrs(host string) []netip.Addr {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.hosts[host].addrs
}

// hold keeps the names of uses, a change's, from being forgotten until
// release.
func (n *names) hold(uses []nameUse) {
	n.mu.Lock()
	defer n.mu.Unlock()
	for _, u := range uses {
		n.held[u.host]++
	}
}

func (n *names) release(uses []nameUse) {
	n.mu.Lock()
	defer n.mu.Unlock()
	for _, u := range uses {
		if n.held[u.host]--; n.held[u.host] == 0 {
			delete(n.held, u.host)
		}
	}
}

// keep forgets the names no rule in uses has, and no change holds.
func (n *names) keep(uses []nameUse) {
	in := map[string]bool{}
	for _, u := range uses {
		in[u.host] = true
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	for host := range n.hosts {
		if !in[host] && n.held[host] == 0 {
			delete(n.hosts, host)
		}
	}
}
