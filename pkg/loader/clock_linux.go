package loader

import (
	"math"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// The kernel stamps refusals, samples and rule deadlines with
// bpf_ktime_get_ns(), CLOCK_MONOTONIC; user space wants time.Time. A
// conversion that reads both clocks each time is off by however long the
// thread waited between the two reads, and the return from the
// clock_gettime syscall is where a loaded machine's scheduler takes the
// CPU away: 13 and 26 of 50,000 refusals read back up to 2.9 ms early
// beside three CPU hogs, before their connect() was even made, which made
// the SDK take them for another's refusal
// (TestRefusalTimeNotBeforeConnect). So the two clocks are tied once, by
// the closest of a few bracketed reads, and again every minute for a wall
// clock that was set meanwhile.

// clockAnchor is an instant on both clocks.
type clockAnchor struct {
	wall time.Time // with Go's monotonic reading
	mono int64     // CLOCK_MONOTONIC, ns
}

var anchor atomic.Pointer[clockAnchor]

const anchorAge = time.Minute

// currentAnchor returns the anchor, measured again when it is older than
// anchorAge; nil if CLOCK_MONOTONIC cannot be read.
func currentAnchor() *clockAnchor {
	if a := anchor.Load(); a != nil && time.Since(a.wall) < anchorAge {
		return a
	}
	a := measureAnchor()
	if a != nil {
		anchor.Store(a)
	}
	return a
}

// measureAnchor reads time.Now between two reads of CLOCK_MONOTONIC and
// ties it to their midpoint, keeping the pair of the five read closest
// together.
func measureAnchor() *clockAnchor {
	var best *clockAnchor
	gap := int64(math.MaxInt64)
	for range 5 {
		var before, after unix.Timespec
		if unix.ClockGettime(unix.CLOCK_MONOTONIC, &before) != nil {
			return nil
		}
		now := time.Now()
		if unix.ClockGettime(unix.CLOCK_MONOTONIC, &after) != nil {
			return nil
		}
		if g := after.Nano() - before.Nano(); g < gap {
			gap, best = g, &clockAnchor{wall: now, mono: before.Nano() + g/2}
		}
	}
	return best
}

// wallToMonotonic converts a wall time to a bpf_ktime_get_ns() stamp, at
// least 1 (0 means none): a time before boot is long past.
func wallToMonotonic(t time.Time) uint64 {
	a := currentAnchor()
	if a == nil {
		return 1
	}
	return uint64(max(1, a.mono+int64(t.Sub(a.wall))))
}

// monotonicToWall converts a bpf_ktime_get_ns() stamp to a time.Time,
// which carries Go's monotonic reading: time.Since and Sub are exact.
func monotonicToWall(ns uint64) time.Time {
	a := currentAnchor()
	if a == nil {
		return time.Now()
	}
	return a.wall.Add(time.Duration(int64(ns) - a.mono))
}
