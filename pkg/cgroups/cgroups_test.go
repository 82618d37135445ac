package cgroups

import (
	"errors"
	"path/filepath"
	"testing"
)

func TestPaths(t *testing.T) {
	root, err := Mount()
	if errors.Is(err, ErrNoCgroup2) {
		t.Skip("skipping: no cgroup2 mount")
	}
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		in    string
		dir   string
		level int
	}{
		{"", root, 0},
		{"/", root, 0},
		{"/system.slice", filepath.Join(root, "system.slice"), 1},
		{"system.slice/x.service", filepath.Join(root, "system.slice/x.service"), 2},
		{root + "/a/b/c", filepath.Join(root, "a/b/c"), 3},
		{"/a/../b", filepath.Join(root, "b"), 1},
	}
	for _, tt := range tests {
		dir, err := Resolve(tt.in)
		if err != nil || dir != tt.dir {
			t.Errorf("Resolve(%q) = %q, %v; want %q", tt.in, dir, err, tt.dir)
			continue
		}
		if level, err := Level(dir); err != nil || level != tt.level {
			t.Errorf("Level(%q) = %d, %v; want %d", dir, level, err, tt.level)
		}
	}
	if _, err := Level("/elsewhere"); err == nil {
		t.Error("Level of a directory outside the hierarchy: no error")
	}
	self, err := Self()
	if err != nil {
		t.Fatal(err)
	}
	if id, err := ID(self); err != nil || id == 0 {
		t.Errorf("ID(%q) = %d, %v", self, id, err)
	}
	if _, err := ID(filepath.Join(root, "no-such-cgroup")); err == nil {
		t.Error("ID of a missing cgroup: no error")
	}
}
