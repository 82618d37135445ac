package edge

import (
	"context"
	"math"
	"strconv"
	"strings"
	"time"
)

// Criticality and the time a caller will still wait cross the process edge
// in two request headers: package sdkhttp's Propagate step (and sdkgrpc's,
// in metadata) sends them, and package serve's middleware (and servegrpc's
// interceptors) reads them into the request's context, where an Admit hook
// and the retry budget of the next hop read them again. Both sides use the
// names and functions here, so they cannot drift apart.
const (
	// CriticalityHeader carries the caller's Criticality by name:
	// Sheddable, SheddablePlus, Critical or CriticalPlus.
	CriticalityHeader = "Egressd-Criticality"
	// TimeoutHeader carries how long the caller will still wait, in whole
	// milliseconds, as a decimal integer. It is relative rather than a
	// point in time so that the two hosts' clocks need not agree; the
	// receiver measures it from when it read the header, which makes its
	// deadline later than the caller's by the request's one-way latency.
	TimeoutHeader = "Egressd-Timeout-Ms"
)

// ParseCriticality reads a CriticalityHeader value: one of the four names,
// in any case, surrounding spaces ignored. ok is false for anything else,
// which a receiver must ignore rather than guess at.
func ParseCriticality(s string) (c Criticality, ok bool) {
	s = strings.TrimSpace(s)
	for _, c := range [...]Criticality{Sheddable, SheddablePlus, Critical, CriticalPlus} {
		if strings.EqualFold(s, c.String()) {
			return c, true
		}
	}
	return Critical, false
}

// LookupCriticality returns the criticality ctx carries, and whether it
// carries one: unlike CriticalityFrom, it tells "labelled Critical" from
// "not labelled", so that a sender leaves the receiver's default in force
// for work nobody labelled.
func LookupCriticality(ctx context.Context) (Criticality, bool) {
	c, ok := ctx.Value(criticalityKey{}).(Criticality)
	return c, ok
}

// FormatTimeout formats d, the time a caller will still wait, as a
// TimeoutHeader value: whole milliseconds, rounded down, so that the
// receiver never thinks it has longer than the caller will give it; zero
// for a d below a millisecond or negative.
func FormatTimeout(d time.Duration) string {
	return strconv.FormatInt(max(d.Milliseconds(), 0), 10)
}

// maxTimeoutMs is the largest number of milliseconds a Duration holds.
const maxTimeoutMs = math.MaxInt64 / int64(time.Millisecond)

// ParseTimeout reads a TimeoutHeader value: decimal digits only (no sign,
// no fraction, no unit), surrounding spaces ignored. ok is false for
// anything else, including a negative number; a value too long for a
// Duration saturates, since it can only mean "longer than you will wait".
func ParseTimeout(s string) (d time.Duration, ok bool) {
	ms, err := strconv.ParseUint(strings.TrimSpace(s), 10, 64)
	if err != nil {
		return 0, false
	}
	if ms > uint64(maxTimeoutMs) {
		return math.MaxInt64, true
	}
	return time.Duration(ms) * time.Millisecond, true
}
