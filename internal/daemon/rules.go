package daemon

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/egressd/egressd/pkg/adaptive"
	"github.com/egressd/egressd/pkg/cgroups"
	"github.com/egressd/egressd/pkg/loader"
	"github.com/egressd/egressd/pkg/policy"
)

// Where a rule comes from. A rule set at run time wins over the policy
// file's rule of the same name, and a rule removed at run time stays
// removed across reloads until it is set again.
const (
	sourcePolicy = "policy"
	sourceCLI    = "cli"
)

// entry is one effective rule.
type entry struct {
	spec   policy.Rule
	source string
	// kernel is the rule as installed; pending says why it is not. base
	// is the kernel rule the policy gives, before a share shapes it.
	kernel  loader.Rule
	base    loader.Rule
	pending string
	ctrl    *adaptive.Controller
	share   *shareRunner
}

func (e *entry) installed() bool { return e.pending == "" }

// limitShown is the limit the CLI and metrics report, given the kernel's:
// a shared rate's kernel rule grants permits and has no rate of its own,
// so it is the whole budget's.
func (e *entry) limitShown(kernel uint32) uint32 {
	if e.share != nil && e.share.slots == nil {
		return e.base.Limit
	}
	return kernel
}

// overrides are the changes made at run time, kept in the state directory.
type overrides struct {
	Set     []policy.Rule
	Removed []string
}

type overridesFile struct {
	// Rules is a policy file of the rules set at run time.
	Rules   string   `json:"rules"`
	Removed []string `json:"removed"`
}

func overridesPath(dir string) string { return filepath.Join(dir, "overrides.json") }

func loadOverrides(dir string) (overrides, error) {
	b, err := os.ReadFile(overridesPath(dir))
	if errors.Is(err, os.ErrNotExist) {
		return overrides{}, nil
	}
	if err != nil {
		return overrides{}, fmt.Errorf("state: %w", err)
	}
	var f overridesFile
	if err := json.Unmarshal(b, &f); err != nil {
		return overrides{}, fmt.Errorf("state %s: %w", overridesPath(dir), err)
	}
	p, err := policy.Parse([]byte(f.Rules))
	if err != nil {
		return overrides{}, fmt.Errorf("state %s: %w", overridesPath(dir), err)
	}
	return overrides{Set: p.Rules, Removed: f.Removed}, nil
}

// save writes the overrides atomically: a crash leaves the old file or the
// new one, never half of one.
func (o overrides) save(dir string) error {
	text, err := policy.Format(&policy.Policy{Rules: o.Set})
	if err != nil {
		return err
	}
	b, err := json.MarshalIndent(overridesFile{Rules: string(text), Removed: o.Removed}, "", "  ")
	if err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("state: %w", err)
	}
	tmp, err := os.CreateTemp(dir, ".overrides-*")
	if err != nil {
		return fmt.Errorf("state: %w", err)
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(b); err != nil {
		tmp.Close()
		return fmt.Errorf("state: %w", err)
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return fmt.Errorf("state: %w", err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("state: %w", err)
	}
	if err := os.Rename(tmp.Name(), overridesPath(dir)); err != nil {
		return fmt.Errorf("state: %w", err)
	}
	return nil
}

// effective merges the policy file with the overrides.
func effective(p *policy.Policy, o overrides) []*entry {
	removed := map[string]bool{}
	for _, n := range o.Removed {
		removed[n] = true
	}
	set := map[string]policy.Rule{}
	for _, r := range o.Set {
		set[r.Name] = r
	}
	var out []*entry
	for _, r := range p.Rules {
		if removed[r.Name] {
			continue
		}
		if o, ok := set[r.Name]; ok {
			out = append(out, &entry{spec: o, source: sourceCLI})
			delete(set, r.Name)
			continue
		}
		out = append(out, &entry{spec: r, source: sourcePolicy})
	}
	for _, r := range o.Set {
		if _, ok := set[r.Name]; ok && !removed[r.Name] {
			out = append(out, &entry{spec: r, source: sourceCLI})
		}
	}
	return out
}

// install makes p (with the overrides) the rule set: resolves scopes and
// host names, checks the whole set, and writes it to the kernel in one
// Sync. On any problem nothing changes.
func (d *Daemon) install(ctx context.Context, p *policy.Policy) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.installLocked(ctx, p, d.overrides); err != nil {
		return err
	}
	if d.reload.Time.IsZero() {
		d.reload = controlReloadOK()
	}
	return nil
}

func (d *Daemon) installLocked(ctx context.Context, p *policy.Policy, o overrides) error {
	merged := effective(p, o)
	if err := (&policy.Policy{Rules: specs(merged)}).Validate(); err != nil {
		return err
	}
	next := map[string]*entry{}
	var kernel []loader.Rule
	for _, e := range merged {
		old := d.entries[e.spec.Name]
		if old != nil && old.spec == e.spec {
			// Unchanged: keep the adaptive loop and the share where
			// they are.
			e.ctrl, e.share = old.ctrl, old.share
		}
		if e.spec.IsShared() && e.share == nil {
			s, err := d.newShare(e.spec)
			if err != nil {
				return fmt.Errorf("rule %s: %w", e.spec.Name, err)
			}
			switch {
			case old != nil && old.share != nil && old.share.sameBudget(s):
				s.inherit(old.share)
			case old == nil:
				if kr, err := d.dp.Rule(e.spec.Name); err == nil {
					if st, err := d.dp.Stats(e.spec.Name); err == nil {
						s.adopt(kr, st)
					}
				}
			}
			e.share = s
		}
		if err := d.resolve(ctx, e); err != nil {
			return fmt.Errorf("rule %s: %w", e.spec.Name, err)
		}
		next[e.spec.Name] = e
		if e.installed() {
			kernel = append(kernel, e.kernel)
		}
	}
	if err := d.dp.Sync(kernel); err != nil {
		return err
	}
	d.logChanges(d.entries, next)
	for name, old := range d.entries {
		if n := next[name]; old.share != nil && (n == nil || n.share != old.share) {
			// Its loop may be waiting for d.mu.
			go old.share.end(n == nil || !old.share.sameBudget(n.share))
		}
	}
	for _, e := range next {
		if e.share != nil && e.share.stop == nil {
			e.share.start()
		}
	}
	d.policy, d.applied, d.entries = p, o, next
	d.hostsMu.Lock()
	for host := range d.hosts {
		if !slices.ContainsFunc(merged, func(e *entry) bool { h, ok := e.spec.Destination.Host(); return ok && h == host }) {
			delete(d.hosts, host)
		}
	}
	d.hostsMu.Unlock()
	return nil
}

func specs(es []*entry) []policy.Rule {
	out := make([]policy.Rule, len(es))
	for i, e := range es {
		out[i] = e.spec
	}
	return out
}

// logChanges writes one line per rule added, changed or removed.
func (d *Daemon) logChanges(old, next map[string]*entry) {
	for name, e := range next {
		o, ok := old[name]
		switch {
		case !ok:
			d.log.Info("rule added", "rule", name, "source", e.source, "pending", e.pending)
		case o.spec != e.spec || o.pending != e.pending:
			d.log.Info("rule changed", "rule", name, "source", e.source, "pending", e.pending)
		}
	}
	for name := range old {
		if _, ok := next[name]; !ok {
			d.log.Info("rule removed", "rule", name)
		}
	}
}

// resolve fills e.kernel from e.spec, or e.pending when the rule cannot be
// in the kernel yet: its unit or cgroup does not exist, or its host name
// does not resolve. An invalid adaptive option is an error.
func (d *Daemon) resolve(ctx context.Context, e *entry) error {
	e.pending = ""
	scope, why := d.scopeOf(e.spec.Scope)
	if why != "" {
		e.pending = why
		return nil
	}
	var addrs []netip.Addr
	if host, ok := e.spec.Destination.Host(); ok {
		if addrs = d.lookup(ctx, e.spec.Name, host); len(addrs) == 0 {
			e.pending = fmt.Sprintf("host %s has no addresses yet", host)
			return nil
		}
	}
	e.kernel = e.spec.LoaderRule(scope, addrs)
	if len(e.kernel.Dests) == 0 {
		e.pending = "host name has no addresses"
		return nil
	}
	e.base = e.kernel
	if e.share != nil {
		e.share.shape(&e.kernel)
	}
	if a, ok := e.spec.Limit.(policy.Adaptive); ok {
		if e.ctrl == nil {
			name := e.spec.Name
			opts := a.Options()
			opts.OnChange = func(from, to int) { d.pushLimit(name, to) }
			ctrl, err := adaptive.New(&opts)
			if err != nil {
				return err
			}
			e.ctrl = ctrl
		}
		e.kernel.Limit = uint32(e.ctrl.Limit())
	}
	return nil
}

// lastAddrs returns the addresses the kernel enforces a rule for now.
func (d *Daemon) lastAddrs(name string) []netip.Addr {
	r, err := d.dp.Rule(name)
	if err != nil {
		return nil
	}
	addrs := make([]netip.Addr, len(r.Dests))
	for i, p := range r.Dests {
		addrs[i] = p.Addr()
	}
	return addrs
}

// hostEntry is what a host name resolved to, until when.
type hostEntry struct {
	addrs   []netip.Addr
	expires time.Time
}

// lookup resolves a rule's host name, asking DNS again only once its TTL
// has run out. A failed lookup must not lift a limit: the addresses last
// resolved stay, by this run or by the one whose pins it adopted, and the
// name is asked again after the resolver's retry time.
func (d *Daemon) lookup(ctx context.Context, rule, host string) []netip.Addr {
	now := time.Now()
	d.hostsMu.Lock()
	h, ok := d.hosts[host]
	d.hostsMu.Unlock()
	if ok && now.Before(h.expires) {
		return h.addrs
	}
	addrs, ttl, err := d.cfg.Resolver.Lookup(ctx, host)
	if err != nil {
		addrs = h.addrs
		if len(addrs) == 0 {
			addrs = d.lastAddrs(rule)
		}
		d.log.Warn("host lookup failed; keeping the last addresses", "rule", rule, "host", host, "err", err, "addresses", len(addrs))
	}
	d.hostsMu.Lock()
	d.hosts[host] = hostEntry{addrs: addrs, expires: now.Add(ttl)}
	d.hostsMu.Unlock()
	return addrs
}

// refreshHosts looks up the host names whose TTL ran out, without holding
// d.mu: a slow DNS server must not stall the API and the event readers.
// It reports whether any was due.
func (d *Daemon) refreshHosts(ctx context.Context, now time.Time) bool {
	type use struct{ rule, host string }
	var uses []use
	d.mu.Lock()
	for name, e := range d.entries {
		if host, ok := e.spec.Destination.Host(); ok {
			uses = append(uses, use{name, host})
		}
	}
	d.mu.Unlock()
	due := false
	for _, u := range uses {
		d.hostsMu.Lock()
		h, ok := d.hosts[u.host]
		d.hostsMu.Unlock()
		if !ok || !now.Before(h.expires) {
			due = true
			d.lookup(ctx, u.rule, u.host)
		}
	}
	return due
}

// scopeOf finds a rule's cgroup; a non-empty reason means it has none now.
func (d *Daemon) scopeOf(s policy.Scope) (loader.Scope, string) {
	var dir string
	switch {
	case s.Unit != "":
		found, err := findUnit(s.Unit)
		if err != nil {
			return loader.Scope{}, fmt.Sprintf("unit %s: %v", s.Unit, err)
		}
		dir = found
	case s.Cgroup != "":
		var err error
		if dir, err = cgroups.Resolve(s.Cgroup); err != nil {
			return loader.Scope{}, err.Error()
		}
	default:
		return loader.Scope{}, ""
	}
	id, err := cgroups.ID(dir)
	if err != nil {
		return loader.Scope{}, fmt.Sprintf("cgroup %s does not exist", dir)
	}
	level, err := cgroups.Level(dir)
	if err != nil {
		return loader.Scope{}, err.Error()
	}
	return loader.Scope{CgroupID: id, Level: uint32(level)}, ""
}

// errNoUnit means no cgroup carries the unit's name: it is not running.
var errNoUnit = errors.New("no cgroup (is it running?)")

// findUnit finds the cgroup systemd made for a unit: the directory of that
// name in the cgroup2 tree (system.slice/x.service, user.slice/…).
func findUnit(unit string) (string, error) {
	root, err := cgroups.Mount()
	if err != nil {
		return "", err
	}
	var found []string
	err = filepath.WalkDir(root, func(path string, de fs.DirEntry, err error) error {
		if err != nil || !de.IsDir() {
			return nil
		}
		if strings.Count(strings.TrimPrefix(path, root), "/") > 6 {
			return fs.SkipDir
		}
		if de.Name() == unit {
			found = append(found, path)
			return fs.SkipDir
		}
		return nil
	})
	switch {
	case err != nil:
		return "", err
	case len(found) == 0:
		return "", errNoUnit
	case len(found) > 1:
		return "", fmt.Errorf("several cgroups are named so: %s", strings.Join(found, ", "))
	}
	return found[0], nil
}

// refreshLoop looks host names up again when their TTLs run out, and
// units every Refresh: a restarted unit gets a new cgroup.
func (d *Daemon) refreshLoop(ctx context.Context) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	last := time.Now()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			due := d.refreshHosts(ctx, now) || now.Sub(last) >= d.cfg.Refresh
			var err error
			if due {
				d.mu.Lock()
				err = d.installLocked(ctx, d.policy, d.applied)
				d.mu.Unlock()
			}
			if err != nil {
				d.log.Error("refresh", "err", err)
			}
			if now.Sub(last) >= d.cfg.Refresh {
				last = now
				d.metrics.recount()
			}
		}
	}
}

// pushLimit moves an adaptive rule's kernel limit; it is the controller's
// change callback.
func (d *Daemon) pushLimit(name string, limit int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	e, ok := d.entries[name]
	if !ok || !e.installed() {
		return
	}
	r := e.kernel
	r.Limit = uint32(limit)
	if err := d.dp.Put(r); err != nil {
		d.log.Error("push adaptive limit", "rule", name, "limit", limit, "err", err)
		return
	}
	e.kernel = r
	// Settled is the limit outside probes: during one, the one it restores.
	settled := limit
	if e.ctrl != nil {
		if restore, ok := e.ctrl.Probing(); ok {
			settled = restore
		}
	}
	d.log.Debug("adaptive limit", "rule", name, "limit", limit, "settled", settled)
}

// setRule sets a rule at run time and persists it.
func (d *Daemon) setRule(ctx context.Context, r policy.Rule) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	o := overrides{Removed: slices.DeleteFunc(slices.Clone(d.overrides.Removed), func(n string) bool { return n == r.Name })}
	o.Set = slices.DeleteFunc(slices.Clone(d.overrides.Set), func(x policy.Rule) bool { return x.Name == r.Name })
	o.Set = append(o.Set, r)
	return d.commitOverrides(ctx, o)
}

// removeRule removes a rule at run time and persists that.
func (d *Daemon) removeRule(ctx context.Context, name string) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	_, known := d.entries[name]
	if !known && !slices.ContainsFunc(d.overrides.Set, func(x policy.Rule) bool { return x.Name == name }) {
		return errUnknownRule
	}
	o := overrides{Set: slices.DeleteFunc(slices.Clone(d.overrides.Set), func(x policy.Rule) bool { return x.Name == name })}
	o.Removed = slices.DeleteFunc(slices.Clone(d.overrides.Removed), func(n string) bool { return n == name })
	inPolicy := slices.ContainsFunc(d.policy.Rules, func(x policy.Rule) bool { return x.Name == name })
	if inPolicy {
		o.Removed = append(o.Removed, name)
	}
	return d.commitOverrides(ctx, o)
}

// commitOverrides applies new overrides and saves them; if the state
// cannot be saved, the kernel is put back as it was.
func (d *Daemon) commitOverrides(ctx context.Context, o overrides) error {
	old := d.applied
	if err := d.installLocked(ctx, d.policy, o); err != nil {
		return err
	}
	if err := o.save(d.cfg.StateDir); err != nil {
		if rerr := d.installLocked(ctx, d.policy, old); rerr != nil {
			d.log.Error("restore rules after a failed save", "err", rerr)
		}
		return err
	}
	d.overrides = o
	return nil
}

var errUnknownRule = errors.New("no such rule")
