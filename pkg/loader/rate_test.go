//go:build linux

package loader

import (
	"errors"
	"net/netip"
	"os"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/egressd/egressd/internal/privtest"
)

// attempt connects and closes at once; it reports whether the datapath
// admitted the connection.
func attempt(t *testing.T, target netip.AddrPort) bool {
	t.Helper()
	c, err := connect(target)
	if err == nil {
		c.Close()
		return true
	}
	if !errors.Is(err, syscall.EPERM) {
		t.Fatalf("dial %s: %v", target, err)
	}
	return false
}

func TestTokenBucket(t *testing.T) {
	d, cg := open(t)
	srv := listen(t, "tcp4", "127.0.0.1:0")
	privtest.Join(t, cg)
	// A burst of a second's worth rides out scheduling stalls shorter than
	// a second without losing tokens to the cap.
	const rate, burst = 200, 200
	put(t, d, Rule{Name: "bucket", Dests: []netip.Prefix{netip.PrefixFrom(srv.Addr(), 32)}, Port: srv.Port(), Shape: ShapePerSecond, Limit: rate, Burst: burst})

	const period = 2 * time.Second
	admitted := 0
	start := time.Now()
	for time.Since(start) < period {
		if attempt(t, srv) {
			admitted++
		}
	}
	want := rate*period.Seconds() + burst
	t.Logf("admitted %d in %v, want %.0f ±5%%", admitted, period, want)
	if float64(admitted) < want*0.95 || float64(admitted) > want*1.05 {
		t.Fatalf("admitted %d, want %.0f ±5%%", admitted, want)
	}
	s := stats(t, d, "bucket")
	if s.Admitted != uint64(admitted) || s.Refused == 0 {
		t.Fatalf("stats %+v, admitted %d", s, admitted)
	}
}

// monotonic is the clock bpf_ktime_get_ns reads.
func monotonic() time.Duration {
	var ts unix.Timespec
	unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return time.Duration(ts.Nano())
}

func TestSlidingWindow(t *testing.T) {
	d, cg := open(t)
	srv := listen(t, "tcp4", "127.0.0.1:0")
	privtest.Join(t, cg)
	const permits, segments, window = 10, 4, 1600 * time.Millisecond
	const seg = window / segments
	put(t, d, Rule{Name: "window", Dests: []netip.Prefix{netip.PrefixFrom(srv.Addr(), 32)}, Port: srv.Port(), Shape: ShapePerWindow, Limit: permits, Window: window, Segments: segments})

	// Segments are numbered from the monotonic clock; start 50ms into one.
	base := (monotonic()/seg + 1) * seg
	at := func(offset time.Duration) { time.Sleep(base + offset + 50*time.Millisecond - monotonic()) }
	take := func(n int) int {
		got := 0
		for range n {
			if attempt(t, srv) {
				got++
			}
		}
		return got
	}
	steps := []struct {
		at       time.Duration
		try      int
		admitted int
	}{
		{0, 6, 6},            // segment k
		{seg, 5, 4},          // k+1: the window holds 10
		{2 * seg, 1, 0},      // still full
		{window, 7, 6},       // k left the window: its 6 come back
		{window + seg, 5, 4}, // k+1 left: its 4 come back
	}
	for i, st := range steps {
		at(st.at)
		if got := take(st.try); got != st.admitted {
			t.Fatalf("at %v: admitted %d of %d, want %d", st.at, got, st.try, st.admitted)
		}
		if i != 1 {
			continue
		}
		// The first refusal (in k+1) says when segment k leaves: at
		// base+window.
		e, ok, err := d.LastRefusal(uint32(os.Getpid()), ProtoTCP, srv)
		wantRetry := window - seg - 50*time.Millisecond
		if err != nil || !ok || e.Rule != "window" || e.Shape != ShapePerWindow || e.RetryAfter < wantRetry-100*time.Millisecond || e.RetryAfter > wantRetry {
			t.Fatalf("refusal %+v, %v, %v: want rule window, retry after ≈%v", e, ok, err, wantRetry)
		}
	}
}
