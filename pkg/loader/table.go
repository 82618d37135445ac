package loader

import (
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
)

// slot is user space's view of one entry of the rule tables.
type slot struct {
	rule   Rule
	gen    uint32
	epoch  uint32
	active bool
}

// table is user space's model of the kernel's rule tables: which rule
// holds which slot and which keys. Changes are planned against it in pure
// Go, written to the kernel, and committed to it only once every write
// succeeded, so that it always says what the kernel enforces.
type table struct {
	slots   []slot
	byName  map[string]uint32
	byKey   map[ruleKey]uint32
	free    []uint32 // least recently freed first
	nextGen uint32
	uses    uses
	// maxKeys is the size of each key table: whole addresses, prefixes.
	maxKeys int
	// order is the slot of each rule of the last whole-set plan, in its
	// order: where the next one looks for each rule first.
	order []int32
}

// keysPerRule is how many destinations each rule of a full table may have
// on average: the key tables take memory only for the keys they hold.
const keysPerRule = 4

// SlotsFor is the fewest rule slots whose tables hold rules: one a rule,
// and keysPerRule whole addresses and as many prefixes a slot (a rule
// whose host name resolves to many addresses takes more keys).
func SlotsFor(rules []Rule) int {
	var exact, prefixes int
	for i := range rules {
		for _, k := range ruleKeys(&rules[i]) {
			if k.exact() {
				exact++
			} else {
				prefixes++
			}
		}
	}
	perSlot := func(keys int) int { return (keys + keysPerRule - 1) / keysPerRule }
	return max(len(rules), perSlot(exact), perSlot(prefixes))
}

// newTable makes an empty table. Generations start at 1: a slot of
// generation 0 was never used, and its counts are zero.
func newTable(size, maxKeys int) *table {
	return &table{slots: make([]slot, size), byName: map[string]uint32{}, byKey: map[ruleKey]uint32{}, uses: newUses(), maxKeys: maxKeys, nextGen: 1}
}

// emptyTable is the table of kernel tables just made, as readTable would
// read it back: every slot free, in order, and the next generation one
// past the largest it could find.
func emptyTable(size, maxKeys int) *table {
	t := newTable(size, maxKeys)
	t.free = make([]uint32, size)
	for i := range t.free {
		t.free[i] = uint32(i)
	}
	t.nextGen++
	return t
}

// resize makes the table n slots and maxKeys keys each for whole
// addresses and prefixes. New slots are free, after those free already;
// slots cut off must be free.
func (t *table) resize(n, maxKeys int) {
	old := len(t.slots)
	if n > old {
		t.slots = append(t.slots, make([]slot, n-old)...)
		for i := old; i < n; i++ {
			t.free = append(t.free, uint32(i))
		}
	} else {
		t.slots = t.slots[:n]
		t.free = slices.DeleteFunc(t.free, func(i uint32) bool { return int(i) >= n })
	}
	t.maxKeys = maxKeys
}

// add records an active slot read back from the kernel.
func (t *table) add(idx uint32, s slot) {
	t.slots[idx] = s
	t.byName[s.rule.Name] = idx
	keys := ruleKeys(&s.rule)
	for _, k := range keys {
		t.byKey[k] = idx
	}
	t.uses.add(&s.rule, keys, 1)
}

// change is one slot write.
type change struct {
	idx uint32
	// old is the slot before, in the table, until commit overwrites it
	// (a copy here would cost 100,000 rules 13 MB); zero when it was
	// free.
	old    *slot
	new    slot // after; inactive for a removal
	create bool // start the slot's counts afresh
	// The keys of old and new, worked out once (writes): a plan of
	// 100,000 rules needs them three times.
	oldKeys, newKeys []ruleKey
}

// keyPut makes a key match a slot.
type keyPut struct {
	key ruleKey
	idx uint32
}

// plan is a whole change of the rule tables and the kernel writes that
// make it, in the order apply performs them: keys that stop matching go
// first; new slots are zeroed and filled before their keys make them
// reachable.
type plan struct {
	changes []change
	taken   int // free slots used, from the head of the queue

	delKeys []ruleKey
	fresh   []uint32 // used slots whose state, counters and latency start again at zero
	freshOf []int    // the change of each of fresh
	metas   []uint32 // slots whose metadata is written
	metaOf  []int    // the change of each of metas
	rules   []uint32 // slots whose rule is written: every change's, in order
	putKeys []keyPut
	order   []int32 // a whole-set plan's: the slot of each of its rules
}

// hintsChange reports whether the lookup hints can change: only keys
// coming or going move them.
func (p *plan) hintsChange() bool { return len(p.delKeys) > 0 || len(p.putKeys) > 0 }

// hintsAfter returns the lookup hints once p is applied.
func (t *table) hintsAfter(p *plan) hints {
	u := t.uses.clone()
	for i := range p.changes {
		u.change(&p.changes[i])
	}
	return u.hints()
}

// The sets of programs attached only while some rule needs them.
const (
	optionalRequests = iota // the per-packet programs, for rules that track requests
	optionalUDP             // the UDP send and receive programs, for rules that count UDP
	optionalLen
)

// needs says which optional program sets the rules need.
func (u *uses) needs() [optionalLen]bool {
	return [optionalLen]bool{optionalRequests: u.requests > 0, optionalUDP: u.udp > 0}
}

// needsAfter says which optional program sets the rules need once p is
// applied.
func (t *table) needsAfter(p *plan) [optionalLen]bool {
	requests, udp := t.uses.requests, t.uses.udp
	for i := range p.changes {
		c := &p.changes[i]
		requests += needing(&c.new, func(r *Rule) bool { return r.Requests }) - needing(c.old, func(r *Rule) bool { return r.Requests })
		udp += needing(&c.new, udpRule) - needing(c.old, udpRule)
	}
	return [optionalLen]bool{optionalRequests: requests > 0, optionalUDP: udp > 0}
}

func udpRule(r *Rule) bool { return r.Protocols.Has(ProtoUDP) }

// needing is 1 if s holds an active rule for which need is true.
func needing(s *slot, need func(*Rule) bool) int {
	if s.active && need(&s.rule) {
		return 1
	}
	return 0
}

// plan works out the writes that put rules and delete the slots in gone,
// checking conflicts and capacity, without touching the kernel or the
// table. New rules take free slots from the head of the queue.
func (t *table) plan(rules []Rule, gone []uint32) (plan, error) {
	return t.planWith(rules, gone, false)
}

// replacing is the plan that makes rules the whole table: every slot no
// rule holds is deleted. The slots are found as plan looks the rules up,
// not by looking every name of the table up in the rules' names.
func (t *table) replacing(rules []Rule) (plan, error) {
	return t.planWith(rules, nil, true)
}

// planWith is plan, and with replace, replacing.
func (t *table) planWith(rules []Rule, gone []uint32, replace bool) (plan, error) {
	var p plan
	// The slots of the rules in the batch, and of those an unchanged rule
	// keeps, which keeps its keys: a reload of 100,000 rules that changes a
	// few looks up the keys of those few alone.
	var inBatch, kept []bool
	if len(t.byName) > 0 || len(gone) > 0 {
		inBatch, kept = make([]bool, len(t.slots)), make([]bool, len(t.slots))
	}
	// same marks the rules that are in the table as they are: nothing to
	// write. held is the slot each rule holds, -1 for a new rule until it
	// takes one.
	same := make([]bool, len(rules))
	held := make([]int32, len(rules))
	n := len(rules)
	for i := range rules {
		held[i] = -1
		if idx, ok := t.slotOf(i, rules[i].Name); ok {
			held[i] = int32(idx)
			inBatch[idx] = true
			if r := rules[i].WithDefaults(); sameRule(&t.slots[idx].rule, &r) {
				same[i], kept[idx] = true, true
				n--
			}
		}
	}
	if replace && inBatch != nil {
		for idx := range t.slots {
			if t.slots[idx].active && !inBatch[idx] {
				gone = append(gone, uint32(idx))
			}
		}
	}
	p.changes = make([]change, 0, len(gone)+n)
	for _, idx := range gone {
		inBatch[idx] = true
		old := &t.slots[idx]
		p.changes = append(p.changes, change{idx: idx, old: old, new: slot{rule: old.rule, gen: old.gen}})
	}
	claimed := make(map[ruleKey]string, n)
	gen := t.nextGen
	var errs []error
	for i := range rules {
		if same[i] {
			continue
		}
		r := rules[i].WithDefaults()
		conflict := false
		keys := ruleKeys(&r)
		for _, k := range keys {
			other, ok := claimed[k]
			if !ok {
				// A key held by a rule outside the batch, or by one the
				// batch keeps unchanged, stays held; one held by a rule
				// the batch changes is free unless it claims it again,
				// which the claimed check catches.
				if idx, held := t.byKey[k]; held && (!inBatch[idx] || kept[idx]) {
					other, ok = t.slots[idx].rule.Name, true
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
		if held[i] >= 0 {
			idx := uint32(held[i])
			old := &t.slots[idx]
			next := slot{rule: r, gen: old.gen, epoch: old.epoch, active: true}
			if restartsState(&old.rule, &r) {
				next.epoch++
			}
			p.changes = append(p.changes, change{idx: idx, old: old, new: next, newKeys: keys})
			continue
		}
		if p.taken == len(t.free) {
			errs = append(errs, fmt.Errorf("rule %s: %w (%d rules)", r.Name, ErrFull, len(t.slots)))
			continue
		}
		idx := t.free[p.taken]
		p.taken++
		p.changes = append(p.changes, change{idx: idx, old: &t.slots[idx], new: slot{rule: r, gen: gen, epoch: 1, active: true}, create: true, newKeys: keys})
		held[i] = int32(idx)
		gen++
	}
	if err := errors.Join(errs...); err != nil {
		return plan{}, err
	}
	if replace {
		p.order = held // every rule holds a slot now
	}
	p.writes()
	if err := t.checkKeys(&p); err != nil {
		return plan{}, err
	}
	return p, nil
}

// slotOf is the slot of the rule named name, looked for first where the
// last whole-set plan put its i-th rule: a reload of rules that kept their
// places then walks the slots in turn, not the map of 100,000 names.
func (t *table) slotOf(i int, name string) (uint32, bool) {
	if i < len(t.order) {
		if idx := t.order[i]; idx >= 0 && int(idx) < len(t.slots) && t.slots[idx].active && t.slots[idx].rule.Name == name {
			return uint32(idx), true
		}
	}
	idx, ok := t.byName[name]
	return idx, ok
}

// checkKeys refuses a plan whose keys would not fit the kernel's key
// tables.
func (t *table) checkKeys(p *plan) error {
	exact, prefixes := t.uses.exact, t.uses.prefixes
	for _, k := range p.delKeys {
		if k.exact() {
			exact--
		} else {
			prefixes--
		}
	}
	for _, k := range p.putKeys {
		if k.key.exact() {
			exact++
		} else {
			prefixes++
		}
	}
	if exact > t.maxKeys || prefixes > t.maxKeys {
		return fmt.Errorf("%w: %d addresses and %d prefixes, the key tables hold %d each", ErrFull, exact, prefixes, t.maxKeys)
	}
	return nil
}

// deletion plans the removal of the rule in slot idx.
func (t *table) deletion(idx uint32) plan {
	old := &t.slots[idx]
	p := plan{changes: []change{{idx: idx, old: old, new: slot{rule: old.rule, gen: old.gen}}}}
	p.writes()
	return p
}

// writes derives the kernel writes from the changes.
func (p *plan) writes() {
	p.rules = make([]uint32, 0, len(p.changes))
	p.putKeys = make([]keyPut, 0, len(p.changes))
	for i := range p.changes {
		c := &p.changes[i]
		c.oldKeys = keysOf(c.old)
		if c.newKeys == nil {
			c.newKeys = keysOf(&c.new)
		}
		oldKeys, newKeys := c.oldKeys, c.newKeys
		for _, k := range oldKeys {
			if !slices.Contains(newKeys, k) {
				p.delKeys = append(p.delKeys, k)
			}
		}
		for _, k := range newKeys {
			if !slices.Contains(oldKeys, k) {
				p.putKeys = append(p.putKeys, keyPut{key: k, idx: c.idx})
			}
		}
		// A slot never used since its table was made is zero already.
		if c.create && c.old.gen != 0 {
			p.fresh, p.freshOf = append(p.fresh, c.idx), append(p.freshOf, i)
		}
		if c.create || (c.new.active && metaOf(&c.new.rule) != metaOf(&c.old.rule)) {
			p.metas, p.metaOf = append(p.metas, c.idx), append(p.metaOf, i)
		}
		p.rules = append(p.rules, c.idx)
	}
}

// keysOf returns the keys of an active slot.
func keysOf(s *slot) []ruleKey {
	if !s.active {
		return nil
	}
	return ruleKeys(&s.rule)
}

// commit makes the table what p makes the kernel.
func (t *table) commit(p *plan) {
	t.free = t.free[p.taken:]
	if p.order != nil {
		t.order = p.order
	}
	// Maps grown by many rules at once are made at their size: a start
	// with 100,000 rules would otherwise grow them a dozen times.
	if len(p.changes) > len(t.byName) {
		t.byName = grown(t.byName, len(p.changes))
		t.byKey = grown(t.byKey, len(p.changes))
	}
	// Only names and keys that come or go touch the maps: a reload that
	// changes the limits of 100,000 rules changes neither, and deleting
	// and adding them again cost it 80 ms. A name keeps its slot for the
	// whole plan (a plan never removes a name it puts); a key may move
	// between slots, so key deletions go first.
	for i := range p.changes {
		c := &p.changes[i]
		sameName := c.old.active && c.new.active && c.old.rule.Name == c.new.rule.Name
		if c.old.active && !sameName {
			delete(t.byName, c.old.rule.Name)
		}
		if c.new.active && !sameName {
			t.byName[c.new.rule.Name] = c.idx
		}
		if c.old.active && !c.new.active {
			t.free = append(t.free, c.idx)
		}
		t.uses.change(c)
		t.slots[c.idx] = c.new // and c.old with it
		if c.create {
			t.nextGen = max(t.nextGen, c.new.gen+1)
		}
	}
	for _, k := range p.delKeys {
		delete(t.byKey, k)
	}
	for _, kp := range p.putKeys {
		t.byKey[kp.key] = kp.idx
	}
}

// grown returns m, or a copy of it with room for more entries.
func grown[K comparable, V any](m map[K]V, more int) map[K]V {
	g := make(map[K]V, len(m)+more)
	maps.Copy(g, m)
	return g
}

// ruleMeta is what the kernel keeps of a rule for user space alone: what
// a restarted loader needs, with the rule's keys, to rebuild the rule.
type ruleMeta struct {
	name  string
	scope Scope
	port  uint16
}

func metaOf(r *Rule) ruleMeta { return ruleMeta{name: r.Name, scope: r.Scope, port: r.Port} }

// sameRule reports whether two rules, with their defaults, are the same:
// a plan writes nothing for a rule that does not change.
func sameRule(a, b *Rule) bool {
	return a.Name == b.Name && a.Scope == b.Scope && a.Port == b.Port && a.Shape == b.Shape &&
		a.Limit == b.Limit && a.Burst == b.Burst && a.Window == b.Window && a.Segments == b.Segments &&
		a.Granted == b.Granted && a.Until.Equal(b.Until) && a.LimitAfter == b.LimitAfter && a.Shadow == b.Shadow && a.Errno == b.Errno && a.Samples == b.Samples &&
		a.Requests == b.Requests && a.Protocols == b.Protocols && a.FlowIdle == b.FlowIdle && slices.Equal(a.Dests, b.Dests)
}

// restartsState reports whether moving from old to new parameters must
// restart the bucket or window (a shape or segment layout change).
func restartsState(old, new *Rule) bool {
	return old.Shape != new.Shape || old.Segments != new.Segments || old.Window != new.Window
}

// Key classes, so that connect() skips lookups that cannot match: scoped
// or host-wide, a port or any port, each with a bit for whole addresses
// (exact keys) and one for shorter prefixes, for each protocol apart
// (classBits of them each, the kernel's protocol number times classBits
// up). They mirror CLASS_*, EXACT, PREFIX and CLASS_BITS in egressd.c.
const (
	classScopedPort = iota
	classScopedAny
	classHostPort
	classHostAny
	classLen

	classBits = 8
)

// protoCount is how many protocols rules count.
const protoCount = len(kernelProtos)

// classBit is the hint bit of a key of class c.
func classBit(c int, exact bool) int {
	if exact {
		return c
	}
	return c + classLen
}

func classOf(r *Rule) int {
	switch {
	case r.Scope.HostWide() && r.Port == 0:
		return classHostAny
	case r.Scope.HostWide():
		return classHostPort
	case r.Port == 0:
		return classScopedAny
	}
	return classScopedPort
}

// exact reports whether a key is a whole address, kept in the kernel's
// hash rather than its prefix trie.
func (k ruleKey) exact() bool { return k.dest.Bits() == 128 }

// uses counts what the active rules use, so that the lookup hints and the
// key tables' occupancy follow a change without a walk over every rule.
// Classes and ports are counted by protocol.
type uses struct {
	bits     [protoCount][2 * classLen]int
	levels   [MaxScopeLevel + 1]int
	scopes   map[uint64]*[protoCount][2 * classLen]int
	ports    [protoCount]map[uint16]int
	udpDests map[netip.Prefix]int // UDP keys by destination
	requests int                  // rules that track requests
	udp      int                  // rules that count UDP flows
	exact    int                  // keys in the kernel's hash
	prefixes int                  // keys in its trie
}

func newUses() uses {
	u := uses{scopes: map[uint64]*[protoCount][2 * classLen]int{}, udpDests: map[netip.Prefix]int{}}
	for p := range u.ports {
		u.ports[p] = map[uint16]int{}
	}
	return u
}

func (u *uses) clone() uses {
	c := *u
	c.scopes = make(map[uint64]*[protoCount][2 * classLen]int, len(u.scopes))
	for id, n := range u.scopes {
		cp := *n
		c.scopes[id] = &cp
	}
	for p := range u.ports {
		c.ports[p] = maps.Clone(u.ports[p])
	}
	c.udpDests = maps.Clone(u.udpDests)
	return c
}

// change counts a change whose keys writes worked out.
func (u *uses) change(c *change) {
	if c.old.active {
		u.add(&c.old.rule, c.oldKeys, -1)
	}
	if c.new.active {
		u.add(&c.new.rule, c.newKeys, 1)
	}
}

// add counts n of rule r, whose keys are keys.
func (u *uses) add(r *Rule, keys []ruleKey, n int) {
	if r.Requests {
		u.requests += n
	}
	if r.Protocols.Has(ProtoUDP) {
		u.udp += n
	}
	class := classOf(r)
	for _, k := range keys {
		bit := classBit(class, k.exact())
		u.bits[k.proto][bit] += n
		if k.exact() {
			u.exact += n
		} else {
			u.prefixes += n
		}
		if k.proto == udpProto {
			u.udpDests[k.dest] += n
			if u.udpDests[k.dest] == 0 {
				delete(u.udpDests, k.dest)
			}
		}
		if !r.Scope.HostWide() {
			sc := u.scopes[r.Scope.CgroupID]
			if sc == nil {
				sc = new([protoCount][2 * classLen]int)
				u.scopes[r.Scope.CgroupID] = sc
			}
			sc[k.proto][bit] += n
			if *sc == ([protoCount][2 * classLen]int{}) {
				delete(u.scopes, r.Scope.CgroupID)
			}
		}
	}
	if !r.Scope.HostWide() {
		u.levels[r.Scope.Level] += n
	}
	if r.Port == 0 {
		return
	}
	for p, kp := range kernelProtos {
		if !r.Protocols.Has(kp.bit) {
			continue
		}
		u.ports[p][r.Port] += n
		if u.ports[p][r.Port] == 0 {
			delete(u.ports[p], r.Port)
		}
	}
}

// hints are what connect() and a UDP send read to skip lookups that
// cannot match: each protocol's classes classBits apart.
type hints struct {
	classes  uint32
	levels   uint32 // bit L: some scoped rule names a cgroup at depth L
	scopes   map[uint64]uint32
	ports    [protoCount][65536 / 64]uint64 // bit p: some rule of the protocol names port p
	udpDests udpBuckets                     // see udpBuckets
}

// udpBuckets mirrors udp_dests in egressd.c: where UDP rules'
// destinations are, for a UDP send to look up a rule only if one may hold
// its address. The first udpPrefixBits are set by prefixes shorter than a
// network (an IPv4 /24, an IPv6 /48), one for each IPv4 /16 and each IPv6
// /32 (its first 16 bits XOR its next 16) they hold; the 1 << udpHashBits
// after by networks and whole addresses, hashed: a bit for each address
// of a prefix of at most 128 (an IPv4 /25 or longer, an IPv6 /121 or
// longer), and one for each network any other longer prefix is in (each
// of an IPv4 /17 to /23's).
type udpBuckets [(udpPrefixBits + 1<<udpHashBits) / 64]uint64

const (
	udpPrefixBits = 2 << 16
	udpHashBits   = 20
	// A prefix of at most 2^udpAddrBits addresses sets a bit per address
	// rather than one for its network.
	udpAddrBits = 7
	// What a network's hash is salted with (UDP_NET4, UDP_NET6).
	udpNet4 = 0x55555555
	udpNet6 = 0xaaaaaaaa
)

// ipv4Mapped holds the IPv4 addresses, as rule keys and the kernel write
// them.
var ipv4Mapped = netip.MustParsePrefix("::ffff:0:0/96")

// add sets the bits of the addresses of p, a prefix of 16-byte addresses.
func (u *udpBuckets) add(p netip.Prefix) {
	a, bits := p.Addr().As16(), p.Bits()
	w := func(i int) uint32 { return binary.NativeEndian.Uint32(a[i:]) }
	if bits >= 128-udpAddrBits {
		// Each whole address: a send to another of the network's
		// addresses then finds its bits clear.
		for x := range 1 << (128 - bits) {
			a[15] = a[15]&^byte(1<<(128-bits)-1) | byte(x)
			u.hash(w(0) ^ w(4) ^ w(8) ^ w(12))
		}
		return
	}
	if bits >= ipv4Mapped.Bits() && ipv4Mapped.Contains(p.Addr()) {
		switch v4 := bits - ipv4Mapped.Bits(); {
		case v4 >= 24:
			u.hash(w(12)&mask(0xff, 0xff, 0xff, 0) ^ udpNet4)
		case v4 > 16:
			for x := range 1 << (24 - v4) {
				a[14] = a[14]&^byte(1<<(24-v4)-1) | byte(x)
				u.hash(w(12)&mask(0xff, 0xff, 0xff, 0) ^ udpNet4)
			}
		default:
			u.span(int(a[12])<<8|int(a[13]), 16-v4)
		}
		return
	}
	if p.Contains(ipv4Mapped.Addr()) {
		u.span(0, 16)
	}
	hi, lo := int(a[0])<<8|int(a[1]), int(a[2])<<8|int(a[3])
	switch {
	case bits >= 48:
		u.hash(w(0) ^ w(4)&mask(0xff, 0xff, 0, 0) ^ udpNet6)
	case bits >= 32:
		u.set(1<<16 + (hi ^ lo))
	case bits >= 16:
		lo &^= 1<<(32-bits) - 1
		for x := range 1 << (32 - bits) {
			u.set(1<<16 + (hi ^ (lo | x)))
		}
	default:
		u.span(1<<16, 16)
	}
}

// mask is the word of these bytes, as the kernel loads it.
func mask(b ...byte) uint32 { return binary.NativeEndian.Uint32(b) }

// hash sets the bit of a network or address whose words, as the kernel
// loads them, XOR to folded (udp_hash).
func (u *udpBuckets) hash(folded uint32) {
	u.set(udpPrefixBits + int(folded*0x9e3779b1>>(32-udpHashBits)))
}

// span sets the buckets from b whose last free bits vary (b's are 0): all
// 2^free of them, b and those after it; none vary for free <= 0.
func (u *udpBuckets) span(b, free int) {
	free = max(free, 0)
	b &^= 1<<free - 1
	for x := range 1 << free {
		u.set(b + x)
	}
}

func (u *udpBuckets) set(b int) { u[b/64] |= 1 << (b % 64) }

func (u *uses) hints() hints {
	h := hints{scopes: make(map[uint64]uint32, len(u.scopes))}
	for proto, bits := range u.bits {
		for bit, n := range bits {
			if n > 0 {
				h.classes |= 1 << (proto*classBits + bit)
			}
		}
	}
	for lvl, n := range u.levels {
		if n > 0 {
			h.levels |= 1 << lvl
		}
	}
	for id, sc := range u.scopes {
		for proto, bits := range sc {
			for bit, n := range bits {
				if n > 0 {
					h.scopes[id] |= 1 << (proto*classBits + bit)
				}
			}
		}
	}
	for proto, ports := range u.ports {
		for p := range ports {
			h.ports[proto][p/64] |= 1 << (p % 64)
		}
	}
	for p := range u.udpDests {
		h.udpDests.add(p)
	}
	return h
}

// rules returns the active slots' rules, in slot order.
func (t *table) rules() []Rule {
	var out []Rule
	for _, s := range t.slots {
		if s.active {
			out = append(out, s.rule)
		}
	}
	return out
}
