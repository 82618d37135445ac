// Package bpffs finds and mounts the BPF filesystem that pins live in.
package bpffs

import (
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// Mounted reports whether dir is on a bpffs.
func Mounted(dir string) (bool, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return false, err
	}
	return st.Type == unix.BPF_FS_MAGIC, nil
}

// Root is where the bpffs that holds pinDir is mounted: its parent.
func Root(pinDir string) string { return filepath.Dir(filepath.Clean(pinDir)) }

// Ensure mounts a bpffs on Root(pinDir) unless one is there, as systemd
// does at boot on /sys/fs/bpf: hosts booted without systemd may have
// none. It takes CAP_SYS_ADMIN when it has to mount.
func Ensure(pinDir string) error {
	parent := Root(pinDir)
	if err := os.MkdirAll(parent, 0o700); err != nil {
		return fmt.Errorf("bpffs: %w", err)
	}
	ok, err := Mounted(parent)
	if err != nil {
		return fmt.Errorf("bpffs: %w", err)
	}
	if ok {
		return nil
	}
	if err := unix.Mount("bpffs", parent, "bpf", 0, "mode=0700"); err != nil {
		return fmt.Errorf("mount bpffs on %s: %w", parent, err)
	}
	return nil
}
