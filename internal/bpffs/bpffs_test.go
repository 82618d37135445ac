package bpffs_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/egressd/egressd/internal/bpffs"
	"github.com/egressd/egressd/internal/privtest"
)

func TestMountedOffBPFFS(t *testing.T) {
	ok, err := bpffs.Mounted(t.TempDir())
	if err != nil || ok {
		t.Fatalf("Mounted(temp dir) = %v, %v; want false, nil", ok, err)
	}
	if _, err := bpffs.Mounted(filepath.Join(t.TempDir(), "missing")); err == nil {
		t.Fatal("Mounted(missing dir): no error")
	}
}

// TestEnsureMountsOnce: Ensure mounts a bpffs on the pin directory's
// parent, and a second Ensure leaves the one mount there.
func TestEnsureMountsOnce(t *testing.T) {
	privtest.RequireHostRoot(t, "mounts a bpffs")
	parent := filepath.Join(t.TempDir(), "bpf")
	t.Cleanup(func() {
		for mounts(t, parent) > 0 {
			if err := unix.Unmount(parent, 0); err != nil {
				t.Errorf("unmount: %v", err)
				return
			}
		}
	})
	pins := filepath.Join(parent, "egressd")
	for range 2 {
		if err := bpffs.Ensure(pins); err != nil {
			t.Fatal(err)
		}
	}
	if ok, err := bpffs.Mounted(parent); err != nil || !ok {
		t.Fatalf("Mounted(%s) after Ensure = %v, %v", parent, ok, err)
	}
	if n := mounts(t, parent); n != 1 {
		t.Fatalf("%d mounts on %s after two Ensure calls, want 1", n, parent)
	}
}

// mounts counts the mounts on dir in this process's mount namespace.
func mounts(t *testing.T, dir string) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for line := range strings.Lines(string(b)) {
		if f := strings.Fields(line); len(f) > 4 && f[4] == dir {
			n++
		}
	}
	return n
}
