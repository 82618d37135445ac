//go:build linux

package loader

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"syscall"
	"time"

	"github.com/cilium/ebpf"
)

// adoptRules rebuilds the slot table from the pinned maps.
func (d *Datapath) adoptRules() error {
	n := d.cfg.MaxRules
	d.slots = make([]slot, n)
	for i := range n {
		idx := uint32(i)
		var kr egressdRule
		if err := d.objs.Rules.Lookup(idx, &kr); err != nil {
			return fmt.Errorf("read rule %d: %w", i, err)
		}
		d.nextGen = max(d.nextGen, kr.Gen)
		if kr.Flags&flagActive == 0 {
			d.free = append(d.free, idx)
			continue
		}
		var meta egressdRuleMeta
		if err := d.objs.RuleMetas.Lookup(idx, &meta); err != nil {
			return fmt.Errorf("read rule %d: %w", i, err)
		}
		r := ruleFromKernel(&kr, &meta)
		d.slots[i] = slot{rule: r, gen: kr.Gen, epoch: kr.Epoch, active: true}
		d.trackingRequests += tracks(d.slots[i])
		d.byName[r.Name] = idx
	}
	d.nextGen++

	// A rule's destinations are its keys in the trie.
	var key egressdRuleKey
	var idx uint32
	it := d.objs.RuleKeys.Iterate()
	for it.Next(&key, &idx) {
		if int(idx) >= n || !d.slots[idx].active {
			continue
		}
		addr := netip.AddrFrom16(key.Addr)
		bits := int(key.Prefixlen) - ruleKeyFixedBits
		if addr.Is4In6() && bits >= 96 {
			addr, bits = addr.Unmap(), bits-96
		}
		r := &d.slots[idx].rule
		r.Dests = append(r.Dests, netip.PrefixFrom(addr, bits))
		d.byKey[ruleKey{scope: key.Scope, dest: mapped(r.Dests[len(r.Dests)-1]), port: uint16(key.Port)}] = idx
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("read rule keys: %w", err)
	}
	return nil
}

func tracks(s slot) int {
	if s.active && s.rule.Requests {
		return 1
	}
	return 0
}

func ruleFromKernel(kr *egressdRule, meta *egressdRuleMeta) Rule {
	name := meta.Name[:]
	if i := slices.Index(name, 0); i >= 0 {
		name = name[:i]
	}
	r := Rule{
		Name:     string(name),
		Port:     uint16(meta.Port),
		Scope:    Scope{CgroupID: meta.Scope, Level: meta.ScopeLevel},
		Shape:    Shape(kr.Shape),
		Limit:    kr.Limit,
		Shadow:   kr.Flags&flagShadow != 0,
		Samples:  kr.Flags&flagSamples != 0,
		Requests: kr.Flags&flagRequests != 0,
		Errno:    syscall.Errno(kr.RefuseErrno),
	}
	switch r.Shape {
	case ShapePerSecond:
		r.Burst = kr.Burst
	case ShapePerWindow:
		r.Segments = kr.Segments
		r.Window = time.Duration(kr.SegmentNs) * time.Duration(kr.Segments)
	case ShapeGranted:
		r.Granted = kr.Granted
	}
	return r
}

func (r *Rule) kernel(gen, epoch uint32) egressdRule {
	kr := egressdRule{
		Gen:         gen,
		Shape:       uint8(r.Shape),
		Flags:       flagActive,
		RefuseErrno: uint16(r.Errno),
		Limit:       r.Limit,
		Epoch:       epoch,
	}
	if r.Shadow {
		kr.Flags |= flagShadow
	}
	if r.Samples {
		kr.Flags |= flagSamples
	}
	if r.Requests {
		kr.Flags |= flagRequests
	}
	switch r.Shape {
	case ShapePerSecond:
		kr.Burst = r.Burst
	case ShapePerWindow:
		kr.Segments = r.Segments
		kr.SegmentNs = uint64(r.Window) / uint64(r.Segments)
	case ShapeGranted:
		kr.Granted = r.Granted
	}
	return kr
}

func (k ruleKey) kernel() egressdRuleKey {
	return egressdRuleKey{
		Prefixlen: uint32(ruleKeyFixedBits + k.dest.Bits()),
		Port:      uint32(k.port),
		Scope:     k.scope,
		Addr:      k.dest.Addr().As16(),
	}
}

func (r *Rule) kernelMeta() egressdRuleMeta {
	m := egressdRuleMeta{Scope: r.Scope.CgroupID, ScopeLevel: r.Scope.Level, Port: uint32(r.Port)}
	copy(m.Name[:], r.Name)
	return m
}

// restartsState reports whether moving from old to new parameters must
// restart the bucket or window (a shape or segment layout change).
func restartsState(old, new *Rule) bool {
	return old.Shape != new.Shape || old.Segments != new.Segments || old.Window != new.Window
}

// Put creates a rule, or changes the rule of that name in place: its counts
// carry on whatever changes, and connections it admitted before give their
// slots back to it.
func (d *Datapath) Put(r Rule) error {
	return d.PutMany([]Rule{r})
}

// PutMany applies many rules with batched map writes. Every rule is
// checked before anything is written; on a problem nothing changes.
func (d *Datapath) PutMany(rules []Rule) error {
	if err := validateAll(rules); err != nil {
		return err
	}

	d.mu.Lock()
	defer d.mu.Unlock()
	plan, taken, err := d.plan(rules, nil)
	if err != nil {
		return err
	}
	return d.apply(plan, taken)
}

// Sync makes rules the whole rule set: rules of other names are deleted,
// the rest put, all checked first and written together, so that a policy
// reload either applies whole or changes nothing.
func (d *Datapath) Sync(rules []Rule) error {
	if err := validateAll(rules); err != nil {
		return err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	keep := map[string]bool{}
	for _, r := range rules {
		keep[r.Name] = true
	}
	var gone []uint32
	for name, idx := range d.byName {
		if !keep[name] {
			gone = append(gone, idx)
		}
	}
	slices.Sort(gone)
	plan, taken, err := d.plan(rules, gone)
	if err != nil {
		return err
	}
	return d.apply(plan, taken)
}

func validateAll(rules []Rule) error {
	var errs []error
	seen := map[string]bool{}
	for i, r := range rules {
		if err := r.Validate(); err != nil {
			errs = append(errs, err)
		}
		if seen[r.Name] {
			errs = append(errs, fmt.Errorf("rule %d: %w: name %q given twice", i, ErrConflict, r.Name))
		}
		seen[r.Name] = true
	}
	return errors.Join(errs...)
}

// change is one slot write.
type change struct {
	idx    uint32
	old    slot // before; zero when the slot was free
	new    slot // after; inactive for a removal
	create bool // start the slot's counts afresh
}

// plan works out the slot writes that put rules and delete the slots in
// gone, checking conflicts and capacity, without touching the kernel. New
// rules take free slots from the head of the queue; taken says how many.
func (d *Datapath) plan(rules []Rule, gone []uint32) (changes []change, taken int, err error) {
	inBatch := map[string]bool{}
	for _, r := range rules {
		inBatch[r.Name] = true
	}
	for _, idx := range gone {
		old := d.slots[idx]
		inBatch[old.rule.Name] = true
		changes = append(changes, change{idx: idx, old: old, new: slot{rule: old.rule, gen: old.gen}})
	}
	claimed := map[ruleKey]string{}
	gen := d.nextGen
	var errs []error
	for _, r := range rules {
		r = r.withDefaults()
		conflict := false
		for _, k := range r.keys() {
			other, ok := claimed[k]
			if !ok {
				// A key held by a rule outside the batch stays held; one
				// held by a rule in the batch is free unless it claims
				// it again, which the claimed check catches.
				if idx, held := d.byKey[k]; held && !inBatch[d.slots[idx].rule.Name] {
					other, ok = d.slots[idx].rule.Name, true
				}
			}
			if ok && other != r.Name {
				errs = append(errs, fmt.Errorf("rule %s: %w: %v (port %d) is already rule %s's", r.Name, ErrConflict, k.dest, k.port, other))
				conflict = true
				break
			}
			claimed[k] = r.Name
		}
		if conflict {
			continue
		}
		if idx, ok := d.byName[r.Name]; ok {
			old := d.slots[idx]
			next := slot{rule: r, gen: old.gen, epoch: old.epoch, active: true}
			if restartsState(&old.rule, &r) {
				next.epoch++
			}
			changes = append(changes, change{idx: idx, old: old, new: next})
			continue
		}
		if taken == len(d.free) {
			errs = append(errs, fmt.Errorf("rule %s: %w (%d rules)", r.Name, ErrFull, d.cfg.MaxRules))
			continue
		}
		idx := d.free[taken]
		taken++
		changes = append(changes, change{idx: idx, old: d.slots[idx], new: slot{rule: r, gen: gen, epoch: 1, active: true}, create: true})
		gen++
	}
	return changes, taken, errors.Join(errs...)
}

// keysOf returns the keys of an active slot.
func keysOf(s slot) []ruleKey {
	if !s.active {
		return nil
	}
	return s.rule.keys()
}

// Reclaim takes back a granted rule's unspent permits but keep: it lowers
// Granted to what is spent plus keep, then reads what is spent again, so a
// permit the kernel took meanwhile is never counted as taken back (the
// kernel counts a permit before it compares). It returns the permits taken
// back and the rule's Granted now.
func (d *Datapath) Reclaim(name string, keep uint64) (taken, granted uint64, err error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	idx, ok := d.byName[name]
	if !ok {
		return 0, 0, fmt.Errorf("rule %s: %w", name, ErrUnknownRule)
	}
	s := d.slots[idx]
	if s.rule.Shape != ShapeGranted {
		return 0, 0, fmt.Errorf("rule %s: reclaim: %s rule", name, s.rule.Shape)
	}
	before, err := d.spent(idx)
	if err != nil {
		return 0, 0, err
	}
	old := s.rule.Granted
	if before+keep >= old {
		return 0, old, nil
	}
	s.rule.Granted = before + keep
	kr := s.rule.kernel(s.gen, s.epoch)
	if err := d.objs.Rules.Update(idx, &kr, ebpf.UpdateAny); err != nil {
		return 0, old, fmt.Errorf("write rule: %w", err)
	}
	d.slots[idx] = s
	after, err := d.spent(idx)
	if err != nil {
		// Unknown how many were spent meanwhile: claim none came back.
		return 0, s.rule.Granted, err
	}
	return old - max(s.rule.Granted, after), s.rule.Granted, nil
}

// Delete removes a rule. Its connections stay open; their slots are given
// back into the retired rule's counts, never into a later rule's.
func (d *Datapath) Delete(name string) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	idx, ok := d.byName[name]
	if !ok {
		return fmt.Errorf("rule %s: %w", name, ErrUnknownRule)
	}
	old := d.slots[idx]
	return d.apply([]change{{idx: idx, old: old, new: slot{rule: old.rule, gen: old.gen}}}, 0)
}

// apply writes changes in the order that keeps every connect() consistent:
// keys that stop matching go first; new slots are zeroed and filled before
// their keys make them reachable. The first taken free slots are used.
func (d *Datapath) apply(changes []change, taken int) error {
	var (
		delKeys   []egressdRuleKey
		putKeys   []egressdRuleKey
		putSlots  []uint32
		ruleIdx   []uint32
		ruleVals  []egressdRule
		fresh     []uint32
		freshHist []uint32
		metaIdx   []uint32
		metaVals  []egressdRuleMeta
	)
	for _, c := range changes {
		oldKeys, newKeys := keysOf(c.old), keysOf(c.new)
		for _, k := range oldKeys {
			if !slices.Contains(newKeys, k) {
				delKeys = append(delKeys, k.kernel())
			}
		}
		for _, k := range newKeys {
			if !slices.Contains(oldKeys, k) {
				putKeys = append(putKeys, k.kernel())
				putSlots = append(putSlots, c.idx)
			}
		}
		if c.create || (c.new.active && c.new.rule.kernelMeta() != c.old.rule.kernelMeta()) {
			metaIdx = append(metaIdx, c.idx)
			metaVals = append(metaVals, c.new.rule.kernelMeta())
		}
		ruleIdx = append(ruleIdx, c.idx)
		if c.new.active {
			ruleVals = append(ruleVals, c.new.rule.kernel(c.new.gen, c.new.epoch))
		} else {
			kr := c.old.rule.kernel(c.old.gen, c.old.epoch)
			kr.Flags = 0
			ruleVals = append(ruleVals, kr)
		}
		if c.create {
			fresh = append(fresh, c.idx)
			freshHist = append(freshHist, c.idx*uint32(egressdSampleKindSAMPLE_LEN), c.idx*uint32(egressdSampleKindSAMPLE_LEN)+1)
		}
	}

	for _, k := range delKeys {
		if err := d.objs.RuleKeys.Delete(&k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("delete rule key: %w", err)
		}
	}
	if len(fresh) > 0 {
		if _, err := d.objs.RuleStates.BatchUpdate(fresh, make([]egressdRuleState, len(fresh)), nil); err != nil {
			return fmt.Errorf("reset rule states: %w", err)
		}
		if _, err := d.objs.RuleCounters.BatchUpdate(fresh, make([]egressdCounters, len(fresh)*d.ncpu), nil); err != nil {
			return fmt.Errorf("reset counters: %w", err)
		}
		if _, err := d.objs.Latency.BatchUpdate(freshHist, make([]egressdHist, len(freshHist)), nil); err != nil {
			return fmt.Errorf("reset latency: %w", err)
		}
	}
	if len(metaIdx) > 0 {
		if err := batchUpdate(d.objs.RuleMetas, metaIdx, metaVals); err != nil {
			return fmt.Errorf("write rule metadata: %w", err)
		}
	}
	if err := batchUpdate(d.objs.Rules, ruleIdx, ruleVals); err != nil {
		return fmt.Errorf("write rules: %w", err)
	}

	// The user-space table follows the kernel's.
	d.free = d.free[taken:]
	for _, c := range changes {
		if c.old.active {
			delete(d.byName, c.old.rule.Name)
			for _, k := range c.old.rule.keys() {
				delete(d.byKey, k)
			}
		}
		if c.old.active && !c.new.active {
			d.free = append(d.free, c.idx)
		}
		d.trackingRequests += tracks(c.new) - tracks(c.old)
		d.slots[c.idx] = c.new
		if c.create {
			d.nextGen = max(d.nextGen, c.new.gen+1)
		}
	}
	for _, c := range changes {
		if c.new.active {
			d.byName[c.new.rule.Name] = c.idx
			for _, k := range c.new.rule.keys() {
				d.byKey[k] = c.idx
			}
		}
	}

	// A change of limits alone leaves the hints as they are.
	if len(delKeys) > 0 || len(putKeys) > 0 {
		if err := d.syncLookupHints(false); err != nil {
			return err
		}
	}
	if len(putKeys) > 0 {
		if _, err := d.objs.RuleKeys.BatchUpdate(putKeys, putSlots, nil); err != nil {
			return fmt.Errorf("write rule keys: %w", err)
		}
	}
	return d.syncRequestPrograms(false)
}

// batchUpdate writes one entry with a plain update, the path the adaptive
// loop takes on every move, and more in one batch.
func batchUpdate[K, V any](m *ebpf.Map, keys []K, vals []V) error {
	if len(keys) == 1 {
		return m.Update(&keys[0], &vals[0], ebpf.UpdateAny)
	}
	_, err := m.BatchUpdate(keys, vals, nil)
	return err
}

// syncLookupHints rewrites what lets connect() skip lookups that cannot
// match: the key classes in use, the scope cgroups and the ports named.
// full rewrites everything, dropping whatever a previous run left.
func (d *Datapath) syncLookupHints(full bool) error {
	var cfg egressdDatapathConfig
	scopes := map[uint64]uint32{}
	var ports [65536 / 64]uint64
	for _, s := range d.slots {
		if !s.active {
			continue
		}
		r := &s.rule
		var class uint32
		switch {
		case r.Scope.HostWide() && r.Port == 0:
			class = classHostAny
		case r.Scope.HostWide():
			class = classHostPort
		case r.Port == 0:
			class = classScopedAny
		default:
			class = classScopedPort
		}
		cfg.Classes |= class
		if !r.Scope.HostWide() {
			scopes[r.Scope.CgroupID] |= class
			cfg.ScopeLevels |= 1 << r.Scope.Level
		}
		if r.Port != 0 {
			ports[r.Port/64] |= 1 << (r.Port % 64)
		}
	}

	// Widen first, narrow after: a connect() between the writes may do a
	// needless lookup but never skips a rule that exists.
	var old egressdDatapathConfig
	if err := d.objs.Config.Lookup(uint32(0), &old); err != nil {
		return fmt.Errorf("read config: %w", err)
	}
	widened := egressdDatapathConfig{Classes: old.Classes | cfg.Classes, ScopeLevels: old.ScopeLevels | cfg.ScopeLevels}
	if err := d.objs.Config.Update(uint32(0), &widened, ebpf.UpdateAny); err != nil {
		return fmt.Errorf("write config: %w", err)
	}
	if full {
		d.hintScopes = map[uint64]uint32{}
		var id uint64
		var class uint32
		for it := d.objs.Scopes.Iterate(); it.Next(&id, &class); {
			d.hintScopes[id] = class
		}
		for i := range d.hintPorts {
			d.hintPorts[i] = ^ports[i] // differs everywhere: all written
		}
	}
	for id, class := range scopes {
		if d.hintScopes[id] == class {
			continue
		}
		if err := d.objs.Scopes.Update(id, class, ebpf.UpdateAny); err != nil {
			return fmt.Errorf("write scope: %w", err)
		}
		d.hintScopes[id] = class
	}
	for i, bits := range ports {
		if d.hintPorts[i] == bits {
			continue
		}
		if err := d.objs.Ports.Update(uint32(i), bits, ebpf.UpdateAny); err != nil {
			return fmt.Errorf("write ports: %w", err)
		}
		d.hintPorts[i] = bits
	}
	for id := range d.hintScopes {
		if _, ok := scopes[id]; ok {
			continue
		}
		if err := d.objs.Scopes.Delete(id); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("delete scope: %w", err)
		}
		delete(d.hintScopes, id)
	}
	if err := d.objs.Config.Update(uint32(0), &cfg, ebpf.UpdateAny); err != nil {
		return fmt.Errorf("write config: %w", err)
	}
	return nil
}

// Rules returns every rule, in slot order.
func (d *Datapath) Rules() []Rule {
	d.mu.Lock()
	defer d.mu.Unlock()
	var out []Rule
	for _, s := range d.slots {
		if s.active {
			out = append(out, s.rule)
		}
	}
	return out
}

// Rule returns the rule of that name.
func (d *Datapath) Rule(name string) (Rule, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	idx, ok := d.byName[name]
	if !ok {
		return Rule{}, fmt.Errorf("rule %s: %w", name, ErrUnknownRule)
	}
	return d.slots[idx].rule, nil
}
