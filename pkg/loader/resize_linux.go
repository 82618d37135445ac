//go:build linux

package loader

import (
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"unsafe"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// resizedMaps are the maps sized by MaxRules.
var resizedMaps = slices.Concat([]string{"latency"}, ruleTables, keyTables)

// Resize moves the rules to tables of n rule slots, without a moment
// unenforced: it fills tables of the new size with the rules the kernel
// holds, loads the programs on them, copies the counts, points every
// attachment at the new programs (an atomic swap each), waits until no
// program runs on the old tables, and adds to the new what the old
// programs counted after the copy. Counts, buckets and windows carry on
// exactly; connections the old programs admitted give their slots back to
// the new tables. Until that addition, the new programs do not see what
// the old admitted after the copy, and may admit as much again. Slots of rules keep
// their numbers, so a smaller size must hold every rule's slot. The pinned
// maps are replaced, so that a restart adopts the new size.
func (d *Datapath) Resize(n int) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return errors.New("resize: datapath closed")
	}
	return d.resize(n)
}

func (d *Datapath) resize(n int) error {
	old := d.cfg.MaxRules
	if n == old {
		return d.repinIfStale()
	}
	if n < 1 || n > MaxRules {
		return fmt.Errorf("max rules %d: outside 1..%d", n, MaxRules)
	}
	for i := n; i < old; i++ {
		if s := d.t.slots[i]; s.active {
			return fmt.Errorf("%w: rule %s is in slot %d, beyond %d", ErrFull, s.rule.Name, i, n)
		}
	}
	if keys := n * keysPerRule; d.t.uses.exact > keys || d.t.uses.prefixes > keys {
		return fmt.Errorf("%w: %d addresses and %d prefixes, %d slots hold %d each", ErrFull, d.t.uses.exact, d.t.uses.prefixes, n, keys)
	}
	spec, err := d.spec(n)
	if err != nil {
		return err
	}
	fresh := map[string]*ebpf.Map{}
	closeMaps := func() {
		for _, m := range fresh {
			m.Close()
		}
	}
	for _, name := range resizedMaps {
		ms := spec.Maps[name].Copy()
		ms.Pinning = ebpf.PinNone
		m, err := ebpf.NewMap(ms)
		if err != nil {
			closeMaps()
			return fmt.Errorf("resize %s: %w", name, err)
		}
		fresh[name] = m
	}
	kept := min(n, old)
	if err := d.fill(fresh, kept); err != nil {
		closeMaps()
		return err
	}
	// Every other map is the one in use.
	repl := maps.Clone(fresh)
	for name, m := range d.namedMaps() {
		if _, ok := fresh[name]; !ok {
			repl[name] = m
		}
	}
	var objs egressdObjects
	if err := d.loadSpec(spec, &objs, &ebpf.CollectionOptions{MapReplacements: repl}); err != nil {
		closeMaps()
		return err
	}
	// The counts are copied last, just before the swap. Until the swap
	// has settled, the new programs do not see what the old admitted
	// after the copy, and may admit it again: copied before the load,
	// that gap took in the verifier's time too.
	copied, err := copyStates(d.objs, fresh, kept)
	if err == nil {
		err = (&writer{fault: d.fault}).injected("copied")
	}
	if err != nil {
		objs.Close()
		closeMaps()
		return err
	}
	next := &Datapath{objs: objs, ncpu: d.ncpu}
	if err := d.swap(&objs, kept, copied, next); err != nil {
		objs.Close()
		closeMaps()
		return err
	}
	closeMaps()
	// The maps not resized stay the same objects, which readers hold.
	d.keepUnresized(&objs)
	d.closePrograms(&d.objs)
	// The programs' copy of the counts came with them; only d.mu's
	// holders read it.
	d.objs.Counts.Close()
	for _, name := range resizedMaps {
		d.namedMaps()[name].Close()
	}
	d.objs = objs
	d.cfg.MaxRules = n
	d.t.resize(n, n*keysPerRule)
	// Pin the new tables in place of the old, so that a restart adopts
	// them; until that succeeds the pins are stale, and later calls try
	// again.
	d.stalePins = true
	return d.repinIfStale()
}

// repinIfStale pins the maps in use in place of the pinned set, if a
// resize left the pins stale: a start would adopt the old tables, their
// counts as they were at the resize's copy.
func (d *Datapath) repinIfStale() error {
	if !d.stalePins {
		return nil
	}
	if err := d.repin(); err != nil {
		return err
	}
	d.stalePins = false
	return nil
}

// repin replaces the pinned maps with the maps in use, all at once: it
// pins the whole set in a directory beside, and exchanges the two. A crash
// on the way leaves either set whole, never tables of two sizes, which no
// start could adopt; the next start removes the other.
func (d *Datapath) repin() error {
	spec, err := loadEgressd()
	if err != nil {
		return err
	}
	next := d.mapsDir() + nextSuffix
	if err := os.RemoveAll(next); err != nil {
		return fmt.Errorf("pin: %w", err)
	}
	if err := os.Mkdir(next, 0o700); err != nil {
		return fmt.Errorf("pin: %w", err)
	}
	for name, m := range d.namedMaps() {
		if spec.Maps[name].Pinning != ebpf.PinByName {
			continue
		}
		if err := pinAgain(m, filepath.Join(next, name)); err != nil {
			return fmt.Errorf("pin %s: %w", name, err)
		}
	}
	w := &writer{fault: d.fault}
	if err := w.injected("pinned"); err != nil {
		return err
	}
	if err := unix.Renameat2(unix.AT_FDCWD, next, unix.AT_FDCWD, d.mapsDir(), unix.RENAME_EXCHANGE); err != nil {
		return fmt.Errorf("pin: exchange %s: %w", next, err)
	}
	if err := w.injected("exchanged"); err != nil {
		return err
	}
	// The old set, now beside.
	if err := os.RemoveAll(next); err != nil {
		return fmt.Errorf("pin: %w", err)
	}
	return nil
}

// pinAgain pins m at path as well. Through a clone: Pin of a map that is
// pinned moves its pin, and does nothing if it was last pinned at path.
func pinAgain(m *ebpf.Map, path string) error {
	c, err := m.Clone()
	if err != nil {
		return err
	}
	defer c.Close()
	return c.Pin(path)
}

// nextSuffix names the directory beside the pinned maps where a resize
// pins the next set (bpffs refuses dots in names).
const nextSuffix = "_next"

// fill writes into the new tables the rules the kernel holds in the first
// kept slots and the keys of the table; their counts are copyStates'.
func (d *Datapath) fill(maps map[string]*ebpf.Map, kept int) error {
	idx := make([]uint32, kept)
	for i := range idx {
		idx[i] = uint32(i)
	}
	// Inactive slots keep their generations: sockets of retired rules
	// must still tell them apart.
	rules := make([]egressdRule, kept)
	metas := make([]egressdRuleMeta, kept)
	if err := batchRead(d.objs.Rules, rules); err != nil {
		return fmt.Errorf("read rules: %w", err)
	}
	if err := batchRead(d.objs.RuleMetas, metas); err != nil {
		return fmt.Errorf("read rule metadata: %w", err)
	}
	if err := batchWrite(maps["rules"], idx, rules); err != nil {
		return fmt.Errorf("write rules: %w", err)
	}
	if err := batchWrite(maps["rule_metas"], idx, metas); err != nil {
		return fmt.Errorf("write rule metadata: %w", err)
	}
	for id, class := range d.hints.scopes {
		if err := maps["scopes"].Update(id, class, ebpf.UpdateAny); err != nil {
			return fmt.Errorf("write scope: %w", err)
		}
	}
	var puts []keyPut
	for k, i := range d.t.byKey {
		puts = append(puts, keyPut{key: k, idx: i})
	}
	into := &Datapath{objs: egressdObjects{egressdMaps: egressdMaps{RuleExact: maps["rule_exact"], RulePrefixes: maps["rule_prefixes"]}}}
	if err := into.putKeys(puts); err != nil {
		return fmt.Errorf("write rule keys: %w", err)
	}
	return nil
}

// copyStates writes into the new tables the counts, buckets, windows and
// latency of the first kept slots, and returns what it copied.
func copyStates(from egressdObjects, maps map[string]*ebpf.Map, kept int) (*snapshot, error) {
	snap, err := takeSnapshot(&from.egressdMaps, kept)
	if err != nil {
		return nil, err
	}
	if err := snap.write(maps["rule_states"], maps["latency"]); err != nil {
		return nil, err
	}
	return snap, nil
}

// swap points every attached program at its counterpart in objs, waits
// for the old ones to finish, and adds to the new tables what the old
// programs counted since the copy. Should an attachment refuse, those
// already swapped go back and the old tables get what the new programs
// counted meanwhile.
func (d *Datapath) swap(objs *egressdObjects, kept int, copied *snapshot, next *Datapath) error {
	var swapped []program
	for _, p := range allPrograms {
		l, ok := d.links[p.name]
		if !ok {
			continue
		}
		if err := l.Update(p.prog(objs)); err != nil {
			err = fmt.Errorf("update %s: %w", p.name, err)
			for _, q := range swapped {
				err = errors.Join(err, d.links[q.name].Update(q.prog(&d.objs)))
			}
			// The new tables counted since the copy too: theirs go
			// back to the old.
			return errors.Join(err, settle(next, d, kept, copied))
		}
		swapped = append(swapped, p)
	}
	return settle(d, next, kept, copied)
}

// settle waits until no program runs on from's tables, and adds to to's
// what from counted since copied was taken of it.
func settle(from, to *Datapath, kept int, copied *snapshot) error {
	if err := waitForPrograms(); err != nil {
		return err
	}
	now, err := takeSnapshot(&from.objs.egressdMaps, kept)
	if err != nil {
		return err
	}
	for slot := range kept {
		a, ok := copied.delta(now, slot)
		if !ok {
			continue
		}
		if err := merge(&to.objs, &a); err != nil {
			return fmt.Errorf("carry over counts: %w", err)
		}
	}
	return nil
}

// merge adds a's gains to its slot's state, with the programs running.
func merge(objs *egressdObjects, a *egressdMergeArgs) error {
	buf := unsafe.Slice((*byte)(unsafe.Pointer(a)), unsafe.Sizeof(*a))
	ret, err := objs.EgressdMerge.Run(&ebpf.RunOptions{Context: buf})
	if err == nil && ret != 0 {
		err = fmt.Errorf("slot %d not found", a.Slot)
	}
	return err
}

// waitForPrograms returns once every BPF program running when it was
// called has finished: the kernel waits for them (synchronize_rcu) before
// an update of a map of maps returns, so that its caller knows no program
// still uses the old inner map. The programs here run under RCU too.
func waitForPrograms() error {
	inner := &ebpf.MapSpec{Type: ebpf.Array, KeySize: 4, ValueSize: 4, MaxEntries: 1}
	outer, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.ArrayOfMaps, KeySize: 4, ValueSize: 4, MaxEntries: 1, InnerMap: inner})
	if err != nil {
		return fmt.Errorf("wait for programs: %w", err)
	}
	defer outer.Close()
	m, err := ebpf.NewMap(inner)
	if err != nil {
		return fmt.Errorf("wait for programs: %w", err)
	}
	defer m.Close()
	if err := outer.Update(uint32(0), m, ebpf.UpdateAny); err != nil {
		return fmt.Errorf("wait for programs: %w", err)
	}
	return nil
}

// snapshot is the first slots of rule_states and latency, read under the
// states' locks, with the responses of rule_responses in the states'
// counters: the new tables count from there.
type snapshot struct {
	states []egressdRuleState
	hists  []egressdHist
}

func takeSnapshot(from *egressdMaps, kept int) (*snapshot, error) {
	s := &snapshot{states: make([]egressdRuleState, kept), hists: make([]egressdHist, kept*int(egressdSampleKindSAMPLE_LEN))}
	if err := batchRead(from.RuleStates, s.states, ebpf.LookupLock); err != nil {
		return nil, fmt.Errorf("read rule states: %w", err)
	}
	responses := make([]egressdResponseCount, kept)
	if err := batchRead(from.RuleResponses, responses); err != nil {
		return nil, fmt.Errorf("read responses: %w", err)
	}
	for i := range s.states {
		addResponses(&s.states[i], &responses[i])
	}
	if err := batchRead(from.Latency, s.hists); err != nil {
		return nil, fmt.Errorf("read latency: %w", err)
	}
	return s, nil
}

func (s *snapshot) write(states, latency *ebpf.Map) error {
	idx := make([]uint32, len(s.hists))
	for i := range idx {
		idx[i] = uint32(i)
	}
	if err := batchWrite(states, idx[:len(s.states)], s.states); err != nil {
		return fmt.Errorf("write rule states: %w", err)
	}
	if err := batchWrite(latency, idx, s.hists); err != nil {
		return fmt.Errorf("write latency: %w", err)
	}
	return nil
}

// delta is what slot gained from s to now, as egressd_merge takes it;
// false when nothing changed.
func (s *snapshot) delta(now *snapshot, slot int) (egressdMergeArgs, bool) {
	a, b := &s.states[slot], &now.states[slot]
	m := egressdMergeArgs{Slot: uint32(slot), Epoch: b.Epoch, Live: b.Live - a.Live, Spent: int64(b.Spent - a.Spent),
		BucketTokens: b.Tokens, RefilledNs: b.RefilledNs}
	changed := m.Live != 0 || m.Spent != 0
	for i := range m.Counters {
		m.Counters[i] = b.Counters[i] - a.Counters[i]
		changed = changed || m.Counters[i] != 0
	}
	// A bucket lost a token to each connection it admitted, shadow
	// mode's over-limit ones aside; other shapes have no tokens to lose.
	took := m.Counters[egressdCounterCOUNTER_ADMITTED] - m.Counters[egressdCounterCOUNTER_SHADOW_REFUSED]
	m.Tokens = took * 1_000_000_000
	// A segment the copy had is counted from there; one started after
	// the copy (another segment, or the state started afresh: another
	// epoch) is counted whole.
	for i := range b.SegmentId {
		m.SegmentId[i] = b.SegmentId[i]
		m.SegmentCount[i] = b.SegmentCount[i]
		// Never less than the copy's (a count of 2^32 - k would refuse
		// everything until the segment leaves the window).
		if b.SegmentId[i] == a.SegmentId[i] && b.Epoch == a.Epoch && b.SegmentCount[i] >= a.SegmentCount[i] {
			m.SegmentCount[i] -= a.SegmentCount[i]
		}
		changed = changed || m.SegmentCount[i] != 0
	}
	for k := range m.HistSum {
		ha, hb := &s.hists[slot*len(m.HistSum)+k], &now.hists[slot*len(m.HistSum)+k]
		m.HistSum[k] = hb.SumNs - ha.SumNs
		for i := range m.HistBuckets[k] {
			m.HistBuckets[k][i] = hb.Buckets[i] - ha.Buckets[i]
			changed = changed || m.HistBuckets[k][i] != 0
		}
	}
	return m, changed
}

// batchRead reads the first len(out) entries of an array map.
func batchRead[V any](m *ebpf.Map, out []V, flags ...ebpf.MapLookupFlags) error {
	if len(out) == 0 {
		return nil
	}
	keys := make([]uint32, len(out))
	opts := &ebpf.BatchOptions{}
	for _, f := range flags {
		opts.ElemFlags |= uint64(f)
	}
	var cursor ebpf.MapBatchCursor
	for done := 0; done < len(out); {
		n, err := m.BatchLookup(&cursor, keys[done:], out[done:], opts)
		done += n
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			break
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// batches reads an array map's entries in key order, a batch at a time,
// into a buffer it reuses.
type batches[V any] struct {
	m      *ebpf.Map
	cursor ebpf.MapBatchCursor
	keys   []uint32
	buf    []V
}

func newBatches[V any](m *ebpf.Map, size int) *batches[V] {
	return &batches[V]{m: m, keys: make([]uint32, size), buf: make([]V, size)}
}

// next reads the next n entries, n at most the size it was made with; what
// it returns is overwritten by the next call.
func (b *batches[V]) next(n int) ([]V, error) {
	out := b.buf[:n]
	for done := 0; done < n; {
		got, err := b.m.BatchLookup(&b.cursor, b.keys[done:n], out[done:], nil)
		done += got
		if errors.Is(err, ebpf.ErrKeyNotExist) && done < n {
			return nil, fmt.Errorf("map ends after %d of %d entries: %w", done, n, err)
		}
		if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return nil, err
		}
	}
	return out, nil
}

func batchWrite[V any](m *ebpf.Map, keys []uint32, vals []V) error {
	if len(keys) == 0 {
		return nil
	}
	_, err := m.BatchUpdate(keys, vals, nil)
	return err
}

// namedMaps are the datapath's maps by their names in egressd.c.
func (d *Datapath) namedMaps() map[string]*ebpf.Map {
	o := &d.objs.egressdMaps
	return map[string]*ebpf.Map{
		"config": o.Config, "rule_exact": o.RuleExact, "rule_prefixes": o.RulePrefixes, "scopes": o.Scopes,
		"ports": o.Ports, "udp_ports": o.UdpPorts, "udp_dests": o.UdpDests, "udp_socks": o.UdpSocks, "udp_table": o.UdpTable,
		"rules": o.Rules, "rule_metas": o.RuleMetas, "rule_states": o.RuleStates,
		"latency": o.Latency, "rule_responses": o.RuleResponses, "global_counters": o.GlobalCounters, "sock_table": o.SockTable,
		"sock_overflow": o.SockOverflow, "sock_states": o.SockStates, "refusal_runs": o.RefusalRuns, "refusal_log": o.RefusalLog,
		"woken": o.Woken, "samples": o.Samples, "bell_armed": o.BellArmed, "refusal_bell": o.RefusalBell,
	}
}

// keepUnresized makes objs use d's own objects for the maps a resize did
// not replace, closing its clones: readers of those maps hold d's.
func (d *Datapath) keepUnresized(objs *egressdObjects) {
	mine := d.namedMaps()
	theirs := (&Datapath{objs: *objs}).namedMaps()
	for name, m := range theirs {
		if slices.Contains(resizedMaps, name) {
			continue
		}
		m.Close()
	}
	o := &objs.egressdMaps
	o.Config, o.Ports, o.GlobalCounters, o.SockTable, o.SockStates = mine["config"], mine["ports"], mine["global_counters"], mine["sock_table"], mine["sock_states"]
	o.SockOverflow, o.UdpPorts, o.UdpDests, o.UdpSocks, o.UdpTable = mine["sock_overflow"], mine["udp_ports"], mine["udp_dests"], mine["udp_socks"], mine["udp_table"]
	o.RefusalRuns, o.RefusalLog, o.Woken, o.Samples = mine["refusal_runs"], mine["refusal_log"], mine["woken"], mine["samples"]
	o.BellArmed, o.RefusalBell = mine["bell_armed"], mine["refusal_bell"]
}

// maps returns the maps in use, for callers that do not hold d.mu: a
// resize replaces the resized ones.
func (d *Datapath) maps() *egressdMaps {
	d.mu.Lock()
	defer d.mu.Unlock()
	m := d.objs.egressdMaps
	return &m
}

// closePrograms closes the programs of objs.
func (d *Datapath) closePrograms(objs *egressdObjects) {
	objs.egressdPrograms.Close()
}
