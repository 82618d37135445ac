//go:build linux

package loader

import (
	"io"
	"net"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/btf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/egressd/egressd/internal/privtest"
)

// The callback flags egressd uses as marks.
const marks = unix.BPF_SOCK_OPS_RTO_CB_FLAG | unix.BPF_SOCK_OPS_RETRANS_CB_FLAG | unix.BPF_SOCK_OPS_STATE_CB_FLAG

// flip is what a flipper does to a socket's callback flags at each of its
// sockops callbacks.
type flip int

const (
	flipClear  flip = iota // sets them outright to none
	flipSet                // sets egressd's marks, outright
	flipToggle             // turns egressd's marks over
)

// attachFlipper attaches to cg, until the test ends, a sockops program of
// another party that changes the callback flags of every socket at each of
// its callbacks, and returns a function that detaches it sooner.
func attachFlipper(t *testing.T, cg string, how flip) func() {
	t.Helper()
	insns := asm.Instructions{}
	switch how {
	case flipClear:
		insns = append(insns, asm.Mov.Imm(asm.R2, 0))
	case flipSet:
		insns = append(insns, asm.Mov.Imm(asm.R2, marks))
	case flipToggle:
		insns = append(insns,
			asm.LoadMem(asm.R2, asm.R1, cbFlagsOffset(t), asm.Word),
			asm.Xor.Imm(asm.R2, marks))
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
func cbFlagsOffset(t *testing.T) int16 {
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

// TestOtherProgramsFlags: another program that clears, sets or turns over
// the callback flags egressd marks its sockets with, attached above or
// below egressd's cgroup, costs no slot: every connection's comes back,
// however it ends. Before sock_release looked for a socket's state by its
// cookie rather than its mark, a program that cleared the mark made
// egressd keep the slot of every connection it saw.
func TestOtherProgramsFlags(t *testing.T) {
	const limit = 3
	for _, tc := range []struct {
		name  string
		below bool
		how   flip
	}{
		{"clears, above", false, flipClear},
		{"clears, below", true, flipClear},
		{"sets, above", false, flipSet},
		{"sets, below", true, flipSet},
		{"toggles, above", false, flipToggle},
		{"toggles, below", true, flipToggle},
	} {
		t.Run(tc.name, func(t *testing.T) {
			privtest.RequireRoot(t)
			above := privtest.Cgroup(t, "marks")
			mid := privtest.SubCgroup(t, above, "egressd")
			below := privtest.SubCgroup(t, mid, "service")
			d := openOn(t, mid)
			put(t, d, Rule{Name: "local", Dests: []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}, Limit: limit})
			attachFlipper(t, map[bool]string{false: above, true: below}[tc.below], tc.how)
			closeFirst, reset, holder := closeFirstServer(t), resetServer(t), listen(t, "tcp4", "127.0.0.1:0")
			closed := closedPort(t)
			privtest.Join(t, below)
			for i := range 3 * limit {
				for _, srv := range []netip.AddrPort{closeFirst, reset} {
					c, err := net.Dial("tcp4", srv.String())
					if err != nil {
						t.Fatalf("connection %d to %s: %v", i, srv, err)
					}
					c.Write([]byte{1})
					io.Copy(io.Discard, c)
					c.Close()
				}
				c, err := net.Dial("tcp4", holder.String())
				if err != nil {
					t.Fatalf("connection %d to %s: %v", i, holder, err)
				}
				c.Close()
				// A connect() the peer refuses, connected again on the
				// same socket and then closed.
				fd := socket4(t, 0)
				for range 2 {
					if err := unix.Connect(fd, sa4(closed)); err != unix.ECONNREFUSED {
						t.Fatalf("connect to a closed port: %v", err)
					}
				}
				unix.Close(fd)
			}
			waitLive(t, d, "local", 0)
			checkRecount(t, d, "local", 0)
		})
	}
}
