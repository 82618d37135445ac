//go:build linux

package loader

import (
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"

	"github.com/egressd/egressd/internal/privtest"
	"github.com/egressd/egressd/pkg/cgroups"
)

// TestProbeFeatures: on a kernel the datapath runs on (this one), every
// probe passes, and the list names what the datapath is known to use.
func TestProbeFeatures(t *testing.T) {
	privtest.RequireRoot(t)
	got := ProbeFeatures()
	for _, f := range got {
		t.Logf("%-15s %-45s %v", f.Kind, f.Name, f.Err)
		if f.Err != nil {
			t.Errorf("%s %s (used by %v): %v", f.Kind, f.Name, f.Used, f.Err)
		}
	}
	for _, want := range []Feature{
		{Kind: FeatureBTF, Name: "kernel BTF (/sys/kernel/btf/vmlinux)"},
		{Kind: FeatureMapType, Name: "SkStorage"},
		{Kind: FeatureMapType, Name: "RingBuf"},
		{Kind: FeatureMapType, Name: "LPMTrie"},
		{Kind: FeatureProgramType, Name: "CGroupSockAddr"},
		{Kind: FeatureProgramType, Name: "Tracing"},
		{Kind: FeatureHelper, Name: "bpf_set_retval in CGroupSockAddr"},
		{Kind: FeatureHelper, Name: "bpf_sk_storage_get in SockOps"},
		{Kind: FeatureAttach, Name: "cgroup/connect4"},
		{Kind: FeatureAttach, Name: "cgroup/sock_release"},
		{Kind: FeatureAttach, Name: "iter/tcp"},
		{Kind: FeatureLoad, Name: "egressd datapath"},
	} {
		if !slices.ContainsFunc(got, func(f Feature) bool { return f.Kind == want.Kind && f.Name == want.Name }) {
			t.Errorf("no probe for %s %s", want.Kind, want.Name)
		}
	}
}

// TestProbeAttachRefusesWrongType: the attach probe must be able to fail,
// or its passing means nothing. A socket filter cannot go on a cgroup's
// connect4 hook.
func TestProbeAttachRefusesWrongType(t *testing.T) {
	privtest.RequireRoot(t)
	spec, err := loadEgressd()
	if err != nil {
		t.Fatal(err)
	}
	p := spec.Programs["egressd_connect4"].Copy()
	p.Type = 1 // BPF_PROG_TYPE_SOCKET_FILTER
	if err := probeAttach(p); !errors.Is(err, ErrNotSupported) {
		t.Errorf("socket filter on cgroup/connect4: err = %v, want ErrNotSupported", err)
	}
}

func TestHelperName(t *testing.T) {
	for _, tt := range []struct {
		fn   asm.BuiltinFunc
		want string
	}{
		{asm.FnSetRetval, "bpf_set_retval"},
		{asm.FnSkStorageGet, "bpf_sk_storage_get"},
		{asm.FnGetCurrentAncestorCgroupId, "bpf_get_current_ancestor_cgroup_id"},
		{asm.FnSkcToTcpSock, "bpf_skc_to_tcp_sock"},
	} {
		if got := helperName(tt.fn); got != tt.want {
			t.Errorf("helperName(%v) = %q, want %q", tt.fn, got, tt.want)
		}
	}
}

// TestInspectPins reads a live datapath's pins while it is open, as
// doctor does beside a running daemon, and finds them compatible.
func TestInspectPins(t *testing.T) {
	d, _ := open(t)
	p, err := InspectPins(d.PinDir())
	if err != nil {
		t.Fatal(err)
	}
	cg, err := cgroups.ID(d.cfg.Cgroup)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, l := range p.Links {
		names = append(names, l.Name)
		if l.CgroupID != cg {
			t.Errorf("link %s on cgroup %d, want %d", l.Name, l.CgroupID, cg)
		}
	}
	slices.Sort(names)
	if want := []string{"connect4", "connect6", "sock_release", "sockops"}; !slices.Equal(names, want) {
		t.Errorf("links %v, want %v", names, want)
	}
	if p.Maps == 0 || p.MaxRules != d.MaxRules() {
		t.Errorf("maps %d, max rules %d; want some maps and %d", p.Maps, p.MaxRules, d.MaxRules())
	}
	if p.Incompatible != nil {
		t.Errorf("this build's own pins are incompatible: %v", p.Incompatible)
	}

	// A map of another shape under a datapath map's name cannot be adopted.
	d.Close()
	rules := filepath.Join(d.PinDir(), "maps", "rule_metas")
	if err := os.Remove(rules); err != nil {
		t.Fatal(err)
	}
	other, err := loadEgressd()
	if err != nil {
		t.Fatal(err)
	}
	m := other.Maps["global_counters"]
	m.Pinning = 0
	gm, err := ebpf.NewMap(m)
	if err != nil {
		t.Fatal(err)
	}
	defer gm.Close()
	if err := gm.Pin(rules); err != nil {
		t.Fatal(err)
	}
	p, err = InspectPins(d.PinDir())
	if err != nil {
		t.Fatal(err)
	}
	if p.Incompatible == nil {
		t.Error("a pinned rule_metas of another shape was found compatible")
	}

	if _, err := InspectPins(filepath.Join(t.TempDir(), "none")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("nothing pinned: err = %v, want ErrNotExist", err)
	}
}

// The quick look for a name among the kernel's BTF strings answers as
// decoding every type does, for enum values that exist and for one that
// does not.
func TestBTFNames(t *testing.T) {
	if _, err := os.Stat(vmlinuxBTF); err != nil {
		t.Skipf("this kernel has no %s: %v", vmlinuxBTF, err)
	}
	for _, name := range []string{"TCP_BPF_SOCK_OPS_CB_FLAGS", "TCP_BPF_IW", "BPF_SOCK_OPS_STATE_CB", "EGRESSD_NO_SUCH_VALUE"} {
		quick, err := btfNames(vmlinuxBTF, name)
		if err != nil {
			t.Fatal(err)
		}
		decoded, err := kernelEnumValue(name)
		if err != nil {
			t.Fatal(err)
		}
		if quick != decoded {
			t.Errorf("%s: among the strings %v, an enum value %v", name, quick, decoded)
		}
	}
}

// btfStrings finds the string section of raw BTF, and refuses what is not.
func TestBTFStrings(t *testing.T) {
	raw := func(magic uint16, strLen uint32, strs string) []byte {
		h := []any{magic, uint8(1), uint8(0), uint32(24), uint32(0), uint32(0), uint32(0), strLen}
		var b []byte
		for _, v := range h {
			b, _ = binary.Append(b, binary.NativeEndian, v)
		}
		return append(b, strs...)
	}
	strs := "\x00a\x00TCP_BPF_SOCK_OPS_CB_FLAGS_X\x00TCP_BPF_IW\x00"
	got, err := btfStrings(raw(0xeb9f, uint32(len(strs)), strs))
	if err != nil || string(got) != strs {
		t.Fatalf("strings %q, %v", got, err)
	}
	for name, data := range map[string][]byte{
		"no header":        {0x9f, 0xeb},
		"another magic":    raw(0xbeef, uint32(len(strs)), strs),
		"strings past end": raw(0xeb9f, uint32(len(strs))+1, strs),
	} {
		if _, err := btfStrings(data); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
	path := filepath.Join(t.TempDir(), "btf")
	if err := os.WriteFile(path, raw(0xeb9f, uint32(len(strs)), strs), 0o644); err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]bool{"TCP_BPF_IW": true, "a": true, "TCP_BPF_SOCK_OPS_CB_FLAGS": false} {
		if got, err := btfNames(path, name); err != nil || got != want {
			t.Errorf("%s: %v, %v; want %v", name, got, err, want)
		}
	}
}
