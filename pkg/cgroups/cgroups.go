// Package cgroups finds the cgroup v2 hierarchy and names cgroups in it the
// way the kernel's BPF helpers do: by id (the directory's inode) and level
// (its depth below the root).
package cgroups

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// ErrNoCgroup2 means no cgroup v2 hierarchy is mounted.
var ErrNoCgroup2 = errors.New("no cgroup2 mount")

// Mount returns the mount point of the cgroup v2 hierarchy. Hybrid systems
// mount it below /sys/fs/cgroup (e.g. /sys/fs/cgroup/unified), so it is
// read from the mount table rather than assumed.
func Mount() (string, error) {
	f, err := os.Open("/proc/self/mounts")
	if err != nil {
		return "", fmt.Errorf("read mounts: %w", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) >= 3 && fields[2] == "cgroup2" {
			return fields[1], nil
		}
	}
	if err := sc.Err(); err != nil {
		return "", fmt.Errorf("read mounts: %w", err)
	}
	return "", ErrNoCgroup2
}

// Resolve turns a cgroup given either as an absolute directory or as a path
// inside the hierarchy ("/system.slice/x.service") into its directory.
func Resolve(path string) (string, error) {
	root, err := Mount()
	if err != nil {
		return "", err
	}
	clean := filepath.Clean("/" + path)
	if clean == root || strings.HasPrefix(clean, root+"/") {
		return clean, nil
	}
	return filepath.Join(root, clean), nil
}

// ID returns the cgroup id of a cgroup directory, as bpf_sk_cgroup_id and
// friends report it.
func ID(dir string) (uint64, error) {
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		return 0, fmt.Errorf("cgroup %s: %w", dir, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return 0, fmt.Errorf("cgroup %s: not a directory", dir)
	}
	return st.Ino, nil
}

// Level returns the depth of a cgroup directory below the cgroup2 root
// (the root is level 0), the ancestor level bpf_sk_ancestor_cgroup_id takes.
func Level(dir string) (int, error) {
	root, err := Mount()
	if err != nil {
		return 0, err
	}
	rel, err := filepath.Rel(root, filepath.Clean(dir))
	if err != nil || rel == ".." || strings.HasPrefix(rel, "../") {
		return 0, fmt.Errorf("cgroup %s: not below %s", dir, root)
	}
	if rel == "." {
		return 0, nil
	}
	return strings.Count(rel, "/") + 1, nil
}

// Self returns the cgroup v2 directory of the calling process.
func Self() (string, error) {
	b, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return "", fmt.Errorf("read own cgroup: %w", err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "0::"); ok {
			return Resolve(rest)
		}
	}
	return "", ErrNoCgroup2
}
