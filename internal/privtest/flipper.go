package privtest

import (
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/btf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"
)

// Marks are the sockops callback flags egressd marks the sockets it
// tracks with.
const Marks = unix.BPF_SOCK_OPS_RTO_CB_FLAG | unix.BPF_SOCK_OPS_RETRANS_CB_FLAG | unix.BPF_SOCK_OPS_STATE_CB_FLAG

// Flip is what a flipper does to a socket's callback flags at each of its
// sockops callbacks.
type Flip int

const (
	FlipClear  Flip = iota // sets them outright to none
	FlipSet                // sets egressd's marks, outright
	FlipToggle             // turns egressd's marks over
)

// AttachFlipper attaches to cg, until the test ends, a sockops program of
// another party that changes the callback flags of every socket at each of
// its callbacks, and returns a function that detaches it sooner.
func AttachFlipper(t testing.TB, cg string, how Flip) (detach func()) {
	t.Helper()
	insns := asm.Instructions{}
	switch how {
	case FlipClear:
		insns = append(insns, asm.Mov.Imm(asm.R2, 0))
	case FlipSet:
		insns = append(insns, asm.Mov.Imm(asm.R2, Marks))
	case FlipToggle:
		insns = append(insns,
			asm.LoadMem(asm.R2, asm.R1, cbFlagsOffset(t), asm.Word),
			asm.Xor.Imm(asm.R2, Marks))
	}
	insns = append(insns,
		asm.FnSockOpsCbFlagsSet.Call(),
		asm.Mov.Imm(asm.R0, 1),
		asm.Return())
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Type: ebpf.SockOps, Instructions: insns, License: "GPL"})
	if err != nil {
		t.Fatalf("flipper: %v", err)
	}
	t.Cleanup(func() { prog.Close() })
	l, err := link.AttachCgroup(link.CgroupOptions{Path: cg, Attach: ebpf.AttachCGroupSockOps, Program: prog})
	if err != nil {
		t.Fatalf("attach flipper: %v", err)
	}
	t.Cleanup(func() { l.Close() })
	return func() { l.Close() }
}

// cbFlagsOffset is where struct bpf_sock_ops keeps the callback flags.
func cbFlagsOffset(t testing.TB) int16 {
	t.Helper()
	spec, err := btf.LoadKernelSpec()
	if err != nil {
		t.Fatal(err)
	}
	var ops *btf.Struct
	if err := spec.TypeByName("bpf_sock_ops", &ops); err != nil {
		t.Fatal(err)
	}
	for _, m := range ops.Members {
		if m.Name == "bpf_sock_ops_cb_flags" {
			return int16(m.Offset.Bytes())
		}
	}
	t.Fatal("struct bpf_sock_ops has no bpf_sock_ops_cb_flags")
	return 0
}
