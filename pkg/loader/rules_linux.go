//go:build linux

package loader

import (
	"cmp"
	"errors"
	"fmt"
	"net/netip"
	"runtime"
	"slices"
	"sync"
	"syscall"
	"time"

	"github.com/cilium/ebpf"

	"github.com/egressd/egressd/pkg/kernelrule"
)

// readTable rebuilds the rule table from the kernel's maps: what the
// kernel enforces, whatever user space believed.
func (d *Datapath) readTable() (*table, error) {
	n := d.cfg.MaxRules
	t := newTable(n, n*keysPerRule)
	krs := make([]egressdRule, n)
	if err := batchRead(d.objs.Rules, krs); err != nil {
		return nil, fmt.Errorf("read rules: %w", err)
	}
	metas := make([]egressdRuleMeta, n)
	if err := batchRead(d.objs.RuleMetas, metas); err != nil {
		return nil, fmt.Errorf("read rule metadata: %w", err)
	}
	for i := range n {
		kr := &krs[i]
		t.nextGen = max(t.nextGen, kr.Gen)
		t.slots[i] = slot{gen: kr.Gen, epoch: kr.Epoch}
		if kr.Flags&flagActive == 0 {
			t.free = append(t.free, uint32(i))
			continue
		}
		t.slots[i] = slot{rule: ruleFromKernel(kr, &metas[i]), gen: kr.Gen, epoch: kr.Epoch, active: true}
	}
	t.nextGen++

	// A rule's destinations are its keys.
	for _, m := range []*ebpf.Map{d.objs.RuleExact, d.objs.RulePrefixes} {
		var key egressdRuleKey
		var idx uint32
		it := m.Iterate()
		for it.Next(&key, &idx) {
			if int(idx) >= n || !t.slots[idx].active {
				continue
			}
			// A rule of two protocols has each destination twice:
			// its first protocol's keys say them.
			r := &t.slots[idx].rule
			if uint8(key.Port>>16) != firstProto(r.Protocols) {
				continue
			}
			addr := netip.AddrFrom16(key.Addr)
			bits := int(key.Prefixlen) - ruleKeyFixedBits
			if addr.Is4In6() && bits >= 96 {
				addr, bits = addr.Unmap(), bits-96
			}
			r.Dests = append(r.Dests, netip.PrefixFrom(addr, bits))
		}
		if err := it.Err(); err != nil {
			return nil, fmt.Errorf("read rule keys: %w", err)
		}
	}
	for i, s := range t.slots {
		if s.active {
			t.add(uint32(i), s)
		}
	}
	return t, nil
}

func ruleFromKernel(kr *egressdRule, meta *egressdRuleMeta) Rule {
	name := meta.Name[:]
	if i := slices.Index(name, 0); i >= 0 {
		name = name[:i]
	}
	r := Rule{
		Name:      string(name),
		Port:      uint16(meta.Port),
		Scope:     Scope{CgroupID: meta.Scope, Level: meta.ScopeLevel & 0xffff},
		Protocols: Protocols(meta.Port >> 16).Normal(),
		FlowIdle:  cmp.Or(time.Duration(meta.ScopeLevel>>16)*time.Second, kernelrule.DefaultFlowIdle),
		Shape:     Shape(kr.Shape),
		Limit:     kr.Limit,
		Shadow:    kr.Flags&flagShadow != 0,
		Samples:   kr.Flags&flagSamples != 0,
		Requests:  kr.Flags&flagRequests != 0,
		Errno:     syscall.Errno(kr.RefuseErrno),
	}
	switch r.Shape {
	case ShapeConcurrency:
		if kr.UntilNs != 0 {
			r.Until, r.LimitAfter = monotonicToWall(kr.UntilNs), kr.LimitAfter
		}
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

func encodeRule(r *Rule, gen, epoch uint32) egressdRule {
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
	case ShapeConcurrency:
		if !r.Until.IsZero() {
			kr.UntilNs, kr.LimitAfter = wallToMonotonic(r.Until), r.LimitAfter
		}
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

// kernel is the key as the kernel has it: the protocol above the port.
func (k ruleKey) kernel() egressdRuleKey {
	return egressdRuleKey{
		Prefixlen: uint32(ruleKeyFixedBits + k.dest.Bits()),
		Port:      uint32(k.port) | uint32(k.proto)<<16,
		Scope:     k.scope,
		Addr:      k.dest.Addr().As16(),
	}
}

// firstProto is the kernel's number of a rule's first protocol.
func firstProto(p Protocols) uint8 {
	for _, kp := range kernelProtos {
		if p.Has(kp.bit) {
			return kp.kernel
		}
	}
	return 0
}

// encodeMeta keeps what the kernel's keys and rule do not say of r: the
// protocols above the port and the flow idle time, in seconds, above the
// scope level (builds before left both zero: TCP, the default idle).
func encodeMeta(r Rule) egressdRuleMeta {
	m := egressdRuleMeta{
		Scope:      r.Scope.CgroupID,
		ScopeLevel: r.Scope.Level | uint32(r.FlowIdle/time.Second)<<16,
		Port:       uint32(r.Port) | uint32(r.Protocols.Normal())<<16,
	}
	copy(m.Name[:], r.Name)
	return m
}

// kernelRule is what the kernel holds for a slot: an inactive slot keeps
// its generation, so that the sockets of a retired rule stay told apart.
func (s slot) kernelRule() egressdRule {
	kr := encodeRule(&s.rule, s.gen, s.epoch)
	if !s.active {
		kr.Flags = 0
	}
	return kr
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
	p, err := d.t.plan(rules, nil)
	if err != nil {
		return err
	}
	return d.apply(&p)
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
	p, err := d.t.replacing(rules)
	if err != nil {
		return err
	}
	return d.apply(&p)
}

// validateAll checks rules, their names given once each.
func validateAll(rules []Rule) error {
	var errs []error
	seen := make(map[string]struct{}, len(rules))
	for i := range rules {
		r := &rules[i]
		if err := r.Validate(); err != nil {
			errs = append(errs, err)
		}
		// One map operation per rule, not a lookup and then an insert.
		n := len(seen)
		seen[r.Name] = struct{}{}
		if len(seen) == n {
			errs = append(errs, fmt.Errorf("rule %d: %w: name %q given twice", i, ErrConflict, r.Name))
		}
	}
	return errors.Join(errs...)
}

// Reclaim takes back a granted rule's unspent permits but keep: it lowers
// Granted to what is spent plus keep, then reads what is spent again, so a
// permit the kernel took meanwhile is never counted as taken back (the
// kernel counts a permit before it compares). It returns the permits taken
// back and the rule's Granted now.
func (d *Datapath) Reclaim(name string, keep uint64) (taken, granted uint64, err error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	idx, ok := d.t.byName[name]
	if !ok {
		return 0, 0, fmt.Errorf("rule %s: %w", name, ErrUnknownRule)
	}
	s := d.t.slots[idx]
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
	kr := s.kernelRule()
	if err := d.objs.Rules.Update(idx, &kr, ebpf.UpdateAny); err != nil {
		return 0, old, fmt.Errorf("write rule: %w", err)
	}
	d.t.slots[idx] = s
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
	idx, ok := d.t.byName[name]
	if !ok {
		return fmt.Errorf("rule %s: %w", name, ErrUnknownRule)
	}
	p := d.t.deletion(idx)
	return d.apply(&p)
}

// writer performs kernel writes and remembers how to undo each one.
type writer struct {
	// fault, set by tests, is asked after each write whether to fail it,
	// as a kernel error after the kernel changed would, and before each
	// undo (named "undo " + step) whether to fail that instead of writing.
	fault func(step string) error
	undo  []func() error
}

// do performs one write; its undo puts back what the write may have
// changed, even when it failed part-way.
func (w *writer) do(step string, write, undo func() error) error {
	w.undo = append(w.undo, func() error {
		if err := w.injected("undo " + step); err != nil {
			return err
		}
		if err := undo(); err != nil {
			return fmt.Errorf("undo %s: %w", step, err)
		}
		return nil
	})
	if err := write(); err != nil {
		return fmt.Errorf("%s: %w", step, err)
	}
	return w.injected(step)
}

func (w *writer) injected(step string) error {
	if w.fault == nil {
		return nil
	}
	if err := w.fault(step); err != nil {
		return fmt.Errorf("%s: %w", step, err)
	}
	return nil
}

// rollback undoes every write, newest first.
func (w *writer) rollback() error {
	var errs []error
	for _, undo := range slices.Backward(w.undo) {
		errs = append(errs, undo())
	}
	return errors.Join(errs...)
}

// apply writes a plan in the order that keeps every connect() consistent
// and then commits it to the table. On an error it undoes what it wrote;
// should that fail too, it reads the table back from the kernel, so that
// the table always says what the kernel enforces.
func (d *Datapath) apply(p *plan) error {
	w := &writer{fault: d.fault}
	want := d.hints
	if p.hintsChange() {
		want = d.t.hintsAfter(p)
	}
	err := d.write(w, p, want)
	if err == nil {
		d.t.commit(p)
		d.hints = want
		// The write is done either way; Resize and Close report pins
		// that stay stale.
		_ = d.repinIfStale()
		return nil
	}
	undoErr := w.rollback()
	if undoErr == nil {
		return err
	}
	return errors.Join(err, fmt.Errorf("undo: %w", undoErr), d.reread())
}

// reread makes the table what the kernel holds, and the lookup hints and
// request programs follow it.
func (d *Datapath) reread() error {
	t, err := d.readTable()
	if err != nil {
		return fmt.Errorf("read back: %w", err)
	}
	d.t = t
	return errors.Join(d.syncHints(), d.syncOptional(d.t.uses.needs(), false))
}

// syncHints rewrites the kernel's lookup hints from the table, dropping
// whatever else they hold.
func (d *Datapath) syncHints() error {
	held, err := d.readHints()
	if err != nil {
		return err
	}
	want := d.t.uses.hints()
	if err := d.writeHints(held, want, true); err != nil {
		return err
	}
	d.hints = want
	return nil
}

func (d *Datapath) write(w *writer, p *plan, want hints) error {
	if len(p.delKeys) > 0 {
		err := w.do("delete rule keys", func() error {
			for _, k := range p.delKeys {
				if err := d.keyMap(k).Delete(k.kernel()); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
					return err
				}
			}
			return nil
		}, func() error {
			for _, k := range p.delKeys {
				if err := d.keyMap(k).Update(k.kernel(), d.t.byKey[k], ebpf.UpdateAny); err != nil {
					return fmt.Errorf("put back rule key: %w", err)
				}
			}
			return nil
		})
		if err != nil {
			return err
		}
	}
	if len(p.fresh) > 0 {
		// A fresh slot was a removed rule's, whose sockets still release
		// against it while its entry has their generation. The new
		// generation goes first, inactive until the rule is written
		// whole, and the counts are zeroed only once every program that
		// read the old one has finished: a release after the zeroing
		// would start the new rule below zero, where it would admit
		// more than its limit.
		if err := writeSlots(w, "fresh generations", d.objs.Rules, p.fresh, func(i int) *change { return &p.changes[p.freshOf[i]] },
			func(s *slot) egressdRule { idle := *s; idle.active = false; return idle.kernelRule() }); err != nil {
			return err
		}
		noUndo := func() error { return nil }
		if err := w.do("wait for programs", waitForPrograms, noUndo); err != nil {
			return err
		}
		hist := make([]uint32, 0, 2*len(p.fresh))
		for _, idx := range p.fresh {
			hist = append(hist, idx*uint32(egressdSampleKindSAMPLE_LEN), idx*uint32(egressdSampleKindSAMPLE_LEN)+1)
		}
		if err := w.do("reset rule states", func() error {
			_, err := d.objs.RuleStates.BatchUpdate(p.fresh, make([]egressdRuleState, len(p.fresh)), nil)
			return err
		}, noUndo); err != nil {
			return err
		}
		if err := w.do("reset responses", func() error {
			_, err := d.objs.RuleResponses.BatchUpdate(p.fresh, make([]egressdResponseCount, len(p.fresh)), nil)
			return err
		}, noUndo); err != nil {
			return err
		}
		if err := w.do("reset latency", func() error {
			_, err := d.objs.Latency.BatchUpdate(hist, make([]egressdHist, len(hist)), nil)
			return err
		}, noUndo); err != nil {
			return err
		}
	}
	if err := writeSlots(w, "rule metadata", d.objs.RuleMetas, p.metas, func(i int) *change { return &p.changes[p.metaOf[i]] },
		func(s *slot) egressdRuleMeta { return encodeMeta(s.rule) }); err != nil {
		return err
	}
	if err := writeSlots(w, "rules", d.objs.Rules, p.rules, func(i int) *change { return &p.changes[i] },
		(*slot).kernelRule); err != nil {
		return err
	}
	if p.hintsChange() {
		if err := w.do("write lookup hints", func() error { return d.writeHints(d.hints, want, false) },
			func() error { return d.writeHints(want, d.hints, false) }); err != nil {
			return err
		}
	}
	if len(p.putKeys) > 0 {
		if err := w.do("write rule keys", func() error { return d.putKeys(p.putKeys) }, func() error {
			for _, k := range p.putKeys {
				if err := d.keyMap(k.key).Delete(k.key.kernel()); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
					return fmt.Errorf("take back rule key: %w", err)
				}
			}
			return nil
		}); err != nil {
			return err
		}
	}
	if need := d.t.needsAfter(p); need != d.t.uses.needs() {
		return w.do("optional programs", func() error { return d.syncOptional(need, false) },
			func() error { return d.syncOptional(d.t.uses.needs(), false) })
	}
	return nil
}

// keyMap is the kernel table that holds a key.
func (d *Datapath) keyMap(k ruleKey) *ebpf.Map {
	if k.exact() {
		return d.objs.RuleExact
	}
	return d.objs.RulePrefixes
}

// putKeys writes keys, a batch per key table.
func (d *Datapath) putKeys(puts []keyPut) error {
	n := 0
	for _, k := range puts {
		if k.key.exact() {
			n++
		}
	}
	exact, prefixes := make([]egressdRuleKey, 0, n), make([]egressdRuleKey, 0, len(puts)-n)
	exactIdx, prefixIdx := make([]uint32, 0, n), make([]uint32, 0, len(puts)-n)
	for _, k := range puts {
		if k.key.exact() {
			exact, exactIdx = append(exact, k.key.kernel()), append(exactIdx, k.idx)
		} else {
			prefixes, prefixIdx = append(prefixes, k.key.kernel()), append(prefixIdx, k.idx)
		}
	}
	if len(exact) > 0 {
		if err := batchUpdate(d.objs.RuleExact, exact, exactIdx); err != nil {
			return err
		}
	}
	if len(prefixes) > 0 {
		return batchUpdate(d.objs.RulePrefixes, prefixes, prefixIdx)
	}
	return nil
}

// writeSlots writes value of the new slot of each change changeOf(i) into
// slot idxs[i] of a rule table; its undo writes back the old slots'
// values, worked out only if it runs: a start with 100,000 rules would
// encode and hold both for nothing.
func writeSlots[V any](w *writer, what string, m *ebpf.Map, idxs []uint32, changeOf func(i int) *change, value func(*slot) V) error {
	if len(idxs) == 0 {
		return nil
	}
	write := func(old bool) error {
		vals := make([]V, len(idxs))
		for i := range idxs {
			c := changeOf(i)
			s := &c.new
			if old {
				s = c.old
			}
			vals[i] = value(s)
		}
		return batchUpdate(m, idxs, vals)
	}
	return w.do("write "+what, func() error { return write(false) }, func() error { return write(true) })
}

// batchUpdate writes one entry with a plain update, the path the adaptive
// loop takes on every move, and more in batches, a large write split over
// the CPUs: the kernel writes a batch an entry at a time, locking at most
// the entry's hash bucket, and the 100,000 keys of a large start kept one
// CPU busy for 70 ms while the others waited.
func batchUpdate[K, V any](m *ebpf.Map, keys []K, vals []V) error {
	if len(keys) == 1 {
		return m.Update(&keys[0], &vals[0], ebpf.UpdateAny)
	}
	parts := min(runtime.GOMAXPROCS(0), len(keys)/batchPart)
	if parts <= 1 {
		_, err := m.BatchUpdate(keys, vals, nil)
		return err
	}
	errs := make([]error, parts)
	var wg sync.WaitGroup
	for i := range parts {
		lo, hi := i*len(keys)/parts, (i+1)*len(keys)/parts
		wg.Go(func() { _, errs[i] = m.BatchUpdate(keys[lo:hi], vals[lo:hi], nil) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

// batchPart is the least a part of a split batch writes: below it a
// goroutine costs more than the CPU it adds.
const batchPart = 4096

// readHints reads what the kernel's lookup hints hold now.
func (d *Datapath) readHints() (hints, error) {
	h := hints{scopes: map[uint64]uint32{}}
	var cfg egressdDatapathConfig
	if err := d.objs.Config.Lookup(uint32(0), &cfg); err != nil {
		return h, fmt.Errorf("read config: %w", err)
	}
	h.classes, h.levels = cfg.Classes, cfg.ScopeLevels
	var id uint64
	var class uint32
	it := d.objs.Scopes.Iterate()
	for it.Next(&id, &class) {
		h.scopes[id] = class
	}
	if err := it.Err(); err != nil {
		return h, fmt.Errorf("read scopes: %w", err)
	}
	for proto, m := range d.portMaps() {
		for i := range h.ports[proto] {
			if err := m.Lookup(uint32(i), &h.ports[proto][i]); err != nil {
				return h, fmt.Errorf("read ports: %w", err)
			}
		}
	}
	dests, err := newBatches[uint64](d.objs.UdpDests, len(h.udpDests)).next(len(h.udpDests))
	if err != nil {
		return h, fmt.Errorf("read UDP destinations: %w", err)
	}
	copy(h.udpDests[:], dests)
	return h, nil
}

// writeHints moves the kernel's lookup hints from old to want, writing
// only what differs (everything when all is set). It widens first and
// narrows after: a connect() between the writes may do a needless lookup
// but never skips a rule that exists. Writing want over old again undoes
// it, however far it got.
func (d *Datapath) writeHints(old, want hints, all bool) error {
	widened := d.kernelConfig(hints{classes: old.classes | want.classes, levels: old.levels | want.levels})
	if err := d.objs.Config.Update(uint32(0), &widened, ebpf.UpdateAny); err != nil {
		return fmt.Errorf("write config: %w", err)
	}
	for id, class := range want.scopes {
		if c, ok := old.scopes[id]; ok && c == class && !all {
			continue
		}
		if err := d.objs.Scopes.Update(id, class, ebpf.UpdateAny); err != nil {
			return fmt.Errorf("write scope: %w", err)
		}
	}
	for proto, m := range d.portMaps() {
		for i, bits := range want.ports[proto] {
			if old.ports[proto][i] == bits && !all {
				continue
			}
			if err := m.Update(uint32(i), bits, ebpf.UpdateAny); err != nil {
				return fmt.Errorf("write ports: %w", err)
			}
		}
	}
	var words []uint32
	var dests []uint64
	for i, bits := range want.udpDests {
		if old.udpDests[i] != bits || all {
			words, dests = append(words, uint32(i)), append(dests, bits)
		}
	}
	if len(words) > 0 {
		if err := batchUpdate(d.objs.UdpDests, words, dests); err != nil {
			return fmt.Errorf("write UDP destinations: %w", err)
		}
	}
	for id := range old.scopes {
		if _, ok := want.scopes[id]; ok {
			continue
		}
		if err := d.objs.Scopes.Delete(id); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("delete scope: %w", err)
		}
	}
	cfg := d.kernelConfig(want)
	if err := d.objs.Config.Update(uint32(0), &cfg, ebpf.UpdateAny); err != nil {
		return fmt.Errorf("write config: %w", err)
	}
	return nil
}

// portMaps are the kernel's maps of the ports rules name, by protocol.
func (d *Datapath) portMaps() [protoCount]*ebpf.Map {
	return [protoCount]*ebpf.Map{d.objs.Ports, d.objs.UdpPorts}
}

func (d *Datapath) kernelConfig(h hints) egressdDatapathConfig {
	return egressdDatapathConfig{
		Classes:     h.classes,
		ScopeLevels: h.levels,
		WakeEveryNs: uint64(wakeEvery),
		WakeBytes:   wakeBytes,
	}
}

// Rules returns every rule, in slot order.
func (d *Datapath) Rules() []Rule {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.t.rules()
}

// Rule returns the rule of that name.
func (d *Datapath) Rule(name string) (Rule, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	idx, ok := d.t.byName[name]
	if !ok {
		return Rule{}, fmt.Errorf("rule %s: %w", name, ErrUnknownRule)
	}
	return d.t.slots[idx].rule, nil
}
