//go:build linux

package loader

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/egressd/egressd/internal/privtest"
)

// TestUninstallNothingPinned: where no datapath is pinned, Uninstall says
// so and removes nothing, however often it is asked: a directory that is
// not there, one off bpffs (removed whole before) and one on bpffs with
// no pins.
func TestUninstallNothingPinned(t *testing.T) {
	offBPFFS := t.TempDir()
	kept := filepath.Join(offBPFFS, "kept")
	if err := os.WriteFile(kept, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, dir := range []string{filepath.Join(t.TempDir(), "absent"), offBPFFS} {
		if err := Uninstall(dir); !errors.Is(err, ErrNotPinned) {
			t.Errorf("Uninstall(%s) = %v, want ErrNotPinned", dir, err)
		}
	}
	if _, err := os.Stat(kept); err != nil {
		t.Errorf("a directory off bpffs lost its file: %v", err)
	}

	privtest.RequireRoot(t)
	empty := privtest.PinDir(t)
	if err := os.MkdirAll(filepath.Join(empty, "links"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := Uninstall(empty); !errors.Is(err, ErrNotPinned) {
		t.Errorf("Uninstall(empty bpffs dir) = %v, want ErrNotPinned", err)
	}
}

// TestUninstallTwice: the first Uninstall of a pinned datapath removes
// it; the second finds nothing pinned, while a closed handle's Uninstall
// stays done.
func TestUninstallTwice(t *testing.T) {
	privtest.RequireRoot(t)
	cg := privtest.Cgroup(t, "uninstall")
	pins := privtest.PinDir(t)
	d, err := Open(&Config{Cgroup: cg, PinDir: pins, MaxRules: 16})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if err := Uninstall(pins); err != nil {
		t.Fatalf("first uninstall: %v", err)
	}
	if _, err := os.Stat(pins); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("pins after uninstall: %v", err)
	}
	if err := Uninstall(pins); !errors.Is(err, ErrNotPinned) {
		t.Errorf("second uninstall: %v, want ErrNotPinned", err)
	}
	if err := d.Uninstall(); err != nil {
		t.Errorf("a closed handle's uninstall after the pins went: %v", err)
	}
}
