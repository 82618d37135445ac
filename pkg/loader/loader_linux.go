//go:build linux

package loader

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"

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

// Kernel flag bits; they mirror RULE_F_* in egressd.c.
const (
	flagActive   = 1 << 0
	flagShadow   = 1 << 1
	flagSamples  = 1 << 2
	flagRequests = 1 << 3

	ruleKeyFixedBits = 96
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
	if d.t, err = d.readTable(); err != nil {
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
	if err := d.syncRequestPrograms(d.t.uses.requests, true); err != nil {
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
