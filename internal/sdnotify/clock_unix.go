//go:build unix

package sdnotify

import "golang.org/x/sys/unix"

// monotonicUsec reads CLOCK_MONOTONIC in microseconds, the clock systemd
// reads MONOTONIC_USEC against.
func monotonicUsec() (uint64, bool) {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		return 0, false
	}
	return uint64(ts.Nano()) / 1000, true
}
