//go:build linux

package loader

import (
	"cmp"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"unicode"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/btf"
	"github.com/cilium/ebpf/features"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"
)

// ProbeFeatures asks this kernel, with small test programs and maps as
// cilium/ebpf's features package does, for everything the compiled
// datapath uses: kernel BTF, each map and program type, each helper each
// program type calls, each attach point, the instruction set, and then
// loads the whole datapath through the verifier (attaching and pinning
// nothing). A version number cannot say this: distributions backport, and
// configs leave things out. It needs the privileges the daemon needs
// (CAP_BPF, CAP_NET_ADMIN, CAP_PERFMON); without them every probe says it
// could not tell.
func ProbeFeatures() []Feature {
	spec, err := loadEgressd()
	if err != nil {
		return []Feature{{Kind: FeatureLoad, Name: "egressd datapath", Err: fmt.Errorf("read the compiled programs: %w", err)}}
	}
	progs := sortedPrograms(spec)
	out := []Feature{probeBTF()}
	out = append(out, probeMapTypes(spec)...)
	out = append(out, probeProgramTypes(progs)...)
	out = append(out, probeHelpers(progs)...)
	out = append(out, probeSockOpsFlags(progs))
	for _, p := range progs {
		out = append(out, Feature{Kind: FeatureAttach, Name: p.SectionName, Used: []string{p.Name}, Err: probeAttach(p)})
	}
	out = append(out, Feature{Kind: FeatureISA, Name: "v3 (atomic operations)", Err: classify(features.HaveV3ISA())})
	return append(out, Feature{Kind: FeatureLoad, Name: "egressd datapath", Used: names(progs), Err: probeLoad(spec)})
}

// classify makes a probe's "not supported" match ErrNotSupported; other
// errors (EPERM, most often) stay what they are: the probe could not tell.
func classify(err error) error {
	if errors.Is(err, ebpf.ErrNotSupported) || errors.Is(err, btf.ErrNotFound) {
		return fmt.Errorf("%w: %w", ErrNotSupported, err)
	}
	return err
}

func sortedPrograms(spec *ebpf.CollectionSpec) []*ebpf.ProgramSpec {
	progs := make([]*ebpf.ProgramSpec, 0, len(spec.Programs))
	for _, p := range spec.Programs {
		progs = append(progs, p)
	}
	slices.SortFunc(progs, func(a, b *ebpf.ProgramSpec) int { return cmp.Compare(a.SectionName, b.SectionName) })
	return progs
}

func names(progs []*ebpf.ProgramSpec) []string {
	out := make([]string, len(progs))
	for i, p := range progs {
		out[i] = p.Name
	}
	return out
}

// probeBTF: the recount iterator attaches by BTF name and the programs
// carry CO-RE relocations, so the kernel must describe itself.
func probeBTF() Feature {
	_, err := btf.LoadKernelSpec()
	return Feature{Kind: FeatureBTF, Name: "kernel BTF (/sys/kernel/btf/vmlinux)", Err: classify(err)}
}

func probeMapTypes(spec *ebpf.CollectionSpec) []Feature {
	used := map[ebpf.MapType][]string{}
	for name, m := range spec.Maps {
		// .rodata and friends are arrays the loader makes for globals.
		if !strings.HasPrefix(name, ".") {
			used[m.Type] = append(used[m.Type], name)
		}
	}
	var out []Feature
	for _, t := range slices.Sorted(maps.Keys(used)) {
		slices.Sort(used[t])
		out = append(out, Feature{Kind: FeatureMapType, Name: t.String(), Used: used[t], Err: classify(features.HaveMapType(t))})
	}
	return out
}

func probeProgramTypes(progs []*ebpf.ProgramSpec) []Feature {
	var out []Feature
	for _, p := range progs {
		i := slices.IndexFunc(out, func(f Feature) bool { return f.Name == p.Type.String() })
		if i >= 0 {
			out[i].Used = append(out[i].Used, p.Name)
			continue
		}
		out = append(out, Feature{Kind: FeatureProgramType, Name: p.Type.String(), Used: []string{p.Name}, Err: probeProgramType(p)})
	}
	return out
}

// probeProgramType: the features package probes tracing programs with an
// fentry program, which kernels without ftrace refuse (EPERM even to
// root), though they run iterators, the one tracing program the datapath
// has. So a tracing program is probed as what it is.
func probeProgramType(p *ebpf.ProgramSpec) error {
	if p.Type == ebpf.Tracing {
		return probeAttach(p)
	}
	return classify(features.HaveProgramType(p.Type))
}

// probeHelpers probes each helper each program type calls. The features
// package cannot probe helpers of tracing programs (the recount
// iterator); loading the datapath covers those.
func probeHelpers(progs []*ebpf.ProgramSpec) []Feature {
	type key struct {
		pt ebpf.ProgramType
		fn asm.BuiltinFunc
	}
	used := map[key][]string{}
	var order []key
	for _, p := range progs {
		if p.Type == ebpf.Tracing {
			continue
		}
		for _, ins := range p.Instructions {
			if !ins.IsBuiltinCall() {
				continue
			}
			k := key{p.Type, asm.BuiltinFunc(ins.Constant)}
			if _, ok := used[k]; !ok {
				order = append(order, k)
			}
			if !slices.Contains(used[k], p.Name) {
				used[k] = append(used[k], p.Name)
			}
		}
	}
	out := make([]Feature, 0, len(order))
	for _, k := range order {
		out = append(out, Feature{
			Kind: FeatureHelper,
			Name: helperName(k.fn) + " in " + k.pt.String(),
			Used: used[k],
			Err:  classify(features.HaveProgramHelper(k.pt, k.fn)),
		})
	}
	return out
}

// probeSockOpsFlags: connect() marks the sockets it tracks with
// bpf_setsockopt(TCP_BPF_SOCK_OPS_CB_FLAGS) (Linux 6.12). An older kernel
// loads the programs all the same, but the call fails as they run, and
// every admitted connection would go untracked.
func probeSockOpsFlags(progs []*ebpf.ProgramSpec) Feature {
	var used []string
	for _, p := range progs {
		if p.Type == ebpf.CGroupSockAddr {
			used = append(used, p.Name)
		}
	}
	return Feature{Kind: FeatureHelper, Name: "bpf_setsockopt(TCP_BPF_SOCK_OPS_CB_FLAGS) in CGroupSockAddr", Used: used, Err: haveSockOpsFlagsOption()}
}

// helperName turns asm's FnSetRetval into the C name, bpf_set_retval.
func helperName(fn asm.BuiltinFunc) string {
	s, ok := strings.CutPrefix(fn.String(), "Fn")
	if !ok {
		return fn.String()
	}
	var b strings.Builder
	b.WriteString("bpf")
	for _, r := range s {
		if unicode.IsUpper(r) {
			b.WriteByte('_')
		}
		b.WriteRune(unicode.ToLower(r))
	}
	return b.String()
}

// probeAttach checks that the kernel takes a program of p's type for p's
// attach point, without attaching anything: a trivial program is loaded
// with p's expected attach type (the kernel checks it at load), then a
// link is asked for against a descriptor that is not a cgroup. A kernel
// that knows the attach point fails that with EBADF, looking up the
// cgroup; one that does not, with EINVAL, checking the attach type first.
// An iterator needs only to load: its target is resolved then; so does a
// syscall program, which is run (BPF_PROG_TEST_RUN), never attached.
func probeAttach(p *ebpf.ProgramSpec) error {
	prog, err := ebpf.NewProgramWithOptions(&ebpf.ProgramSpec{
		Type:       p.Type,
		AttachType: p.AttachType,
		AttachTo:   p.AttachTo,
		Flags:      p.Flags, // a syscall program must be sleepable
		License:    "GPL",
		// 1, which every hook takes: a recvmsg program may return
		// nothing else.
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 1), asm.Return()},
	}, ebpf.ProgramOptions{LogDisabled: true})
	if errors.Is(err, unix.EINVAL) {
		return fmt.Errorf("%w: load with attach type %s: %w", ErrNotSupported, p.AttachType, err)
	}
	if err != nil {
		return classify(err)
	}
	defer prog.Close()
	if p.Type == ebpf.Tracing || p.Type == ebpf.Syscall {
		return nil
	}
	notCgroup, err := os.Open(os.DevNull)
	if err != nil {
		return err
	}
	defer notCgroup.Close()
	l, err := link.AttachRawLink(link.RawLinkOptions{Target: int(notCgroup.Fd()), Program: prog, Attach: p.AttachType})
	switch {
	case errors.Is(err, unix.EBADF):
		return nil
	case errors.Is(err, unix.EINVAL):
		return fmt.Errorf("%w: link %s: %w", ErrNotSupported, p.AttachType, err)
	case err == nil:
		l.Close()
		return fmt.Errorf("link %s to %s: attached to something that is not a cgroup", p.AttachType, os.DevNull)
	}
	return classify(err)
}

// probeLoad puts every program through this kernel's verifier, with maps
// of their own: nothing is attached or pinned, and all is closed again.
func probeLoad(spec *ebpf.CollectionSpec) error {
	// Without privilege, cilium/ebpf's own probes during the load can
	// mistake EPERM for an old kernel; say it could not tell instead.
	if err := features.HaveMapType(ebpf.Array); err != nil && !errors.Is(err, ebpf.ErrNotSupported) {
		return err
	}
	spec = spec.Copy()
	for _, m := range spec.Maps {
		m.Pinning = ebpf.PinNone
	}
	coll, err := ebpf.NewCollection(spec)
	if err != nil {
		return classify(err)
	}
	coll.Close()
	return nil
}

// InspectPins reports what is pinned under dir without adopting it: the
// links and the cgroup each is attached to, how many maps, and whether
// this build could adopt them. It fails with an error matching
// os.ErrNotExist when nothing is pinned there.
func InspectPins(dir string) (Pinned, error) {
	p := Pinned{Dir: dir}
	if _, err := os.Stat(dir); err != nil {
		return p, err
	}
	linkNames, err := pinNames(filepath.Join(dir, "links"))
	if err != nil {
		return p, err
	}
	for _, name := range linkNames {
		// Links are opened read-write or not at all (the kernel refuses
		// BPF_F_RDONLY for them); nothing is changed through it.
		l, err := link.LoadPinnedLink(filepath.Join(dir, "links", name), nil)
		if err != nil {
			return p, fmt.Errorf("pinned link %s: %w", name, err)
		}
		info, err := l.Info()
		l.Close()
		if err != nil {
			return p, fmt.Errorf("pinned link %s: %w", name, err)
		}
		pl := PinnedLink{Name: name}
		if cg := info.Cgroup(); cg != nil {
			pl.CgroupID = cg.CgroupId
		}
		p.Links = append(p.Links, pl)
	}
	mapNames, err := pinNames(filepath.Join(dir, "maps"))
	if err != nil {
		return p, err
	}
	p.Maps = len(mapNames)
	p.MaxRules, p.Incompatible = compatible(filepath.Join(dir, "maps"), mapNames)
	return p, nil
}

func pinNames(dir string) ([]string, error) {
	entries, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	out := make([]string, len(entries))
	for i, e := range entries {
		out[i] = e.Name()
	}
	return out, nil
}

// compatible checks the pinned maps against this build's, sized as Open
// sizes them when it adopts: by the pinned rule and socket tables, and for
// this machine's possible CPUs.
func compatible(dir string, pinned []string) (maxRules int, _ error) {
	opts := &ebpf.LoadPinOptions{ReadOnly: true}
	size := func(name string, def int) int {
		m, err := ebpf.LoadPinnedMap(filepath.Join(dir, name), opts)
		if err != nil {
			return def
		}
		defer m.Close()
		return int(m.MaxEntries())
	}
	ncpu, err := ebpf.PossibleCPU()
	if err != nil {
		return 0, fmt.Errorf("possible cpus: %w", err)
	}
	maxRules = size("rules", 0)
	spec, err := sizedSpec(cmp.Or(maxRules, DefaultMaxRules), size("sock_table", DefaultSockTable), size("sock_overflow", DefaultSockOverflow), ncpu)
	if err != nil {
		return 0, err
	}
	var errs []error
	for _, name := range pinned {
		ms, ok := spec.Maps[name]
		if !ok || ms.Pinning != ebpf.PinByName {
			continue // Open neither reads nor minds it
		}
		m, err := ebpf.LoadPinnedMap(filepath.Join(dir, name), opts)
		if err != nil {
			errs = append(errs, fmt.Errorf("pinned map %s: %w", name, err))
			continue
		}
		errs = append(errs, ms.Compatible(m))
		m.Close()
	}
	return maxRules, errors.Join(errs...)
}
