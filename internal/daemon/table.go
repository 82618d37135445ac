package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/egressd/egressd/pkg/adaptive"
	"github.com/egressd/egressd/pkg/control"
	"github.com/egressd/egressd/pkg/loader"
	"github.com/egressd/egressd/pkg/policy"
	"github.com/egressd/egressd/pkg/shared/redisurl"
)

// table is the rule table: the rules in force (the policy file's, with
// the changes made at run time), each with the kernel rule that enforces
// it, or why it is not in the kernel yet. Every change is planned whole
// and written in one Sync, so it applies whole or not at all; what it needs
// from outside (the cgroups of scopes, the addresses of host names) is
// found before the table's lock is taken, and no lock is held across a DNS
// or Redis call.
type table struct {
	cfg   *Config
	log   *slog.Logger
	dp    datapath // set once the datapath is open, before the first change
	names *names
	redis *redisClients

	// mu guards the table and what was applied: the entries in force, the
	// policy and overrides they came from, the last load.
	mu     sync.Mutex
	policy *policy.Policy
	// overrides are the run-time limits as saved; applied are those in
	// force, which differ only after a conflict at start.
	overrides overrides
	applied   overrides
	// kube are the rules of the EgressLimits that select this node's
	// pods; refused the objects left out of them, with why, and
	// kubeChanged has a value when a change left out others.
	kube        kubeRules
	refused     map[string]string
	kubeChanged chan struct{}
	entries     map[string]*entry
	// order is entries in the order they were applied, where the next
	// apply looks for each rule first.
	order []*entry
	// reload is the last load of the policy file, as status shows it.
	reload control.Reload
	// heldBack says the start applied the file without the run-time
	// limits, which conflicted with it: reload says so until a change
	// puts them all in force.
	heldBack bool
	// What entries were planned with (the cgroups of scopes) and views of
	// them, so that loops that tick often do not walk or plan again a table
	// of 100,000 rules: the host names its rules use, and its installed
	// adaptive rules.
	scopes map[policy.Scope]scoped
	// scopesGen counts the times the table took other scopes' cgroups.
	scopesGen uint64
	uses      []nameUse
	adaptive  []*entry
	// adaptiveAdded has a value once an apply leaves adaptive rules, for
	// watchSaturation to wait on while there are none.
	adaptiveAdded chan struct{}
}

func newTable(cfg *Config, names *names, redis *redisClients, log *slog.Logger) *table {
	return &table{cfg: cfg, log: log, names: names, redis: redis, entries: map[string]*entry{}, adaptiveAdded: make(chan struct{}, 1), kubeChanged: make(chan struct{}, 1)}
}

// entry is one rule in force.
type entry struct {
	spec   *policy.Rule // the policy's or the overrides', never changed in place
	source string
	// kernel is the rule as installed; pending says why it is not. base
	// is, for a shared rule, the kernel rule the policy gives, before the
	// share shapes it.
	kernel  loader.Rule
	base    *loader.Rule
	pending string
	ctrl    *adaptive.Controller
	share   share

	// The rule's text, written the first time it is asked for. A table
	// of 100,000 entries is allocated at start and on every reload: what
	// most never need is kept out of it.
	written atomic.Pointer[ruleText]
}

type ruleText struct {
	text string
	err  error
}

func (e *entry) installed() bool { return e.pending == "" }

// text is the rule as the policy file would have it, written once: the
// list of every rule asks it of each.
func (e *entry) text() (string, error) {
	w := e.written.Load()
	if w == nil {
		text, err := format(*e.spec)
		w = &ruleText{text, err}
		e.written.Store(w)
	}
	return w.text, w.err
}

// readerText is text with the passwords of a shared rule's Redis URL
// hidden, for callers who may read but not write: a writer needs them
// whole, to set the rule again as it was.
func (e *entry) readerText() (string, error) {
	if e.spec.Shared.Redis == "" {
		return e.text()
	}
	spec := *e.spec
	spec.Shared.Redis = redisurl.Redact(spec.Shared.Redis)
	return format(spec)
}

// format writes one rule as the policy file would have it.
func format(r policy.Rule) (string, error) {
	b, err := policy.Format(&policy.Policy{Rules: []policy.Rule{r}})
	return strings.TrimPrefix(string(b), "rules:\n"), err
}

// sharedRate is, for a shared rate, its kernel rule as the policy gives
// it (the whole budget's rate and shape); nil for any other rule. The
// kernel's rule grants permits and has no rate of its own, so the CLI
// and the metrics show this one.
func (e *entry) sharedRate() *loader.Rule {
	if e.share != nil && e.share.rate() {
		return e.base
	}
	return nil
}

// limitShown is the limit the CLI reports, given the kernel's.
func (e *entry) limitShown(kernel uint32) uint32 {
	if r := e.sharedRate(); r != nil {
		return r.Limit
	}
	return kernel
}

var errUnknownRule = errors.New("no such rule")

// match returns the table's order and the places in it of the rules p
// picks, with how many rules the kernel has. The order is replaced, never
// written in place, and a rule's name is its spec's, which never changes:
// the places can be ranked by name outside the lock.
func (t *table) match(p pick) (order []*entry, places []int, installed int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for i, e := range t.order {
		if e.installed() {
			installed++
		}
		if p.matches(viewedLocked(e.spec.Name, e)) {
			places = append(places, i)
		}
	}
	return t.order, places, installed
}

// viewsAt is the rules at places in order, a table's order match returned,
// as the views read them now.
func (t *table) viewsAt(order []*entry, places []int) []viewed {
	t.mu.Lock()
	defer t.mu.Unlock()
	rows := make([]viewed, len(places))
	for i, at := range places {
		rows[i] = viewedLocked(order[at].spec.Name, order[at])
	}
	return rows
}

// size is how many rules the table has.
func (t *table) size() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.entries)
}

// describe fills in what status says of the table: its rules, those
// pending and shared, the shared ones whose Redis is unreachable or whose
// growth is frozen, and the last load of the policy file.
func (t *table) describe(s *control.Status) {
	t.mu.Lock()
	defer t.mu.Unlock()
	s.Rules, s.LastReload = len(t.entries), t.reload
	for name, e := range t.entries {
		if !e.installed() {
			s.Pending++
		}
		if e.share != nil {
			s.Shared++
			v := e.share.view()
			if v.outage.Failing() {
				s.Unreachable = append(s.Unreachable, name)
			}
			if v.frozen {
				s.Frozen = append(s.Frozen, name)
			}
		}
	}
	slices.Sort(s.Unreachable)
	slices.Sort(s.Frozen)
}

// viewOf is the rule named name as the views read it; false if the table
// has none.
func (t *table) viewOf(name string) (viewed, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e, ok := t.entries[name]
	if !ok {
		return viewed{}, false
	}
	return viewedLocked(name, e), true
}

// shapeOf is the shape of the rule named name as the policy gives it;
// false if the table has none.
func (t *table) shapeOf(name string) (string, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e, ok := t.entries[name]
	if !ok {
		return "", false
	}
	return shapeName(e), true
}

// found is what a change of the table needs from outside it, found before
// its lock is taken at now: the cgroup of each scope, looked for when the
// table's scopes were at generation gen. (Host names' addresses are
// t.names', which holds those of uses until the change is done.) more is
// the rules it was found for besides those in force.
type found struct {
	now    time.Time
	scopes map[policy.Scope]scoped
	gen    uint64
	uses   []nameUse
	more   []policy.Rule
}

// prepare looks up, outside the table's lock, what installing the rules in
// force and more needs at now: host names due for a lookup, and scopes'
// cgroups.
func (t *table) prepare(ctx context.Context, now time.Time, more ...policy.Rule) found {
	t.mu.Lock()
	// The policy's and the overrides' rules are replaced, never written
	// in place, so they are read outside the lock; joining them would
	// copy 100,000 rules for nothing.
	var inForce []policy.Rule
	if t.policy != nil {
		inForce = t.policy.Rules
	}
	rules := [][]policy.Rule{inForce, t.overrides.Set, t.kube.rules, more}
	enforced, gen := t.scopes, t.scopesGen // scopes is replaced, never written in place
	first := t.policy == nil
	t.mu.Unlock()
	if first && t.dp.Adopted() {
		// No table yet: what is enforced now is what the previous
		// daemon left in the kernel.
		enforced = t.adoptedScopes(rules...)
	}
	uses := usesOf(rules...)
	t.names.hold(uses)
	t.names.resolve(ctx, uses, now)
	if first && t.dp.Adopted() {
		t.adoptNames(rules...)
	}
	return found{now: now, scopes: scopes(t.cfg.Cgroup, enforced, rules...), gen: gen, uses: uses, more: more}
}

// retired is a share the table no longer has, to end once its lock is
// released (its loop may be waiting for the lock); release hands its slots
// back, unless the same budget is still the rule's, all but the live
// connections its kernel rule held (see share.end).
type retired struct {
	share   share
	release bool
	live    int
}

// change runs fn, a change of the table with f, what prepare found, under
// the table's lock, unless ctx ended, lets go of f's host names, then ends
// the shares fn retired. If the table took other scopes' cgroups since f
// was found (a reload or refresh ran meanwhile), f may hold a restarted
// unit's old cgroup, so it is found again.
func (t *table) change(ctx context.Context, f found, fn func(found) ([]retired, error)) error {
	t.mu.Lock()
	for f.gen != t.scopesGen {
		t.names.release(f.uses)
		t.mu.Unlock()
		f = t.prepare(ctx, f.now, f.more...)
		t.mu.Lock()
	}
	if err := ctx.Err(); err != nil {
		// The caller gave up (its lookups were cut short and found
		// nothing): a change it was told failed must not be made.
		t.names.release(f.uses)
		t.mu.Unlock()
		return err
	}
	gone, err := fn(f)
	t.names.release(f.uses)
	t.mu.Unlock()
	for _, r := range gone {
		r.share.end(r.release, r.live)
	}
	return err
}

// applyLocked makes the rules p and o give the table: it checks them,
// plans each one's kernel rule with f, writes them all in one Sync, and
// takes the new table. On any problem nothing changes. Call with t.mu
// held.
func (t *table) applyLocked(p *policy.Policy, o overrides, f found) ([]retired, error) {
	c, err := t.planLocked(p, o, t.kube, f)
	if err != nil {
		return nil, err
	}
	return t.writeLocked(c)
}

// tableChange is a new table, planned and checked, not yet in force.
// Until writeLocked takes it, dropping it leaves the table as it was: its
// new adaptive loops and shares have not started, and it shares the old
// ones without changing them.
type tableChange struct {
	p       *policy.Policy
	o       overrides
	k       kubeRules
	refused map[string]string // the EgressLimits left out of k
	f       found
	rules   []policy.Rule
	merged  []*entry
	next    map[string]*entry
	kernel  []loader.Rule
	changes ruleChanges
	partial []clash // destinations installed rules go without
}

// planLocked checks the rules p, o and k give and plans each one's
// kernel rule with f. p is a policy policy.Parse returned, which passed
// the checks, so they run again only when o or k set rules, which can
// clash with p's or each other's (removing rules cannot make a clash):
// the checks are dear for a large policy. The kernel's rule tables are
// resized if the rules need it. Call with t.mu held.
func (t *table) planLocked(p *policy.Policy, o overrides, k kubeRules, f found) (*tableChange, error) {
	c := &tableChange{p: p, o: o, k: k, f: f}
	if err := c.merge(); err != nil {
		return nil, err
	}
	c.next = make(map[string]*entry, len(c.merged))
	c.kernel = make([]loader.Rule, 0, len(c.merged))
	for i, e := range c.merged {
		old := t.previous(i, e.spec.Name)
		if err := t.plan(e, old, f); err != nil {
			return nil, fmt.Errorf("rule %s: %w", e.spec.Name, err)
		}
	}
	c.partial = t.settleClashesLocked(c.merged)
	for i, e := range c.merged {
		c.next[e.spec.Name] = e
		c.changes.count(t.previous(i, e.spec.Name), e)
		if e.installed() {
			c.kernel = append(c.kernel, e.kernel)
		}
	}
	if err := t.fitTables(p, c.kernel); err != nil {
		return nil, err
	}
	return c, nil
}

// writeLocked writes c to the kernel in one Sync and takes it as the
// table; if the kernel refuses, nothing changes. Call with t.mu held.
func (t *table) writeLocked(c *tableChange) ([]retired, error) {
	// The shares this change retires, with what their kernel rules hold,
	// read before the Sync removes those rules.
	var gone []retired
	for name, old := range t.entries {
		if old.share == nil {
			continue // most rules: no need to look up the new table
		}
		if n := c.next[name]; n == nil || n.share != old.share {
			r := retired{share: old.share, release: n == nil || n.share == nil || !old.share.sameBudget(n.share)}
			if r.release && old.pending == "" && !old.share.rate() {
				r.live = -1
				if live, err := t.dp.Live(name); err == nil {
					r.live = int(live)
				}
			}
			gone = append(gone, r)
		}
	}
	if err := t.dp.Sync(c.kernel); err != nil {
		return nil, err
	}
	t.logChanges(c.changes, c.merged, t.entries, c.next)
	for _, cl := range c.partial {
		t.log.Warn("destination left to another rule", "rule", cl.rule, "reason", cl.String())
	}
	for _, e := range c.next {
		if e.share != nil {
			e.share.start()
		}
	}
	if !maps.Equal(t.scopes, c.f.scopes) {
		t.scopesGen++
	}
	t.policy, t.applied, t.entries, t.order, t.scopes = c.p, c.o, c.next, c.merged, c.f.scopes
	if t.kube = c.k; !maps.Equal(t.refused, c.refused) {
		t.refused = c.refused
		select {
		case t.kubeChanged <- struct{}{}:
		default:
		}
	}
	t.uses, t.adaptive = usesOf(c.rules), nil
	for _, e := range c.merged {
		if e.ctrl != nil && e.installed() {
			t.adaptive = append(t.adaptive, e)
		}
	}
	if len(t.adaptive) > 0 {
		select {
		case t.adaptiveAdded <- struct{}{}: // wakes watchSaturation
		default:
		}
	}
	t.names.keep(t.uses)
	return gone, nil
}

// previous is the table's entry of the rule named name, or nil, looked for
// first at i in the order the table was applied: a reload of a policy
// whose rules kept their places walks the old entries in turn rather than
// looking each one up in the map.
func (t *table) previous(i int, name string) *entry {
	if i < len(t.order) && t.order[i].spec.Name == name {
		return t.order[i]
	}
	return t.entries[name]
}

func specs(es []*entry) []policy.Rule {
	out := make([]policy.Rule, len(es))
	for i, e := range es {
		out[i] = *e.spec
	}
	return out
}

// plan fills e from e.spec: its kernel rule, or why it is pending (its
// unit or cgroup does not exist, its host name has no addresses). An
// unchanged rule keeps old's adaptive loop and share; a new shared rule
// gets a share, which carries on old's or what the kernel holds.
func (t *table) plan(e, old *entry, f found) error {
	if old != nil && *old.spec == *e.spec {
		e.ctrl, e.share = old.ctrl, old.share
	}
	if e.spec.IsShared() && e.share == nil {
		s, err := t.newShare(*e.spec, f.now)
		if err != nil {
			return err
		}
		t.carryShare(s, old)
		e.share = s
	}
	sc, ok := f.scopes[e.spec.Scope]
	if !ok {
		sc.scope, sc.pending = scopeOf(t.cfg.Cgroup, e.spec.Scope, t.scopes) // set after prepare looked
	}
	if e.pending = sc.pending; e.pending != "" {
		return nil
	}
	var addrs []netip.Addr
	if host, ok := e.spec.Destination.Host(); ok {
		if addrs = t.names.addrs(host); len(addrs) == 0 {
			e.pending = fmt.Sprintf("host %s has no addresses yet", host)
			return nil
		}
	}
	e.kernel = e.spec.LoaderRule(sc.scope, addrs)
	if e.kernel.FlowIdle == 0 && e.kernel.Protocols.Has(loader.ProtoUDP) {
		e.kernel.FlowIdle = t.cfg.UDPIdle
	}
	if len(e.kernel.Dests) == 0 {
		e.pending = "host name has no addresses"
		return nil
	}
	if e.share != nil {
		base := e.kernel
		e.base = &base
		e.share.shape(&e.kernel)
	}
	if a, ok := e.spec.Limit.(policy.Adaptive); ok {
		if e.ctrl == nil {
			ctrl, err := t.newController(e.spec.Name, a, t.resumeAt(e.spec.Name, old))
			if err != nil {
				return err
			}
			e.ctrl = ctrl
		}
		e.kernel.Limit = uint32(e.ctrl.Limit())
	}
	return nil
}

// carryShare starts a new share where the rule's old one left off, when
// they spend the same budget; a rule new to this daemon starts from the
// kernel rule a previous daemon left pinned.
func (t *table) carryShare(s share, old *entry) {
	switch {
	case old != nil && old.share != nil && old.share.sameBudget(s):
		s.inherit(old.share)
	case old == nil:
		if kr, err := t.dp.Rule(s.name()); err == nil {
			if st, err := t.dp.Stats(s.name()); err == nil {
				s.adopt(kr, st)
			}
		}
	}
}

// ruleChanges counts what a change of the table does to the rules it had,
// as the change plans each rule: a table of 100,000 rules is not walked
// again to find the few that changed.
type ruleChanges struct{ added, changed, same int }

// count notes e, which was old (nil: a rule new to the table).
func (c *ruleChanges) count(old, e *entry) {
	switch {
	case old == nil:
		c.added++
	case ruleChanged(old, e):
		c.changed++
	default:
		c.same++
	}
}

func ruleChanged(old, e *entry) bool { return *old.spec != *e.spec || old.pending != e.pending }

// logChanges writes one line per rule added, changed or removed when the
// table went from old to next, the entries merged: past logChangesEach
// changes, one line counts them and each goes to Debug, since a policy of
// 100,000 rules would take seconds to log line by line.
func (t *table) logChanges(c ruleChanges, merged []*entry, old, next map[string]*entry) {
	removed := len(old) - c.changed - c.same
	ctx, level := context.Background(), slog.LevelInfo
	if c.added+c.changed+removed > logChangesEach {
		t.log.Info("rules changed", "added", c.added, "changed", c.changed, "removed", removed)
		level = slog.LevelDebug
	}
	if !t.log.Enabled(ctx, level) {
		return
	}
	for _, e := range merged {
		switch o := old[e.spec.Name]; {
		case o == nil:
			t.log.Log(ctx, level, "rule added", "rule", e.spec.Name, "source", e.source, "pending", e.pending)
		case ruleChanged(o, e):
			t.log.Log(ctx, level, "rule changed", "rule", e.spec.Name, "source", e.source, "pending", e.pending)
		}
	}
	if removed == 0 {
		return
	}
	for name := range old {
		if _, ok := next[name]; !ok {
			t.log.Log(ctx, level, "rule removed", "rule", name)
		}
	}
}

// logChangesEach is how many rule changes are logged one line each.
const logChangesEach = 100

// install makes p, a policy policy.Parse returned, with the run-time
// changes, the rule set at now: at start and on a reload. On any problem
// nothing changes.
func (t *table) install(ctx context.Context, p *policy.Policy, now time.Time) error {
	return t.change(ctx, t.prepare(ctx, now, p.Rules...), func(f found) ([]retired, error) {
		gone, err := t.applyLocked(p, t.overrides, f)
		if err == nil && t.reload.Time.IsZero() {
			t.reload = control.Reload{Time: now, OK: true}
		}
		if err == nil {
			t.heldBack = false
		}
		return gone, err
	})
}

// holdBackOverrides makes p alone, less the rules removed at run time,
// the rule set, when p with the run-time limits could not be (err): at
// start, so that a daemon whose file changed while it was down starts
// rather than not at all. The run-time limits stay on disk, and the last
// load says they were held back until a change puts them in force. It
// returns err when there are no run-time limits to hold back.
func (t *table) holdBackOverrides(ctx context.Context, p *policy.Policy, err error, now time.Time) error {
	if len(t.overrides.Set) == 0 {
		return err
	}
	return t.change(ctx, t.prepare(ctx, now, p.Rules...), func(f found) ([]retired, error) {
		gone, ferr := t.applyLocked(p, overrides{Removed: t.overrides.Removed}, f)
		if ferr != nil {
			return gone, errors.Join(err, ferr)
		}
		t.reload = control.Reload{Time: now, Error: "run-time limits not applied: " + err.Error()}
		t.heldBack = true
		t.log.Error("run-time limits conflict with the policy; running with the policy less the rules removed at run time", "err", err)
		return gone, nil
	})
}

// loaded keeps r as the last load of the policy file.
func (t *table) loaded(r control.Reload) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.reload = r
}

// startProblem adds what the start could not do as it should to the
// last load, which a reload that succeeds clears.
func (t *table) startProblem(msg string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.reload.Error != "" {
		msg = t.reload.Error + "; " + msg
	}
	t.reload = control.Reload{Time: time.Now(), Error: msg}
}

// set sets a rule at run time, at now, and keeps it in the state
// directory.
func (t *table) set(ctx context.Context, r policy.Rule, now time.Time) error {
	return t.change(ctx, t.prepare(ctx, now, r), func(f found) ([]retired, error) {
		return t.commitLocked(t.overrides.with(r), f)
	})
}

// remove removes a rule at run time, at now, and keeps that in the state
// directory.
func (t *table) remove(ctx context.Context, name string, now time.Time) error {
	return t.change(ctx, t.prepare(ctx, now), func(f found) ([]retired, error) {
		e, known := t.entries[name]
		if known && strings.HasPrefix(e.source, policy.KubePrefix) {
			return nil, fmt.Errorf("rule %s: %w %s", name, errKubeRule, strings.TrimPrefix(e.source, policy.KubePrefix))
		}
		if !known && !slices.ContainsFunc(t.overrides.Set, func(x policy.Rule) bool { return x.Name == name }) {
			return nil, errUnknownRule
		}
		inPolicy := slices.ContainsFunc(t.policy.Rules, func(x policy.Rule) bool { return x.Name == name })
		return t.commitLocked(t.overrides.without(name, inPolicy), f)
	})
}

// commitLocked applies new overrides and saves them, or changes nothing.
// They are saved once the change is planned and checked but before the
// kernel has it: a state directory that cannot be written, the likely
// failure, then leaves the kernel and the table untouched, and no unsaved
// change is ever in force. If the kernel then refuses the change, or the
// save fails after its rename, the old overrides are saved back.
func (t *table) commitLocked(o overrides, f found) ([]retired, error) {
	c, err := t.planLocked(t.policy, o, t.kube, f)
	if err != nil {
		return nil, err
	}
	if err := o.save(t.cfg.StateDir); err != nil {
		if errors.Is(err, errUnsynced) {
			t.saveBack()
		}
		return nil, err
	}
	gone, err := t.writeLocked(c)
	if err != nil {
		t.saveBack()
		return nil, err
	}
	t.overrides = o
	if t.heldBack {
		// Every run-time limit is in force now, with the file the start
		// loaded: that load is applied whole at last.
		t.heldBack = false
		t.reload = control.Reload{Time: t.reload.Time, OK: true}
		t.log.Info("run-time limits applied with the policy")
	}
	return gone, nil
}

// saveBack saves the overrides in force over a refused change's.
func (t *table) saveBack() {
	if err := t.overrides.save(t.cfg.StateDir); err != nil {
		t.log.Error("saving back the run-time limits in force", "err", err)
	}
}

// refreshLoop looks host names up again when their TTLs run out, and
// units every Refresh (a restarted unit gets a new cgroup); either way the
// table is planned again.
func (t *table) refreshLoop(ctx context.Context) {
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	defer t.names.wait()
	last := time.Now()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			now := time.Now()
			units := now.Sub(last) >= t.cfg.Refresh
			t.refresh(ctx, now, units)
			if units {
				last = now
			}
		}
	}
}

// refresh starts looking up, in the background, the host names whose TTLs
// ran out at now and, with units, looks up the cgroups of scopes; if a
// name resolved to other addresses since the last refresh or a scope's
// cgroup moved, it applies the table again. A lookup that has not ended
// is not waited for: the next refresh applies what it finds.
func (t *table) refresh(ctx context.Context, now time.Time, units bool) {
	t.mu.Lock()
	uses := t.uses
	t.mu.Unlock()
	t.names.resolveBackground(ctx, uses, now)
	moved := t.names.takeMoved()
	if !moved && !units {
		return
	}
	err := t.change(ctx, t.prepare(ctx, now), func(f found) ([]retired, error) {
		if !moved && maps.Equal(f.scopes, t.scopes) {
			return nil, nil
		}
		return t.applyLocked(t.policy, t.applied, f)
	})
	if err != nil && ctx.Err() == nil {
		t.log.Error("refresh", "err", err)
	}
}
