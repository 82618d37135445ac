// Package privtest holds the helpers of tests that need root: cgroups,
// bpffs pin directories, network namespaces and child processes that the
// test creates itself and removes on every path.
package privtest

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/egressd/egressd/internal/bpffs"
	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/pkg/cgroups"
)

// RequireRoot skips the test, saying why, unless it runs as root of the
// initial user namespace on a kernel with a cgroup v2 hierarchy and BTF.
func RequireRoot(t testing.TB) {
	t.Helper()
	RequireHostRoot(t, "loads BPF programs, creates cgroups and network namespaces")
	if _, err := cgroups.Mount(); err != nil {
		t.Skipf("skipping: %v", err)
	}
	if _, err := os.Stat("/sys/kernel/btf/vmlinux"); err != nil {
		t.Skip("skipping: kernel has no BTF (/sys/kernel/btf/vmlinux)")
	}
}

// RequireHostRoot skips the test, saying why it needs root, unless it
// runs as root of the initial user namespace: root of another (unshare
// -r) has capabilities that the kernel's BPF does not honour, and only
// its own uid to switch or chown to.
func RequireHostRoot(t testing.TB, why string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skipf("skipping: needs root (%s)", why)
	}
	if m, err := os.ReadFile("/proc/self/uid_map"); err == nil {
		if uidMap := strings.Join(strings.Fields(string(m)), " "); uidMap != "0 0 4294967295" {
			t.Skipf("skipping: needs root of the initial user namespace, not of one whose uid_map is %q (%s)", uidMap, why)
		}
	}
}

func suffix() string {
	b := make([]byte, 4)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// Cgroup creates a cgroup below the cgroup2 root and removes it when the
// test ends, killing whatever still runs in it.
func Cgroup(t testing.TB, name string) string {
	t.Helper()
	root, err := cgroups.Mount()
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(root, "egressd-test-"+name+"-"+suffix())
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatalf("create cgroup: %v", err)
	}
	t.Cleanup(func() { removeCgroup(t, dir) })
	return dir
}

// Slice is Cgroup named as systemd names a slice of the root,
// egressd_test_NAME_SUFFIX.slice, for a layout of slices below it.
func Slice(t testing.TB, name string) string {
	t.Helper()
	root, err := cgroups.Mount()
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(root, "egressd_test_"+name+"_"+suffix()+".slice")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatalf("create cgroup: %v", err)
	}
	t.Cleanup(func() { removeCgroup(t, dir) })
	return dir
}

// SubCgroup creates a child of a cgroup made by Cgroup; it goes first.
func SubCgroup(t testing.TB, parent, name string) string {
	t.Helper()
	dir := filepath.Join(parent, name)
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatalf("create cgroup: %v", err)
	}
	t.Cleanup(func() { removeCgroup(t, dir) })
	return dir
}

// removeCgroup kills what runs in the cgroup at dir and removes it once
// the kernel has let the processes go.
func removeCgroup(t testing.TB, dir string) {
	t.Helper()
	// Killing needs cgroup.kill (5.14+); fall back to SIGKILL by pid.
	if err := os.WriteFile(filepath.Join(dir, "cgroup.kill"), []byte("1"), 0); err != nil {
		for _, pid := range procs(dir) {
			syscall.Kill(pid, syscall.SIGKILL)
		}
	}
	clocktest.Eventually(t, "cgroup "+dir+" removed", func() bool {
		err := os.Remove(dir)
		return err == nil || errors.Is(err, os.ErrNotExist)
	})
}

func procs(dir string) []int {
	b, _ := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
	var out []int
	for _, f := range strings.Fields(string(b)) {
		if pid, err := strconv.Atoi(f); err == nil {
			out = append(out, pid)
		}
	}
	return out
}

// Join moves the test process into dir until the test ends. Sockets it
// creates meanwhile belong to dir; sockets created before stay where they
// were (a socket's cgroup is fixed at creation).
func Join(t testing.TB, dir string) {
	t.Helper()
	orig, err := cgroups.Self()
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(os.Getpid())), 0); err != nil {
		t.Fatalf("join cgroup: %v", err)
	}
	t.Cleanup(func() {
		if err := os.WriteFile(filepath.Join(orig, "cgroup.procs"), []byte(strconv.Itoa(os.Getpid())), 0); err != nil {
			t.Errorf("leave cgroup: %v", err)
		}
	})
}

// PinDir returns a fresh bpffs directory for the test's pins and removes
// it, detaching anything pinned there, when the test ends.
func PinDir(t testing.TB) string {
	t.Helper()
	dir := filepath.Join("/sys/fs/bpf", "egressd-test-"+suffix())
	// As the daemon would on its first start: a test that looks at the
	// host before any datapath is loaded must not depend on test order.
	if err := bpffs.Ensure(dir); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := os.RemoveAll(dir); err != nil {
			t.Errorf("remove pins: %v", err)
		}
	})
	return dir
}

// NetNS is a network namespace the test created. It lives until the test
// ends and its last socket closes.
type NetNS struct {
	handle netns.NsHandle
}

// NewNetNS creates a network namespace with loopback up.
func NewNetNS(t testing.TB) *NetNS {
	t.Helper()
	var ns NetNS
	err := onLockedThread(func() error {
		orig, err := netns.Get()
		if err != nil {
			return err
		}
		defer orig.Close()
		h, err := netns.New()
		if err != nil {
			return err
		}
		ns.handle = h
		if err := netns.Set(orig); err != nil {
			return fmt.Errorf("%w: %w", errThreadLost, err)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("create netns: %v", err)
	}
	t.Cleanup(func() { ns.handle.Close() })
	h, err := netlink.NewHandleAt(ns.handle)
	if err != nil {
		t.Fatalf("netlink in netns: %v", err)
	}
	defer h.Close()
	lo, err := h.LinkByName("lo")
	if err == nil {
		err = h.LinkSetUp(lo)
	}
	if err != nil {
		t.Fatalf("loopback up: %v", err)
	}
	return &ns
}

// Do runs fn on an OS thread inside the namespace; sockets fn creates
// belong to it.
func (ns *NetNS) Do(fn func() error) error {
	return onLockedThread(func() error {
		orig, err := netns.Get()
		if err != nil {
			return err
		}
		defer orig.Close()
		if err := netns.Set(ns.handle); err != nil {
			return err
		}
		fnErr := fn()
		if err := netns.Set(orig); err != nil {
			return errors.Join(fnErr, fmt.Errorf("%w: %w", errThreadLost, err))
		}
		return fnErr
	})
}

// errThreadLost means a thread could not go back to the test's network
// namespace.
var errThreadLost = errors.New("back to the original netns")

// onLockedThread runs fn on a goroutine locked to its thread. A thread fn
// could not bring back to the test's namespace dies with the goroutine
// instead of going back to the scheduler. One that came back is unlocked
// and lives on: a thread's death sends the parent-death signal to every
// process started from it, such as a daemon a test runs.
func onLockedThread(fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		err := fn()
		if !errors.Is(err, errThreadLost) {
			runtime.UnlockOSThread()
		}
		errc <- err
	}()
	return <-errc
}

// VethToHost links the test's own network namespace (the host's) to ns with
// a veth pair and addresses; the host end is removed when the test ends.
func VethToHost(t testing.TB, hostAddr string, ns *NetNS, nsAddr string) {
	t.Helper()
	name := "eg" + suffix()[:6]
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: name + "h"}, PeerName: name + "n", PeerNamespace: netlink.NsFd(ns.handle)}
	if err := netlink.LinkAdd(veth); err != nil {
		t.Fatalf("add veth: %v", err)
	}
	t.Cleanup(func() {
		if l, err := netlink.LinkByName(name + "h"); err == nil {
			netlink.LinkDel(l)
		}
	})
	host, err := netlink.LinkByName(name + "h")
	if err != nil {
		t.Fatal(err)
	}
	configure(t, nil, host, hostAddr)
	h, err := netlink.NewHandleAt(ns.handle)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	peer, err := h.LinkByName(name + "n")
	if err != nil {
		t.Fatal(err)
	}
	configure(t, h, peer, nsAddr)
}

// configure gives a link an address and brings it up, through h (nil: the
// test's own namespace).
func configure(t testing.TB, h *netlink.Handle, l netlink.Link, cidr string) {
	t.Helper()
	addr, err := netlink.ParseAddr(cidr)
	if err != nil {
		t.Fatal(err)
	}
	if h == nil {
		err = netlink.AddrAdd(l, addr)
		if err == nil {
			err = netlink.LinkSetUp(l)
		}
	} else {
		err = h.AddrAdd(l, addr)
		if err == nil {
			err = h.LinkSetUp(l)
		}
	}
	if err != nil {
		t.Fatalf("configure %s: %v", l.Attrs().Name, err)
	}
}

// Veth links two namespaces with a veth pair and addresses ("10.1.0.1/24").
func Veth(t testing.TB, a *NetNS, addrA string, b *NetNS, addrB string) {
	t.Helper()
	name := "eg" + suffix()[:6]
	veth := &netlink.Veth{
		LinkAttrs:     netlink.LinkAttrs{Name: name + "a", Namespace: netlink.NsFd(a.handle)},
		PeerName:      name + "b",
		PeerNamespace: netlink.NsFd(b.handle),
	}
	if err := netlink.LinkAdd(veth); err != nil {
		t.Fatalf("add veth: %v", err)
	}
	for _, end := range []struct {
		ns   *NetNS
		link string
		addr string
	}{{a, name + "a", addrA}, {b, name + "b", addrB}} {
		h, err := netlink.NewHandleAt(end.ns.handle)
		if err != nil {
			t.Fatalf("netlink: %v", err)
		}
		l, err := h.LinkByName(end.link)
		if err != nil {
			h.Close()
			t.Fatalf("veth %s: %v", end.link, err)
		}
		configure(t, h, l, end.addr)
		h.Close()
	}
}
