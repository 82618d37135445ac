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
	"sync/atomic"
	"time"

	"github.com/egressd/egressd/pkg/adaptive"
	"github.com/egressd/egressd/pkg/control"
	"github.com/egressd/egressd/pkg/loader"
	"github.com/egressd/egressd/pkg/policy"
	"github.com/egressd/egressd/pkg/shared/redisurl"
)

// The rule table: the rules in force (the policy file's, with the changes
// made at run time), each with the kernel rule that enforces it, or why it
// is not in the kernel yet. Every change is planned whole and written in
// one Sync, so it applies whole or not at all; what it needs from outside
// (the cgroups of scopes, the addresses of host names) is found before the
// table's lock is taken.

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

// found is what a change of the table needs from outside it, found before
// its lock is taken: the cgroup of each scope, looked for when the table's
// scopes were at generation gen. (Host names' addresses are d.names',
// which holds those of uses until the change is done.) more is the rules
// it was found for besides those in force.
type found struct {
	scopes map[policy.Scope]scoped
	gen    uint64
	uses   []nameUse
	more   []policy.Rule
}

// prepare looks up, outside the table's lock, what installing the rules in
// force and more needs: host names due for a lookup, and scopes' cgroups.
func (d *Daemon) prepare(ctx context.Context, more ...policy.Rule) found {
	d.mu.Lock()
	// The policy's and the overrides' rules are replaced, never written
	// in place, so they are read outside the lock; joining them would
	// copy 100,000 rules for nothing.
	var inForce []policy.Rule
	if d.policy != nil {
		inForce = d.policy.Rules
	}
	rules := [][]policy.Rule{inForce, d.overrides.Set, more}
	enforced, gen := d.scopes, d.scopesGen // scopes is replaced, never written in place
	first := d.policy == nil
	d.mu.Unlock()
	if first && d.dp.Adopted() {
		// No table yet: what is enforced now is what the previous
		// daemon left in the kernel.
		enforced = d.adoptedScopes(rules...)
	}
	uses := usesOf(rules...)
	d.names.hold(uses)
	d.names.resolve(ctx, uses, d.cfg.now())
	if first && d.dp.Adopted() {
		d.adoptNames(rules...)
	}
	return found{scopes: scopes(d.cfg.Cgroup, enforced, rules...), gen: gen, uses: uses, more: more}
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
// the table's lock, unless ctx ended, lets go of f's host names, then
// ends the shares fn retired. If the table took other scopes' cgroups since f was found (a
// reload or refresh ran meanwhile), f may hold a restarted unit's old
// cgroup, so it is found again.
func (d *Daemon) change(ctx context.Context, f found, fn func(found) ([]retired, error)) error {
	d.mu.Lock()
	for f.gen != d.scopesGen {
		d.names.release(f.uses)
		d.mu.Unlock()
		f = d.prepare(ctx, f.more...)
		d.mu.Lock()
	}
	if err := ctx.Err(); err != nil {
		// The caller gave up (its lookups were cut short and found
		// nothing): a change it was told failed must not be made.
		d.names.release(f.uses)
		d.mu.Unlock()
		return err
	}
	gone, err := fn(f)
	d.names.release(f.uses)
	d.mu.Unlock()
	for _, r := range gone {
		r.share.end(r.release, r.live)
	}
	return err
}

// applyLocked makes the rules p and o give the table: it checks them,
// plans each one's kernel rule with f, writes them all in one Sync, and
// takes the new table. On any problem nothing changes. Call with d.mu
// held.
func (d *Daemon) applyLocked(p *policy.Policy, o overrides, f found) ([]retired, error) {
	c, err := d.planLocked(p, o, f)
	if err != nil {
		return nil, err
	}
	return d.writeLocked(c)
}

// tableChange is a new table, planned and checked, not yet in force.
// Until writeLocked takes it, dropping it leaves the table as it was: its
// new adaptive loops and shares have not started, and it shares the old
// ones without changing them.
type tableChange struct {
	p       *policy.Policy
	o       overrides
	f       found
	rules   []policy.Rule
	merged  []*entry
	next    map[string]*entry
	kernel  []loader.Rule
	changes ruleChanges
	partial []clash // destinations installed rules go without
}

// planLocked checks the rules p and o give and plans each one's kernel
// rule with f. p is a policy policy.Parse returned, which passed the
// checks, so they run again only when o sets rules, which can clash with
// p's or each other's (removing rules cannot make a clash): checking
// 100,000 rules costs a tenth of a second. The kernel's rule tables are
// resized if the rules need it. Call with d.mu held.
func (d *Daemon) planLocked(p *policy.Policy, o overrides, f found) (*tableChange, error) {
	c := &tableChange{p: p, o: o, f: f, rules: p.Rules, merged: effective(p, o)}
	if len(o.Set) > 0 || len(o.Removed) > 0 {
		c.rules = specs(c.merged)
	}
	if len(o.Set) > 0 {
		if err := (&policy.Policy{Rules: c.rules}).Validate(); err != nil {
			return nil, err
		}
	}
	c.next = make(map[string]*entry, len(c.merged))
	c.kernel = make([]loader.Rule, 0, len(c.merged))
	for i, e := range c.merged {
		old := d.previous(i, e.spec.Name)
		if err := d.plan(e, old, f); err != nil {
			return nil, fmt.Errorf("rule %s: %w", e.spec.Name, err)
		}
	}
	c.partial = d.settleClashesLocked(c.merged)
	for i, e := range c.merged {
		c.next[e.spec.Name] = e
		c.changes.count(d.previous(i, e.spec.Name), e)
		if e.installed() {
			c.kernel = append(c.kernel, e.kernel)
		}
	}
	if err := d.fitTables(p, c.kernel); err != nil {
		return nil, err
	}
	return c, nil
}

// writeLocked writes c to the kernel in one Sync and takes it as the
// table; if the kernel refuses, nothing changes. Call with d.mu held.
func (d *Daemon) writeLocked(c *tableChange) ([]retired, error) {
	// The shares this change retires, with what their kernel rules hold,
	// read before the Sync removes those rules.
	var gone []retired
	for name, old := range d.entries {
		if old.share == nil {
			continue // most rules: no need to look up the new table
		}
		if n := c.next[name]; n == nil || n.share != old.share {
			r := retired{share: old.share, release: n == nil || n.share == nil || !old.share.sameBudget(n.share)}
			if r.release && old.pending == "" && !old.share.rate() {
				r.live = -1
				if live, err := d.dp.Live(name); err == nil {
					r.live = int(live)
				}
			}
			gone = append(gone, r)
		}
	}
	if err := d.dp.Sync(c.kernel); err != nil {
		return nil, err
	}
	d.logChanges(c.changes, c.merged, d.entries, c.next)
	for _, cl := range c.partial {
		d.log.Warn("destination left to another rule", "rule", cl.rule, "reason", cl.String())
	}
	for _, e := range c.next {
		if e.share != nil {
			e.share.start()
		}
	}
	if !maps.Equal(d.scopes, c.f.scopes) {
		d.scopesGen++
	}
	d.policy, d.applied, d.entries, d.order, d.scopes = c.p, c.o, c.next, c.merged, c.f.scopes
	d.uses, d.adaptive = usesOf(c.rules), nil
	for _, e := range c.merged {
		if e.ctrl != nil && e.installed() {
			d.adaptive = append(d.adaptive, e)
		}
	}
	if len(d.adaptive) > 0 {
		select {
		case d.adaptiveAdded <- struct{}{}: // wakes watchSaturation
		default:
		}
	}
	d.names.keep(d.uses)
	return gone, nil
}

// previous is the table's entry of the rule named name, or nil, looked for
// first at i in the order the table was applied: a reload of a policy
// whose rules kept their places walks the old entries in turn, where
// looking each of 100,000 up in the map took 39 ms.
func (d *Daemon) previous(i int, name string) *entry {
	if i < len(d.order) && d.order[i].spec.Name == name {
		return d.order[i]
	}
	return d.entries[name]
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
func (d *Daemon) plan(e, old *entry, f found) error {
	if old != nil && *old.spec == *e.spec {
		e.ctrl, e.share = old.ctrl, old.share
	}
	if e.spec.IsShared() && e.share == nil {
		s, err := d.newShare(*e.spec)
		if err != nil {
			return err
		}
		d.carryShare(s, old)
		e.share = s
	}
	sc, ok := f.scopes[e.spec.Scope]
	if !ok {
		sc.scope, sc.pending = scopeOf(d.cfg.Cgroup, e.spec.Scope, d.scopes) // set after prepare looked
	}
	if e.pending = sc.pending; e.pending != "" {
		return nil
	}
	var addrs []netip.Addr
	if host, ok := e.spec.Destination.Host(); ok {
		if addrs = d.names.addrs(host); len(addrs) == 0 {
			e.pending = fmt.Sprintf("host %s has no addresses yet", host)
			return nil
		}
	}
	e.kernel = e.spec.LoaderRule(sc.scope, addrs)
	if e.kernel.FlowIdle == 0 && e.kernel.Protocols.Has(loader.ProtoUDP) {
		e.kernel.FlowIdle = d.cfg.UDPIdle
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
			ctrl, err := d.newController(e.spec.Name, a, d.resumeAt(e.spec.Name, old))
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
func (d *Daemon) carryShare(s share, old *entry) {
	switch {
	case old != nil && old.share != nil && old.share.sameBudget(s):
		s.inherit(old.share)
	case old == nil:
		if kr, err := d.dp.Rule(s.name()); err == nil {
			if st, err := d.dp.Stats(s.name()); err == nil {
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
func (d *Daemon) logChanges(c ruleChanges, merged []*entry, old, next map[string]*entry) {
	removed := len(old) - c.changed - c.same
	ctx, level := context.Background(), slog.LevelInfo
	if c.added+c.changed+removed > logChangesEach {
		d.log.Info("rules changed", "added", c.added, "changed", c.changed, "removed", removed)
		level = slog.LevelDebug
	}
	if !d.log.Enabled(ctx, level) {
		return
	}
	for _, e := range merged {
		switch o := old[e.spec.Name]; {
		case o == nil:
			d.log.Log(ctx, level, "rule added", "rule", e.spec.Name, "source", e.source, "pending", e.pending)
		case ruleChanged(o, e):
			d.log.Log(ctx, level, "rule changed", "rule", e.spec.Name, "source", e.source, "pending", e.pending)
		}
	}
	if removed == 0 {
		return
	}
	for name := range old {
		if _, ok := next[name]; !ok {
			d.log.Log(ctx, level, "rule removed", "rule", name)
		}
	}
}

// logChangesEach is how many rule changes are logged one line each.
const logChangesEach = 100

// install makes p, a policy policy.Parse returned, with the run-time
// changes, the rule set: at start and on a reload. On any problem nothing
// changes.
func (d *Daemon) install(ctx context.Context, p *policy.Policy) error {
	return d.change(ctx, d.prepare(ctx, p.Rules...), func(f found) ([]retired, error) {
		gone, err := d.applyLocked(p, d.overrides, f)
		if err == nil && d.reload.Time.IsZero() {
			d.reload = controlReloadOK()
		}
		if err == nil {
			d.heldBack = false
		}
		return gone, err
	})
}

// setRule sets a rule at run time and keeps it in the state directory.
func (d *Daemon) setRule(ctx context.Context, r policy.Rule) error {
	return d.change(ctx, d.prepare(ctx, r), func(f found) ([]retired, error) {
		return d.commitLocked(d.overrides.with(r), f)
	})
}

// removeRule removes a rule at run time and keeps that in the state
// directory.
func (d *Daemon) removeRule(ctx context.Context, name string) error {
	return d.change(ctx, d.prepare(ctx), func(f found) ([]retired, error) {
		_, known := d.entries[name]
		if !known && !slices.ContainsFunc(d.overrides.Set, func(x policy.Rule) bool { return x.Name == name }) {
			return nil, errUnknownRule
		}
		inPolicy := slices.ContainsFunc(d.policy.Rules, func(x policy.Rule) bool { return x.Name == name })
		return d.commitLocked(d.overrides.without(name, inPolicy), f)
	})
}

// commitLocked applies new overrides and saves them, or changes nothing.
// They are saved once the change is planned and checked but before the
// kernel has it: a state directory that cannot be written, the likely
// failure, then leaves the kernel and the table untouched, and no unsaved
// change is ever in force (the other order had to undo one, and undoing
// by planning the old table again restarted adaptive loops and shares).
// If the kernel then refuses the change, or the save fails after its
// rename, the old overrides are saved back.
func (d *Daemon) commitLocked(o overrides, f found) ([]retired, error) {
	c, err := d.planLocked(d.policy, o, f)
	if err != nil {
		return nil, err
	}
	if err := o.save(d.cfg.StateDir); err != nil {
		if errors.Is(err, errUnsynced) {
			d.saveBack()
		}
		return nil, err
	}
	gone, err := d.writeLocked(c)
	if err != nil {
		d.saveBack()
		return nil, err
	}
	d.overrides = o
	if d.heldBack {
		// Every run-time limit is in force now, with the file the start
		// loaded: that load is applied whole at last.
		d.heldBack = false
		d.reload = control.Reload{Time: d.reload.Time, OK: true}
		d.log.Info("run-time limits applied with the policy")
	}
	return gone, nil
}

// saveBack saves the overrides in force over a refused change's.
func (d *Daemon) saveBack() {
	if err := d.overrides.save(d.cfg.StateDir); err != nil {
		d.log.Error("saving back the run-time limits in force", "err", err)
	}
}

// refreshLoop looks host names up again when their TTLs run out, and
// units every Refresh (a restarted unit gets a new cgroup); either way the
// table is planned again.
func (d *Daemon) refreshLoop(ctx context.Context) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	defer d.names.wait()
	last := d.cfg.now()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			now := d.cfg.now()
			units := now.Sub(last) >= d.cfg.Refresh
			d.refresh(ctx, now, units)
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
func (d *Daemon) refresh(ctx context.Context, now time.Time, units bool) {
	d.mu.Lock()
	uses := d.uses
	d.mu.Unlock()
	d.names.resolveBackground(ctx, uses, now)
	moved := d.names.takeMoved()
	if !moved && !units {
		return
	}
	err := d.change(ctx, d.prepare(ctx), func(f found) ([]retired, error) {
		if !moved && maps.Equal(f.scopes, d.scopes) {
			return nil, nil
		}
		return d.applyLocked(d.policy, d.applied, f)
	})
	if err != nil && ctx.Err() == nil {
		d.log.Error("refresh", "err", err)
	}
}
