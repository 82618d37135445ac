//go:build linux

package loader

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"syscall"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/features"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/egressd/egressd/pkg/cgroups"
)

// Defaults for Config.
const (
	DefaultPinDir   = "/sys/fs/bpf/egressd"
	DefaultMaxRules = 4096
)

// Config says where the datapath attaches and pins. Nil means defaults.
type Config struct {
	// Cgroup is the cgroup v2 directory the programs attach to; they see
	// every socket created below it. Empty means the cgroup2 root: the
	// whole host.
	Cgroup string
	// PinDir is the bpffs directory that keeps maps and links alive across
	// restarts. Empty means DefaultPinDir.
	PinDir string
	// MaxRules sizes the rule tables. 0 means DefaultMaxRules. A datapath
	// adopted from pins keeps the size it was created with.
	MaxRules int
	// VerifierLog puts the verifier's whole log into load errors.
	VerifierLog bool
}

func (c *Config) withDefaults() (Config, error) {
	var out Config
	if c != nil {
		out = *c
	}
	if out.PinDir == "" {
		out.PinDir = DefaultPinDir
	}
	if out.MaxRules == 0 {
		out.MaxRules = DefaultMaxRules
	}
	if out.MaxRules < 1 || out.MaxRules > 1<<20 {
		return out, fmt.Errorf("max rules %d: outside 1..%d", out.MaxRules, 1<<20)
	}
	dir, err := cgroups.Resolve(out.Cgroup)
	if err != nil {
		return out, fmt.Errorf("cgroup: %w", err)
	}
	out.Cgroup = dir
	return out, nil
}

// Kernel flag and class bits; they mirror RULE_F_* and CLASS_* in egressd.c.
const (
	flagActive   = 1 << 0
	flagShadow   = 1 << 1
	flagSamples  = 1 << 2
	flagRequests = 1 << 3

	classScopedPort = 1 << 0
	classScopedAny  = 1 << 1
	classHostPort   = 1 << 2
	classHostAny    = 1 << 3

	ruleKeyFixedBits = 96
)

// program is one BPF program and where it attaches.
type program struct {
	name   string
	attach ebpf.AttachType
	prog   func(*egressdObjects) *ebpf.Program
}

// Release paths attach before admission, so no slot is ever taken that
// could not be given back; ingress before egress, so no request is armed
// that could not be disarmed.
var (
	connPrograms = []program{
		{"sock_release", ebpf.AttachCgroupInetSockRelease, func(o *egressdObjects) *ebpf.Program { return o.EgressdSockRelease }},
		{"sockops", ebpf.AttachCGroupSockOps, func(o *egressdObjects) *ebpf.Program { return o.EgressdSockops }},
		{"connect4", ebpf.AttachCGroupInet4Connect, func(o *egressdObjects) *ebpf.Program { return o.EgressdConnect4 }},
		{"connect6", ebpf.AttachCGroupInet6Connect, func(o *egressdObjects) *ebpf.Program { return o.EgressdConnect6 }},
	}
	requestPrograms = []program{
		{"ingress", ebpf.AttachCGroupInetIngress, func(o *egressdObjects) *ebpf.Program { return o.EgressdIngress }},
		{"egress", ebpf.AttachCGroupInetEgress, func(o *egressdObjects) *ebpf.Program { return o.EgressdEgress }},
	}
)

// slot is user space's view of one entry of the rule tables.
type slot struct {
	rule   Rule
	gen    uint32
	epoch  uint32
	active bool
}

// Datapath is the loaded, attached and pinned kernel side. Its methods are
// safe for concurrent use. Closing it leaves enforcement in place.
type Datapath struct {
	mu       sync.Mutex
	objs     egressdObjects
	cfg      Config
	cgroupID uint64
	links    map[string]link.Link
	adopted  bool
	lock     *os.File // flock on the pin directory: one owner at a time
	closed   bool

	slots   []slot
	byName  map[string]uint32
	byKey   map[ruleKey]uint32
	free    []uint32 // least recently freed first
	nextGen uint32
	ncpu    int

	// What the kernel's lookup hints hold, so changes write only the
	// difference.
	hintScopes map[uint64]uint32
	hintPorts  [65536 / 64]uint64
	// trackingRequests counts active rules that track requests.
	trackingRequests int
}

func (d *Datapath) mapsDir() string  { return filepath.Join(d.cfg.PinDir, "maps") }
func (d *Datapath) linksDir() string { return filepath.Join(d.cfg.PinDir, "links") }

// Open loads the datapath and attaches it, or adopts the one pinned under
// cfg.PinDir: its maps, counts and attachment carry on, and its programs
// are replaced in place by this build's without a gap.
func Open(cfg *Config) (*Datapath, error) {
	c, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	if err := checkFeatures(); err != nil {
		return nil, err
	}
	d := &Datapath{cfg: c, links: map[string]link.Link{}, byName: map[string]uint32{}, byKey: map[ruleKey]uint32{}}
	if d.cgroupID, err = cgroups.ID(c.Cgroup); err != nil {
		return nil, err
	}
	if d.ncpu, err = ebpf.PossibleCPU(); err != nil {
		return nil, fmt.Errorf("possible cpus: %w", err)
	}
	if err := ensureBPFFS(c.PinDir); err != nil {
		return nil, err
	}
	for _, dir := range []string{d.mapsDir(), d.linksDir()} {
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return nil, fmt.Errorf("pin dir: %w", err)
		}
	}
	if d.lock, err = lockDir(c.PinDir); err != nil {
		return nil, err
	}
	if err := d.load(); err != nil {
		d.lock.Close()
		return nil, err
	}
	if err := d.adoptRules(); err != nil {
		d.closeFDs()
		return nil, err
	}
	if err := d.syncLookupHints(true); err != nil {
		d.closeFDs()
		return nil, err
	}
	if err := d.attachAll(connPrograms); err != nil {
		d.closeFDs()
		return nil, err
	}
	if err := d.syncRequestPrograms(true); err != nil {
		d.closeFDs()
		return nil, err
	}
	return d, nil
}

func checkFeatures() error {
	for _, mt := range []ebpf.MapType{ebpf.SkStorage, ebpf.RingBuf, ebpf.LPMTrie} {
		if err := features.HaveMapType(mt); err != nil {
			return fmt.Errorf("map type %v: %w", mt, errors.Join(ErrNotSupported, err))
		}
	}
	for _, pt := range []ebpf.ProgramType{ebpf.CGroupSockAddr, ebpf.SockOps, ebpf.CGroupSock, ebpf.CGroupSKB} {
		if err := features.HaveProgramType(pt); err != nil {
			return fmt.Errorf("program type %v: %w", pt, errors.Join(ErrNotSupported, err))
		}
	}
	if err := features.HaveV3ISA(); err != nil {
		return fmt.Errorf("atomics: %w", errors.Join(ErrNotSupported, err))
	}
	return nil
}

// lockDir takes an exclusive lock on the pin directory for the life of the
// Datapath, so that a second loader cannot rewrite the rules of a running
// one. The kernel drops it when the process dies, however it dies.
func lockDir(dir string) (*os.File, error) {
	f, err := os.Open(dir)
	if err != nil {
		return nil, fmt.Errorf("pin dir: %w", err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, fmt.Errorf("%w: another process has the datapath pinned at %s open", ErrBusy, dir)
		}
		return nil, fmt.Errorf("lock pin dir: %w", err)
	}
	return f, nil
}

const bpffsMagic = 0xcafe4a11

// ensureBPFFS mounts bpffs on the pin directory's parent when nothing is
// mounted there yet, as on hosts where systemd did not do it.
func ensureBPFFS(pinDir string) error {
	parent := filepath.Dir(filepath.Clean(pinDir))
	if err := os.MkdirAll(parent, 0o700); err != nil {
		return fmt.Errorf("bpffs: %w", err)
	}
	var fs unix.Statfs_t
	if err := unix.Statfs(parent, &fs); err != nil {
		return fmt.Errorf("bpffs: %w", err)
	}
	if fs.Type == bpffsMagic {
		return nil
	}
	if err := unix.Mount("bpffs", parent, "bpf", 0, "mode=0700"); err != nil {
		return fmt.Errorf("mount bpffs on %s: %w", parent, err)
	}
	return nil
}

// ruleTables are sized by MaxRules (latency by MaxRules per sample kind).
var ruleTables = []string{"rule_keys", "scopes", "rules", "rule_metas", "rule_states", "rule_counters"}

func (d *Datapath) load() error {
	spec, err := loadEgressd()
	if err != nil {
		return err
	}
	maxRules := d.cfg.MaxRules
	if m, err := ebpf.LoadPinnedMap(filepath.Join(d.mapsDir(), "rules"), nil); err == nil {
		maxRules = int(m.MaxEntries())
		m.Close()
		d.adopted = true
	}
	d.cfg.MaxRules = maxRules
	for _, name := range ruleTables {
		spec.Maps[name].MaxEntries = uint32(maxRules)
	}
	spec.Maps["latency"].MaxEntries = uint32(maxRules) * uint32(egressdSampleKindSAMPLE_LEN)
	opts := &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: d.mapsDir()}}
	if err := spec.LoadAndAssign(&d.objs, opts); err != nil {
		var ve *ebpf.VerifierError
		if errors.As(err, &ve) && d.cfg.VerifierLog {
			return fmt.Errorf("load programs: %+v", ve)
		}
		if errors.Is(err, ebpf.ErrMapIncompatible) {
			return fmt.Errorf("pinned maps in %s are from an incompatible version (uninstall first): %w", d.cfg.PinDir, err)
		}
		return fmt.Errorf("load programs: %w", err)
	}
	return nil
}

// attachAll attaches each program, or points an existing pinned link at
// this build's program, which swaps it atomically.
func (d *Datapath) attachAll(progs []program) error {
	for _, p := range progs {
		if _, ok := d.links[p.name]; ok {
			continue
		}
		path := filepath.Join(d.linksDir(), p.name)
		l, err := link.LoadPinnedLink(path, nil)
		switch {
		case err == nil:
			if err := d.adoptLink(l, p); err != nil {
				l.Close()
				return err
			}
		case errors.Is(err, os.ErrNotExist):
			l, err = link.AttachCgroup(link.CgroupOptions{Path: d.cfg.Cgroup, Attach: p.attach, Program: p.prog(&d.objs)})
			if err != nil {
				return fmt.Errorf("attach %s: %w", p.name, err)
			}
			if err := l.Pin(path); err != nil {
				l.Close()
				return fmt.Errorf("pin %s: %w", p.name, err)
			}
		default:
			return fmt.Errorf("load pinned %s: %w", p.name, err)
		}
		d.links[p.name] = l
	}
	return nil
}

func (d *Datapath) adoptLink(l link.Link, p program) error {
	info, err := l.Info()
	if err != nil {
		return fmt.Errorf("pinned %s: %w", p.name, err)
	}
	if cg := info.Cgroup(); cg == nil || cg.CgroupId != d.cgroupID {
		return fmt.Errorf("pinned %s is attached to another cgroup than %s (uninstall first)", p.name, d.cfg.Cgroup)
	}
	if err := l.Update(p.prog(&d.objs)); err != nil {
		return fmt.Errorf("update pinned %s: %w", p.name, err)
	}
	return nil
}

// detach unpins and closes programs' links; pinned ones this process has
// not opened are found through their pins when adopting.
func (d *Datapath) detach(progs []program, adopting bool) error {
	var errs []error
	for _, p := range slices.Backward(progs) {
		l, ok := d.links[p.name]
		if !ok && !adopting {
			continue
		}
		if !ok {
			// Not ours yet, but a previous run may have pinned it.
			var err error
			l, err = link.LoadPinnedLink(filepath.Join(d.linksDir(), p.name), nil)
			if errors.Is(err, os.ErrNotExist) {
				continue
			}
			if err != nil {
				errs = append(errs, fmt.Errorf("load pinned %s: %w", p.name, err))
				continue
			}
		}
		errs = append(errs, l.Unpin(), l.Close())
		delete(d.links, p.name)
	}
	return errors.Join(errs...)
}

// syncRequestPrograms attaches the per-packet programs only while some
// rule tracks requests: they run for every packet below the cgroup.
func (d *Datapath) syncRequestPrograms(adopting bool) error {
	if d.trackingRequests > 0 {
		return d.attachAll(requestPrograms)
	}
	return d.detach(requestPrograms, adopting)
}

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

// Stats reads a rule's counters.
func (d *Datapath) Stats(name string) (Stats, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	idx, ok := d.byName[name]
	if !ok {
		return Stats{}, fmt.Errorf("rule %s: %w", name, ErrUnknownRule)
	}
	return d.stats(idx)
}

// Status reads every rule with its counters.
func (d *Datapath) Status() ([]RuleStatus, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	var out []RuleStatus
	for i, s := range d.slots {
		if !s.active {
			continue
		}
		st, err := d.stats(uint32(i))
		if err != nil {
			return nil, err
		}
		out = append(out, RuleStatus{Rule: s.rule, Stats: st})
	}
	return out, nil
}

func (d *Datapath) stats(idx uint32) (Stats, error) {
	var state egressdRuleState
	if err := d.objs.RuleStates.Lookup(idx, &state); err != nil {
		return Stats{}, fmt.Errorf("read rule state: %w", err)
	}
	var perCPU []egressdCounters
	if err := d.objs.RuleCounters.Lookup(idx, &perCPU); err != nil {
		return Stats{}, fmt.Errorf("read counters: %w", err)
	}
	var c [egressdCounterCOUNTER_LEN]uint64
	for _, pc := range perCPU {
		for i, v := range pc.V {
			c[i] += v
		}
	}
	s := Stats{
		Live:          state.Live,
		Admitted:      c[egressdCounterCOUNTER_ADMITTED],
		Refused:       c[egressdCounterCOUNTER_REFUSED],
		ShadowRefused: c[egressdCounterCOUNTER_SHADOW_REFUSED],
		Released:      c[egressdCounterCOUNTER_RELEASED],
		Established:   c[egressdCounterCOUNTER_ESTABLISHED],
		ConnectFailed: c[egressdCounterCOUNTER_CONNECT_FAILED],
		Untracked:     c[egressdCounterCOUNTER_UNTRACKED],
		Requests:      c[egressdCounterCOUNTER_REQUESTS],
		Responses:     c[egressdCounterCOUNTER_RESPONSES],
		Aborted:       c[egressdCounterCOUNTER_ABORTED],
		// Per-CPU +1s and -1s wrap individually; their sum is exact.
		InFlight: int64(c[egressdCounterCOUNTER_IN_FLIGHT]),
	}
	for kind, h := range []*Histogram{&s.ConnectLatency, &s.RequestLatency} {
		var kh egressdHist
		if err := d.objs.Latency.Lookup(idx*uint32(egressdSampleKindSAMPLE_LEN)+uint32(kind), &kh); err != nil {
			return Stats{}, fmt.Errorf("read latency: %w", err)
		}
		*h = Histogram{Count: kh.Count, Sum: time.Duration(kh.SumNs), Buckets: kh.Buckets}
	}
	return s, nil
}

// Lost reads how many events the kernel dropped.
func (d *Datapath) Lost() (Lost, error) {
	read := func(i egressdGlobalCounter) (uint64, error) {
		var perCPU []uint64
		if err := d.objs.GlobalCounters.Lookup(uint32(i), &perCPU); err != nil {
			return 0, fmt.Errorf("read lost events: %w", err)
		}
		var sum uint64
		for _, v := range perCPU {
			sum += v
		}
		return sum, nil
	}
	refusals, err := read(egressdGlobalCounterGLOBAL_REFUSALS_LOST)
	if err != nil {
		return Lost{}, err
	}
	samples, err := read(egressdGlobalCounterGLOBAL_SAMPLES_LOST)
	return Lost{Refusals: refusals, Samples: samples}, err
}

// ruleName resolves a kernel (slot, generation) pair; "" if the rule is gone.
func (d *Datapath) ruleName(idx, gen uint32) string {
	d.mu.Lock()
	defer d.mu.Unlock()
	if int(idx) >= len(d.slots) || d.slots[idx].gen != gen || !d.slots[idx].active {
		return ""
	}
	return d.slots[idx].rule.Name
}

// ProgramStats reads each attached program's run statistics. They count
// only while kernel.bpf_stats_enabled is on (see EnableStats).
func (d *Datapath) ProgramStats() (map[string]ProgramStats, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := map[string]ProgramStats{}
	for _, p := range append(slices.Clone(connPrograms), requestPrograms...) {
		if _, ok := d.links[p.name]; !ok {
			continue
		}
		st, err := p.prog(&d.objs).Stats()
		if err != nil {
			return nil, fmt.Errorf("stats %s: %w", p.name, err)
		}
		out[p.name] = ProgramStats{Runs: st.RunCount, Runtime: st.Runtime}
	}
	return out, nil
}

// EnableStats turns on the kernel's per-program run statistics until the
// returned closer is closed.
func EnableStats() (interface{ Close() error }, error) {
	c, err := ebpf.EnableStats(uint32(unix.BPF_STATS_RUN_TIME))
	if err != nil {
		return nil, fmt.Errorf("enable bpf stats: %w", err)
	}
	return c, nil
}

// PinDir is where the datapath is pinned.
func (d *Datapath) PinDir() string { return d.cfg.PinDir }

// Adopted reports whether Open found a pinned datapath and carried it on.
func (d *Datapath) Adopted() bool { return d.adopted }

// MaxRules is the size of the rule tables.
func (d *Datapath) MaxRules() int { return d.cfg.MaxRules }

func (d *Datapath) closeFDs() error {
	if d.closed {
		return nil
	}
	d.closed = true
	var errs []error
	for _, l := range d.links {
		errs = append(errs, l.Close())
	}
	errs = append(errs, d.objs.Close(), d.lock.Close())
	return errors.Join(errs...)
}

// Close releases this process's handles. The pins keep the programs
// attached and the counts alive: enforcement goes on without the daemon.
func (d *Datapath) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.closeFDs()
}

// Uninstall detaches every program and removes the pins, ending
// enforcement.
func (d *Datapath) Uninstall() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return Uninstall(d.cfg.PinDir)
	}
	errs := []error{d.detach(requestPrograms, false), d.detach(connPrograms, false), d.closeFDs()}
	errs = append(errs, os.RemoveAll(d.cfg.PinDir))
	return errors.Join(errs...)
}

// Uninstall removes a pinned datapath without loading one: it unpins the
// links, which detaches the programs, then the maps. It fails with ErrBusy
// while a process has the datapath open.
func Uninstall(pinDir string) error {
	if pinDir == "" {
		pinDir = DefaultPinDir
	}
	if _, err := os.Stat(pinDir); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	lock, err := lockDir(pinDir)
	if err != nil {
		return err
	}
	defer lock.Close()
	var errs []error
	entries, err := os.ReadDir(filepath.Join(pinDir, "links"))
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, err)
	}
	for _, e := range entries {
		path := filepath.Join(pinDir, "links", e.Name())
		l, err := link.LoadPinnedLink(path, nil)
		if err != nil {
			errs = append(errs, fmt.Errorf("load pinned %s: %w", e.Name(), err))
			continue
		}
		errs = append(errs, l.Unpin(), l.Close())
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	return os.RemoveAll(pinDir)
}
