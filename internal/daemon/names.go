package daemon

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
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
	dir      string // the state directory, where saved is kept
	log      *slog.Logger

	mu    sync.Mutex
	hosts map[string]hostEntry
	// held counts, by host, the changes of the table that looked the name
	// up and have yet to apply: keep must not forget what they will plan
	// with, or their rule is planned pending and leaves the kernel.
	// (Making each change's lookups and apply one at a time would do too,
	// but then a `limit set` would wait seconds behind a reload's DNS.)
	held map[string]int

	// The lookups of the refresh loop go on in the background, so that a
	// name whose servers do not answer (seconds a lookup) holds back no
	// other name's change: inflight are their names, which changes do not
	// look up again; moved is set when one resolved to other addresses,
	// for the loop's next tick to apply.
	inflight   map[string]bool
	background sync.WaitGroup
	slots      chan struct{}
	moved      atomic.Bool

	// saveMu makes saves one at a time; saved is the file's text as last
	// written or read, so that a save that would change nothing is not
	// written.
	saveMu sync.Mutex
	saved  []byte
	// unsaved is set while the last save failed (a full disk): the refresh
	// loop tries again, for addresses that move seldom would otherwise
	// stay unsaved until they next move.
	unsaved atomic.Bool
	// unread is set when restore could not read the last run's file
	// (missing or corrupt): a name with no addresses may then have had
	// some, which adopted may give it.
	unread bool
}

// hostEntry is what a host name resolved to, until when.
type hostEntry struct {
	addrs   []netip.Addr
	expires time.Time
}

// nameUse is a host name one rule uses.
type nameUse struct{ rule, host string }

func newNames(r *dns.Resolver, dir string, log *slog.Logger) *names {
	return &names{
		resolver: r, dir: dir, log: log, hosts: map[string]hostEntry{}, held: map[string]int{},
		inflight: map[string]bool{}, slots: make(chan struct{}, lookupsAtOnce),
	}
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

// lookupsAtOnce bounds the lookups resolve has in flight, and those of
// resolveBackground: a start or reload of many names during a DNS outage
// (2 s per nameserver, up to 3, each) then waits about as long as one
// lookup per lookupsAtOnce names, not one per name.
const lookupsAtOnce = 16

// resolve looks up each name of uses never looked up or whose TTL ran out
// at now, up to lookupsAtOnce at a time, and saves the addresses if any
// resolved to other addresses than before (in any order). A failed lookup
// must not lift a limit: the addresses last resolved stay (by this run,
// or by the one before, which restore read), and the name is asked again
// after the resolver's retry time. A name the background is looking up is
// left to it: it sets moved when done.
func (n *names) resolve(ctx context.Context, uses []nameUse, now time.Time) {
	var (
		wg    sync.WaitGroup
		moved atomic.Bool
		slots = make(chan struct{}, lookupsAtOnce)
	)
	for _, u := range n.due(uses, now, false) {
		slots <- struct{}{}
		wg.Go(func() {
			defer func() { <-slots }()
			n.lookup(ctx, u, now, &moved)
		})
	}
	wg.Wait()
	if moved.Load() {
		n.save()
	}
}

// resolveBackground starts resolve's lookups and returns: each, once done,
// sets moved if its name resolved to other addresses. wait joins them.
func (n *names) resolveBackground(ctx context.Context, uses []nameUse, now time.Time) {
	for _, u := range n.due(uses, now, true) {
		n.background.Go(func() {
			n.slots <- struct{}{}
			defer func() { <-n.slots }()
			n.lookup(ctx, u, now, &n.moved)
			n.mu.Lock()
			delete(n.inflight, u.host)
			n.mu.Unlock()
		})
	}
}

// takeMoved reports whether a background lookup moved a name since the
// last call, and then saves the addresses; it also saves them again if
// the last save failed.
func (n *names) takeMoved() bool {
	moved := n.moved.Swap(false)
	if moved || n.unsaved.Load() {
		n.save()
	}
	return moved
}

func (n *names) wait() { n.background.Wait() }

// due returns each name of uses, once, never looked up or whose TTL ran
// out at now, and not being looked up in the background; background marks
// them as being so.
func (n *names) due(uses []nameUse, now time.Time, background bool) []nameUse {
	var due []nameUse
	seen := map[string]bool{}
	n.mu.Lock()
	defer n.mu.Unlock()
	for _, u := range uses {
		if h, ok := n.hosts[u.host]; (ok && now.Before(h.expires)) || seen[u.host] || n.inflight[u.host] {
			continue
		}
		seen[u.host] = true
		if background {
			n.inflight[u.host] = true
		}
		due = append(due, u)
	}
	return due
}

// lookup looks u's host name up and keeps what it resolved to, setting
// moved if that differs from before: together with the addresses, so that
// whoever sees them (a refresh reading them, then taking the move) sees
// the move too.
func (n *names) lookup(ctx context.Context, u nameUse, now time.Time, moved *atomic.Bool) {
	n.mu.Lock()
	h, ok := n.hosts[u.host]
	n.mu.Unlock()
	addrs, ttl, err := n.resolver.Lookup(ctx, u.host)
	var partial *dns.PartialError
	switch {
	case ctx.Err() != nil:
		// Cut short by the caller (a client's timeout, the daemon
		// stopping): no answer, not a failed one to wait out.
		return
	case errors.As(err, &partial):
		for _, a := range h.addrs {
			if partial.Unanswered(a) {
				addrs = append(addrs, a)
			}
		}
		slices.SortFunc(addrs, netip.Addr.Compare)
		n.log.Warn("host lookup answered for one address family; keeping the other's last addresses", "rule", u.rule, "host", u.host, "err", err, "addresses", len(addrs))
	case err != nil:
		addrs = h.addrs
		n.log.Warn("host lookup failed; keeping the last addresses", "rule", u.rule, "host", u.host, "err", err, "addresses", len(addrs))
	}
	n.mu.Lock()
	n.hosts[u.host] = hostEntry{addrs: addrs, expires: now.Add(ttl)}
	if !ok || !sameAddrs(addrs, h.addrs) {
		moved.Store(true)
	}
	n.mu.Unlock()
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

// adoptNames gives each host name of rules that has no addresses, when
// the last run's were not read, those the previous daemon's kernel rule
// of the same name and port enforces: with the saved file lost and DNS
// down, the rule would otherwise go pending at the restart and its limit
// be lifted. A file that was read and lacks the name says the name is new
// to the rule, whose kernel rule then holds another destination's. Only
// for the first table of a daemon that adopted a pinned datapath.
func (t *table) adoptNames(rules ...[]policy.Rule) {
	if !t.names.unread {
		return
	}
	for _, rs := range rules {
		for _, r := range rs {
			host, ok := r.Destination.Host()
			if !ok || len(t.names.addrs(host)) > 0 {
				continue
			}
			kr, err := t.dp.Rule(r.Name)
			if err != nil || kr.Port != r.Port {
				continue
			}
			var addrs []netip.Addr
			for _, p := range kr.Dests {
				if p.IsSingleIP() {
					addrs = append(addrs, p.Addr().Unmap())
				}
			}
			if len(addrs) > 0 && t.names.adopt(host, addrs) {
				t.log.Warn("host name not resolved and no saved addresses: keeping those its pinned rule enforces until it resolves", "rule", r.Name, "host", host, "addresses", len(addrs))
			}
		}
	}
}

// adopt gives host addrs if it has none, reporting whether it did. When
// the name is looked up again stays as it was.
func (n *names) adopt(host string, addrs []netip.Addr) bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	h := n.hosts[host]
	if len(h.addrs) > 0 {
		return false
	}
	h.addrs = addrs
	n.hosts[host] = h
	return true
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

// The addresses each host name last resolved to are saved in the state
// directory, so that a daemon started during a DNS outage enforces its
// host-name rules with them rather than leaving them pending. They are
// found by host, never by rule: a rule whose destination changed to a
// name that does not resolve must not keep the old destination's.
type savedNames struct {
	Hosts map[string][]netip.Addr `json:"hosts"`
}

func namesPath(dir string) string { return filepath.Join(dir, "names.json") }

// restore takes the addresses the last run saved as what each host last
// resolved to, due for a lookup at once. The file only helps a start
// during an outage, so a missing or unreadable one is logged, not fatal.
func (n *names) restore() {
	path := namesPath(n.dir)
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		n.log.Info("no saved host addresses: a host name that does not resolve now stays pending unless a pinned rule has its addresses", "file", path)
		n.unread = true
		return
	}
	var f savedNames
	if err == nil {
		err = json.Unmarshal(b, &f)
	}
	for host, addrs := range f.Hosts {
		if err == nil && slices.ContainsFunc(addrs, func(a netip.Addr) bool { return !a.IsValid() }) {
			err = fmt.Errorf("host %s: an empty address", host)
		}
	}
	if err != nil {
		n.log.Warn("saved host addresses not read: a host name that does not resolve now stays pending unless a pinned rule has its addresses", "file", path, "err", err)
		n.unread = true
		return
	}
	n.mu.Lock()
	for host, addrs := range f.Hosts {
		n.hosts[host] = hostEntry{addrs: addrs}
	}
	n.mu.Unlock()
	n.saveMu.Lock()
	n.saved = b
	n.saveMu.Unlock()
}

// save writes the addresses of every host name that has some, sorted so
// that a new order of the same addresses writes nothing. A failure is
// logged: the rules are enforced all the same.
func (n *names) save() {
	n.saveMu.Lock()
	defer n.saveMu.Unlock()
	f := savedNames{Hosts: map[string][]netip.Addr{}}
	n.mu.Lock()
	for host, h := range n.hosts {
		if len(h.addrs) > 0 {
			f.Hosts[host] = slices.SortedFunc(slices.Values(h.addrs), netip.Addr.Compare)
		}
	}
	n.mu.Unlock()
	b, err := json.Marshal(f)
	if err == nil && bytes.Equal(b, n.saved) {
		return
	}
	if err == nil {
		err = makeDir(n.dir)
	}
	if err == nil {
		err = writeAtomic(n.dir, namesPath(n.dir), b)
	}
	if err != nil {
		if !n.unsaved.Swap(true) {
			n.log.Warn("saving host addresses; trying again each refresh", "err", err)
		}
		return
	}
	if n.unsaved.Swap(false) {
		n.log.Info("host addresses saved")
	}
	n.saved = b
}
