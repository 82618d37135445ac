//go:build unix

package sdnotify_test

import (
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/egressd/egressd/internal/sdnotify"
)

func monotonicUsec(t *testing.T) uint64 {
	t.Helper()
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		t.Fatal(err)
	}
	return uint64(ts.Nano()) / 1000
}

// Reloading sends RELOADING=1 with the CLOCK_MONOTONIC time of the call.
func TestReloading(t *testing.T) {
	conn := fileSocket(t)
	before := monotonicUsec(t)
	if err := sdnotify.Reloading(); err != nil {
		t.Fatal(err)
	}
	after := monotonicUsec(t)
	got := receive(t, conn)
	lines := strings.Split(got, "\n")
	if len(lines) != 2 || lines[0] != "RELOADING=1" || !strings.HasPrefix(lines[1], "MONOTONIC_USEC=") {
		t.Fatalf("datagram = %q, want RELOADING=1\\nMONOTONIC_USEC=N", got)
	}
	us, err := strconv.ParseUint(strings.TrimPrefix(lines[1], "MONOTONIC_USEC="), 10, 64)
	if err != nil {
		t.Fatalf("MONOTONIC_USEC: %v", err)
	}
	if us < before || us > after {
		t.Errorf("MONOTONIC_USEC=%d, want within [%d, %d]", us, before, after)
	}
}
