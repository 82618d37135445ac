package controlserver

import (
	"net"
	"os"
	"slices"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/egressd/egressd/internal/privtest"
)

// The kernel's answer for our own connection is our own credentials,
// supplementary groups included.
func TestPeerOfSocketpair(t *testing.T) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	conns := make([]net.Conn, 2)
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), "socketpair")
		c, err := net.FileConn(f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		conns[i] = c
	}
	p, err := peerOf(conns[0])
	if err != nil {
		t.Fatal(err)
	}
	groups, err := os.Getgroups()
	if err != nil {
		t.Fatal(err)
	}
	want := make([]uint32, len(groups))
	for i, g := range groups {
		want[i] = uint32(g)
	}
	slices.Sort(want)
	got := slices.Sorted(slices.Values(p.Groups))
	if p.PID != int32(os.Getpid()) || p.UID != uint32(os.Geteuid()) || p.GID != uint32(os.Getegid()) || !slices.Equal(got, want) || p.Groups == nil {
		t.Errorf("peer %+v groups %v, want pid %d uid %d gid %d groups %v", p, p.Groups, os.Getpid(), os.Geteuid(), os.Getegid(), want)
	}
	// Reading SO_PEERGROUPS directly works on this kernel (4.13+), so the
	// /proc fallback is not what answered.
	raw, err := conns[0].(*net.UnixConn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var gerr error
	raw.Control(func(fd uintptr) { _, gerr = peerGroups(int(fd)) })
	if gerr != nil {
		t.Logf("SO_PEERGROUPS unsupported here (%v); groups came from /proc", gerr)
	}
}

// More supplementary groups than peerGroups's first buffer holds take the
// ERANGE retry.
func TestPeerGroupsMany(t *testing.T) {
	privtest.RequireHostRoot(t, "sets this process's supplementary groups")
	// syscall.Setgroups changes every thread (x/sys's only the calling one).
	orig, err := syscall.Getgroups()
	if err != nil {
		t.Fatal(err)
	}
	var many []int
	for g := range 100 {
		many = append(many, 5000+g)
	}
	if err := syscall.Setgroups(many); err != nil {
		t.Fatal(err)
	}
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if rerr := syscall.Setgroups(orig); rerr != nil {
		t.Fatalf("restore groups: %v", rerr)
	}
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fds[0])
	defer unix.Close(fds[1])
	got, err := peerGroups(fds[0])
	if err != nil {
		t.Skipf("skipping: SO_PEERGROUPS: %v", err)
	}
	want := make([]uint32, len(many))
	for i, g := range many {
		want[i] = uint32(g)
	}
	if !slices.Equal(slices.Sorted(slices.Values(got)), want) {
		t.Errorf("peerGroups = %v, want %v", got, want)
	}
}

func TestPeerOfNotUnix(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	if _, err := peerOf(a); err == nil {
		t.Error("peerOf(net.Pipe) succeeded")
	}
}
