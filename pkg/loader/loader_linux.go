//go:build linux

package loader

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
	"github.com/cilium/ebpf/features"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/egressd/egressd/internal/bpffs"
	"github.com/egressd/egressd/pkg/cgroups"
)

// Defaults for Config.
const (
	DefaultPinDir        = "/sys/fs/bpf/egressd"
	DefaultMaxRules      = 4096
	DefaultSockTable     = 1 << 16
	DefaultSockOverflow  = 1 << 18
	DefaultEventInterval = time.Second
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
	// MaxRules sizes the rule tables, up to MaxRules. 0 means
	// DefaultMaxRules for a new datapath and the size it has for one
	// adopted from pins; another size moves an adopted datapath's rules
	// to tables of that size, enforcing all along (see Datapath.Resize).
	MaxRules int
	// GrowOnly keeps an adopted datapath's tables when they are larger
	// than MaxRules.
	GrowOnly bool
	// SockTable is how many tracked sockets keep their state in the
	// preallocated socket table (a power of two); the rest take an entry
	// of the overflow table, which costs more per connect(). 0 means
	// DefaultSockTable. A datapath adopted from pins keeps its table.
	SockTable int
	// SockOverflow is how many tracked sockets the overflow table holds,
	// beyond those in the socket table; a socket admitted while it is full
	// goes untracked (Stats.Untracked). Its entries are allocated as they
	// are taken, but for 16 bytes each of the kernel's hash buckets. 0
	// means DefaultSockOverflow. A datapath adopted from pins keeps its
	// table.
	SockOverflow int
	// EventInterval is how often one process's refusals by one rule
	// send an event (with the count since the last); 0 means
	// DefaultEventInterval.
	EventInterval time.Duration
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
	if out.MaxRules < 0 || out.MaxRules > MaxRules {
		return out, fmt.Errorf("max rules %d: outside 1..%d", out.MaxRules, MaxRules)
	}
	if out.SockTable == 0 {
		out.SockTable = DefaultSockTable
	}
	if out.SockTable < 1 || out.SockTable > 1<<24 || out.SockTable&(out.SockTable-1) != 0 {
		return out, fmt.Errorf("socket table %d: not a power of two in 1..%d", out.SockTable, 1<<24)
	}
	if out.SockOverflow == 0 {
		out.SockOverflow = DefaultSockOverflow
	}
	if out.SockOverflow < 1 || out.SockOverflow > 1<<24 {
		return out, fmt.Errorf("overflow table %d: outside 1..%d", out.SockOverflow, 1<<24)
	}
	if out.EventInterval == 0 {
		out.EventInterval = DefaultEventInterval
	}
	dir, err := cgroups.Resolve(out.Cgroup)
	if err != nil {
		return out, fmt.Errorf("cgroup: %w", err)
	}
	out.Cgroup = dir
	return out, nil
}

// Kernel flag bits; they mirror RULE_F_* in egressd.c.
const (
	flagActive   = 1 << 0
	flagShadow   = 1 << 1
	flagSamples  = 1 << 2
	flagRequests = 1 << 3

	ruleKeyFixedBits = 96

	// A ring buffer record wakes its reader only if none did for
	// wakeEvery, or wakeBytes wait; the reader polls for the rest. A
	// storm of records costs a wakeup per wakeEvery, not one each.
	wakeEvery = time.Millisecond
	wakeBytes = 16 << 10
)

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

	t    *table
	ncpu int
	// hints are what the kernel's lookup hints hold, so that changes
	// write only the difference.
	hints hints
	// fault, set by tests, fails the kernel write it returns an error for.
	fault func(step string) error
	// stalePins says the pinned maps are not the ones in use: a resize
	// could not pin its tables, and later calls try again.
	stalePins bool
	// lostRefusals counts refusal log records overwritten before a
	// reader read them.
	lostRefusals atomic.Uint64
	// drift is what each slot's drift was at the last recount, less what
	// it gave back.
	drift map[uint32]seenDrift
	// recountMu lets one recount at a time use the sweep map.
	recountMu sync.Mutex
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
	d := &Datapath{cfg: c, links: map[string]link.Link{}}
	if d.cgroupID, err = cgroups.ID(c.Cgroup); err != nil {
		return nil, err
	}
	if d.ncpu, err = ebpf.PossibleCPU(); err != nil {
		return nil, fmt.Errorf("possible cpus: %w", err)
	}
	if err := bpffs.Ensure(c.PinDir); err != nil {
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
	// A resize cut short leaves a second set of pinned maps beside the
	// set in place, which is whole (see repin).
	if err := os.RemoveAll(d.mapsDir() + nextSuffix); err != nil {
		d.lock.Close()
		return nil, fmt.Errorf("pin dir: %w", err)
	}
	want := c.MaxRules
	if err := d.load(); err != nil {
		d.lock.Close()
		return nil, err
	}
	if !d.adopted {
		// Tables made just now hold nothing: reading 100,000 empty
		// slots back would take a tenth of a second of a start.
		d.t = emptyTable(d.cfg.MaxRules, d.cfg.MaxRules*keysPerRule)
	} else if d.t, err = d.readTable(); err != nil {
		d.closeFDs()
		return nil, err
	}
	if err := d.syncHints(); err != nil {
		d.closeFDs()
		return nil, err
	}
	if err := d.attachAll(connPrograms); err != nil {
		d.closeFDs()
		return nil, err
	}
	if err := d.syncOptional(d.t.uses.needs(), true); err != nil {
		d.closeFDs()
		return nil, err
	}
	if want != 0 && !(c.GrowOnly && want < d.cfg.MaxRules) {
		if err := d.resize(want); err != nil {
			d.closeFDs()
			return nil, err
		}
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
	return haveSockOpsFlagsOption()
}

// haveSockOpsFlagsOption checks that bpf_setsockopt takes
// TCP_BPF_SOCK_OPS_CB_FLAGS (Linux 6.12), with which connect() marks the
// sockets it tracks: before it, the call fails at run time, and every
// admitted connection would go untracked. The kernel's BTF names the
// option in an anonymous enum, which no lookup by type name finds: the
// kernel's own BTF file is searched for the name first, since decoding
// every type to find it took a fifth of a second of each Open. A kernel
// found to have it is asked no more.
func haveSockOpsFlagsOption() error {
	const option = "TCP_BPF_SOCK_OPS_CB_FLAGS"
	if sockOpsFlagsOption.Load() {
		return nil
	}
	found, err := btfNames(vmlinuxBTF, option)
	if err != nil {
		found, err = kernelEnumValue(option)
	}
	if err != nil {
		return err
	}
	if !found {
		return fmt.Errorf("bpf_setsockopt(%s): %w (Linux 6.12 or later)", option, ErrNotSupported)
	}
	sockOpsFlagsOption.Store(true)
	return nil
}

var sockOpsFlagsOption atomic.Bool

const vmlinuxBTF = "/sys/kernel/btf/vmlinux"

// btfNames reports whether the string section of the BTF at path holds
// name. Every name in BTF - of a type, a member, an enum value - is one
// of its strings.
func btfNames(path, name string) (bool, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return false, err
	}
	strs, err := btfStrings(data)
	if err != nil {
		return false, fmt.Errorf("%s: %w", path, err)
	}
	return bytes.Contains(strs, []byte("\x00"+name+"\x00")), nil
}

// btfStrings returns the string section of raw BTF (struct btf_header in
// include/uapi/linux/btf.h), in this machine's byte order as the kernel
// writes it.
func btfStrings(data []byte) ([]byte, error) {
	var h struct {
		Magic                                  uint16
		Version, Flags                         uint8
		HdrLen                                 uint32
		TypeOff, TypeLen, StringOff, StringLen uint32
	}
	if _, err := binary.Decode(data, binary.NativeEndian, &h); err != nil {
		return nil, fmt.Errorf("BTF header: %w", err)
	}
	if h.Magic != 0xeb9f || h.HdrLen < 24 {
		return nil, errors.New("not BTF in this byte order")
	}
	start := uint64(h.HdrLen) + uint64(h.StringOff)
	if end := start + uint64(h.StringLen); end > uint64(len(data)) || h.StringLen == 0 {
		return nil, errors.New("BTF string section out of bounds")
	}
	return data[start : start+uint64(h.StringLen)], nil
}

// kernelEnumValue reports whether an enum of the kernel's BTF, wherever
// cilium/ebpf finds it, has a value called name, decoding every type.
func kernelEnumValue(name string) (bool, error) {
	spec, err := btf.LoadKernelSpec()
	if err != nil {
		return false, fmt.Errorf("kernel BTF: %w", errors.Join(ErrNotSupported, err))
	}
	for typ, err := range spec.All() {
		if err != nil {
			return false, fmt.Errorf("kernel BTF: %w", err)
		}
		if e, ok := typ.(*btf.Enum); ok && slices.ContainsFunc(e.Values, func(v btf.EnumValue) bool { return v.Name == name }) {
			return true, nil
		}
	}
	return false, nil
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

// ruleTables are sized by MaxRules (latency by MaxRules per sample kind),
// keyTables by MaxRules * keysPerRule.
var (
	ruleTables = []string{"scopes", "rules", "rule_metas", "rule_states", "rule_responses"}
	keyTables  = []string{"rule_exact", "rule_prefixes"}
)

// pinnedSize reads the size of a pinned map, if there is one.
func (d *Datapath) pinnedSize(name string) (int, bool) {
	m, err := ebpf.LoadPinnedMap(filepath.Join(d.mapsDir(), name), nil)
	if err != nil {
		return 0, false
	}
	defer m.Close()
	return int(m.MaxEntries()), true
}

func (d *Datapath) load() error {
	want := d.cfg.MaxRules
	if n, ok := d.pinnedSize("rules"); ok {
		d.cfg.MaxRules = n
		d.adopted = true
	} else if want == 0 {
		d.cfg.MaxRules = DefaultMaxRules
	}
	// A new datapath is made at the size wanted.
	if n, ok := d.pinnedSize("sock_table"); ok {
		d.cfg.SockTable = n
	}
	if n, ok := d.pinnedSize("sock_overflow"); ok {
		d.cfg.SockOverflow = n
	}
	spec, err := d.spec(d.cfg.MaxRules)
	if err != nil {
		return err
	}
	opts := &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: d.mapsDir()}}
	return d.loadSpec(spec, &d.objs, opts)
}

// spec is the datapath's collection with rule tables of maxRules.
func (d *Datapath) spec(maxRules int) (*ebpf.CollectionSpec, error) {
	return sizedSpec(maxRules, d.cfg.SockTable, d.cfg.SockOverflow, d.ncpu)
}

// sizedSpec is the datapath's collection with rule tables of maxRules, a
// socket table of sockTable entries and an overflow table of overflow, and
// a refusal log for ncpu CPUs.
func sizedSpec(maxRules, sockTable, overflow, ncpu int) (*ebpf.CollectionSpec, error) {
	spec, err := loadEgressd()
	if err != nil {
		return nil, err
	}
	for _, name := range ruleTables {
		spec.Maps[name].MaxEntries = uint32(maxRules)
	}
	for _, name := range keyTables {
		spec.Maps[name].MaxEntries = uint32(maxRules * keysPerRule)
	}
	spec.Maps["latency"].MaxEntries = uint32(maxRules) * uint32(egressdSampleKindSAMPLE_LEN)
	spec.Maps["sock_table"].MaxEntries = uint32(sockTable)
	spec.Maps["sock_overflow"].MaxEntries = uint32(overflow)
	spec.Maps["refusal_runs"].MaxEntries = uint32(ncpu)
	spec.Maps["refusal_log"].MaxEntries = uint32(ncpu * logSlots)
	if err := spec.Variables["log_cpus"].Set(uint32(ncpu)); err != nil {
		return nil, fmt.Errorf("refusal log: %w", err)
	}
	if err := spec.Variables["sock_table_mask"].Set(uint32(sockTable - 1)); err != nil {
		return nil, fmt.Errorf("socket table: %w", err)
	}
	hot, warm := tableParts(sockTable)
	if err := spec.Variables["sock_hot_mask"].Set(uint32(hot - 1)); err != nil {
		return nil, fmt.Errorf("socket table: %w", err)
	}
	if err := spec.Variables["sock_warm_mask"].Set(uint32(warm - 1)); err != nil {
		return nil, fmt.Errorf("socket table: %w", err)
	}
	return spec, nil
}

// tableParts returns how many of a socket table's first entries a socket
// tries before the rest: first the hot part, whose 16 lines (1 KiB) a
// client connecting one socket after another keeps in the CPU's nearest
// cache, then the warm part, whose 1,024 (64 KiB, 16 pages) stay in the
// TLB. A smaller table has parts of a quarter and a half, so that it has
// all three.
func tableParts(sockTable int) (hot, warm int) {
	return min(1<<4, max(1, sockTable/4)), min(1<<10, max(1, sockTable/2))
}

func (d *Datapath) loadSpec(spec *ebpf.CollectionSpec, objs *egressdObjects, opts *ebpf.CollectionOptions) error {
	if err := spec.LoadAndAssign(objs, opts); err != nil {
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
	if d.closed {
		return nil
	}
	return errors.Join(d.repinIfStale(), d.closeFDs())
}

// Uninstall detaches every program and removes the pins, ending
// enforcement.
func (d *Datapath) Uninstall() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		// Uninstalled already, by this handle or another: done.
		if err := Uninstall(d.cfg.PinDir); !errors.Is(err, ErrNotPinned) {
			return err
		}
		return nil
	}
	errs := []error{d.detach(udpPrograms, false), d.detach(requestPrograms, false), d.detach(connPrograms, false), d.closeFDs()}
	errs = append(errs, os.RemoveAll(d.cfg.PinDir))
	return errors.Join(errs...)
}

// Uninstall removes a pinned datapath without loading one: it unpins the
// links, which detaches the programs, then the maps. It fails with ErrBusy
// while a process has the datapath open, and with ErrNotPinned, removing
// nothing, when pinDir holds no pins: a mistyped directory, one already
// uninstalled, or one off bpffs, which must never be removed whole.
func Uninstall(pinDir string) error {
	if pinDir == "" {
		pinDir = DefaultPinDir
	}
	if _, err := os.Stat(pinDir); errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("%w at %s: no such directory", ErrNotPinned, pinDir)
	}
	if ok, err := bpffs.Mounted(pinDir); err != nil {
		return fmt.Errorf("pin dir: %w", err)
	} else if !ok {
		return fmt.Errorf("%w at %s: not a bpffs directory", ErrNotPinned, pinDir)
	}
	lock, err := lockDir(pinDir)
	if err != nil {
		return err
	}
	defer lock.Close()
	if n, err := countPins(pinDir); err != nil {
		return err
	} else if n == 0 {
		return fmt.Errorf("%w at %s", ErrNotPinned, pinDir)
	}
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

// countPins counts the pinned objects under dir: a bpffs shows each as a
// file. The layout's directories alone pin nothing.
func countPins(dir string) (int, error) {
	n := 0
	err := filepath.WalkDir(dir, func(_ string, e fs.DirEntry, err error) error {
		if err == nil && !e.IsDir() {
			n++
		}
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("pin dir: %w", err)
	}
	return n, nil
}
