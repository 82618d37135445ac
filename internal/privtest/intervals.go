package privtest

import (
	"encoding/binary"
	"fmt"
	"math"
	"os"
	"slices"
	"time"

	"golang.org/x/sys/unix"
)

// Interval is one connection as its client saw it, from connect()
// returning to close() being called, in CLOCK_MONOTONIC nanoseconds: one
// clock for every process and network namespace of the machine, so
// intervals from several "hosts" can be laid side by side. The kernel holds
// the connection at least that long, so the most intervals open at once is
// a lower bound on what the kernels held at once: a count that cannot
// flatter the limiter. Called is when connect() was called, and Port the
// client's own port, which tells the connection apart at the server.
type Interval struct {
	Called, From, To int64
	Port             uint16
}

// intervalSize is an Interval's size as written: four little-endian
// 64-bit words.
const intervalSize = 32

// Monotonic is CLOCK_MONOTONIC now, in nanoseconds.
func Monotonic() int64 {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		panic(err) // CLOCK_MONOTONIC always exists on Linux
	}
	return ts.Nano()
}

// WallOffset is the wall clock less CLOCK_MONOTONIC, read where the two
// reads are closest together of a few tries. It changes only when the wall
// clock is set: by hand, or when a paused virtual machine is given the time
// again.
func WallOffset() time.Duration {
	best, bracket := time.Duration(0), time.Duration(math.MaxInt64)
	for range 5 {
		before := Monotonic()
		wall := time.Now().UnixNano()
		after := Monotonic()
		if d := time.Duration(after - before); d < bracket {
			best, bracket = time.Duration(wall-(before+after)/2), d
		}
	}
	return best
}

// WriteIntervals writes intervals to path.
func WriteIntervals(path string, ivs []Interval) error {
	b := make([]byte, 0, intervalSize*len(ivs))
	for _, iv := range ivs {
		for _, w := range []int64{iv.Called, iv.From, iv.To, int64(iv.Port)} {
			b = binary.LittleEndian.AppendUint64(b, uint64(w))
		}
	}
	return os.WriteFile(path, b, 0o644)
}

// ReadIntervals reads what WriteIntervals wrote.
func ReadIntervals(path string) ([]Interval, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	if len(b)%intervalSize != 0 {
		return nil, fmt.Errorf("intervals %s: %d bytes is not a whole number of intervals", path, len(b))
	}
	ivs := make([]Interval, len(b)/intervalSize)
	for i := range ivs {
		w := func(j int) int64 { return int64(binary.LittleEndian.Uint64(b[intervalSize*i+8*j:])) }
		ivs[i] = Interval{Called: w(0), From: w(1), To: w(2), Port: uint16(w(3))}
	}
	return ivs, nil
}

// MaxOverlap returns the most intervals open at one instant in [from, to),
// and that instant. An interval ending where another starts does not
// overlap it.
func MaxOverlap(ivs []Interval, from, to int64) (most int, at int64) {
	type edge struct {
		t int64
		d int
	}
	var edges []edge
	for _, iv := range ivs {
		lo, hi := max(iv.From, from), min(iv.To, to)
		if lo < hi {
			edges = append(edges, edge{lo, 1}, edge{hi, -1})
		}
	}
	slices.SortFunc(edges, func(a, b edge) int {
		if a.t != b.t {
			return int(min(max(a.t-b.t, -1), 1))
		}
		return a.d - b.d // ends first
	})
	n := 0
	for _, e := range edges {
		n += e.d
		if n > most {
			most, at = n, e.t
		}
	}
	return most, at
}
