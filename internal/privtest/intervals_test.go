package privtest

import (
	"path/filepath"
	"slices"
	"testing"
	"time"
)

func TestMaxOverlap(t *testing.T) {
	ivs := []Interval{{From: 0, To: 10}, {From: 5, To: 15}, {From: 10, To: 20}, {From: 12, To: 13}, {From: 30, To: 40}}
	tests := []struct {
		from, to int64
		most     int
		at       int64
	}{
		{0, 100, 3, 12}, // [5,15), [10,20) and [12,13)
		{0, 10, 2, 5},   // [0,10) ends where [10,20) starts
		{13, 30, 2, 13},
		{20, 30, 0, 0},
		{35, 36, 1, 35},
	}
	for _, tt := range tests {
		most, at := MaxOverlap(ivs, tt.from, tt.to)
		if most != tt.most || at != tt.at {
			t.Errorf("MaxOverlap in [%d, %d) = %d at %d, want %d at %d", tt.from, tt.to, most, at, tt.most, tt.at)
		}
	}
}

func TestIntervalsRoundTrip(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ivs")
	want := []Interval{{Called: 1, From: 2, To: 3, Port: 65535}, {Monotonic(), Monotonic(), Monotonic() + 5, 80}}
	if err := WriteIntervals(path, want); err != nil {
		t.Fatal(err)
	}
	got, err := ReadIntervals(path)
	if err != nil || !slices.Equal(got, want) {
		t.Fatalf("ReadIntervals = %v, %v; want %v", got, err, want)
	}
}

// TestWallOffset: with the wall clock left alone, the offset read twice is
// the same to within a millisecond, and is the wall clock less the
// monotonic one (a wrong sign or unit is off by years; one pair of reads
// preempted on a loaded machine, by milliseconds).
func TestWallOffset(t *testing.T) {
	a := WallOffset()
	rough := time.Duration(time.Now().UnixNano() - Monotonic())
	b := WallOffset()
	if d := (b - a).Abs(); d > time.Millisecond {
		t.Errorf("WallOffset moved %v between two reads", d)
	}
	if d := (rough - a).Abs(); d > time.Second {
		t.Errorf("WallOffset %v, one pair of reads %v", a, rough)
	}
}
