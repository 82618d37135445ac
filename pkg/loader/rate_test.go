//go:build linux

package loader

import (
	"errors"
	"maps"
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

// TestTokenBucket attempts connections for a while, each between two
// readings of the kernel's clock: whatever the machine's load made of
// the run, the bucket admitted no more than its burst and what the time
// from the first attempt to the last refilled, and no less than that
// less what the cap may have thrown away in the gaps between attempts
// and what the bucket may still hold.
func TestTokenBucket(t *testing.T) {
	d, cg := open(t)
	srv := listen(t, "tcp4", "127.0.0.1:0")
	privtest.Join(t, cg)
	const rate, burst = 200, 200
	put(t, d, Rule{Name: "bucket", Dests: []netip.Prefix{netip.PrefixFrom(srv.Addr(), 32)}, Port: srv.Port(), Shape: ShapePerSecond, Limit: rate, Burst: burst})

	const period = 2 * time.Second
	admitted := 0
	var first, last [2]time.Duration // the clock before and after an attempt
	var capped float64               // tokens the cap may have thrown away, at most
	var held float64                 // tokens the bucket may hold after the last attempt, at most
	for n := 0; n == 0 || last[1]-first[0] < period; n++ {
		before := monotonic()
		ok := attempt(t, srv)
		after := monotonic()
		avail := float64(burst) // the first attempt finds the bucket full
		if n == 0 {
			first = [2]time.Duration{before, after}
		} else {
			refill := held + rate*(after-last[0]).Seconds()
			capped += max(0, refill-burst)
			avail = min(burst, refill)
		}
		last = [2]time.Duration{before, after}
		if ok {
			admitted++
			held = avail - 1
		} else {
			held = min(avail, 1) // refused below one token
		}
	}
	most := burst + rate*(last[1]-first[0]).Seconds()
	least := burst + rate*(last[0]-first[1]).Seconds() - capped - held
	t.Logf("admitted %d in %v; want %.1f to %.1f", admitted, last[1]-first[0], least, most)
	if float64(admitted) > most || float64(admitted) < least {
		t.Fatalf("admitted %d in %v, want %.1f to %.1f", admitted, last[1]-first[0], least, most)
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

// TestSlidingWindow plays a sequence of attempts at chosen points of the
// window's segments and checks each decision, and each refusal's
// RetryAfter, against the window as the rule defines it, in the segment
// the kernel's clock said. Each attempt is between two readings of that
// clock: one that spans a segment's end could have been decided in
// either, and both stay possible until a later decision tells them apart.
// So a machine that runs an attempt late changes what is expected of it,
// never whether it is checked.
func TestSlidingWindow(t *testing.T) {
	d, cg := open(t)
	srv := listen(t, "tcp4", "127.0.0.1:0")
	privtest.Join(t, cg)
	const permits, segments, window = 10, 4, 1600 * time.Millisecond
	const seg = window / segments
	put(t, d, Rule{Name: "window", Dests: []netip.Prefix{netip.PrefixFrom(srv.Addr(), 32)}, Port: srv.Port(), Shape: ShapePerWindow, Limit: permits, Window: window, Segments: segments})

	// The windows that may be the kernel's: the admissions of each segment,
	// by its number (the clock over seg).
	windows := []map[int64]int{{}}
	try := func() (admitted bool) {
		before := monotonic()
		admitted = attempt(t, srv)
		after := monotonic()
		var e Refusal
		if !admitted {
			var ok bool
			var err error
			if e, ok, err = d.LastRefusal(uint32(os.Getpid()), ProtoTCP, srv); err != nil || !ok || e.Rule != "window" || e.Shape != ShapePerWindow {
				t.Fatalf("refusal %+v, %v, %v: want one of rule window", e, ok, err)
			}
		}
		var next []map[int64]int
		for _, w := range windows {
			refusable := false
			for cur := int64(before / seg); cur <= int64(after/seg); cur++ {
				total, oldest := 0, cur
				for id := cur - segments + 1; id <= cur; id++ {
					if w[id] > 0 {
						total, oldest = total+w[id], min(oldest, id)
					}
				}
				switch {
				case admitted && total < permits:
					w := maps.Clone(w)
					w[cur]++
					next = append(next, w)
				case !admitted && total >= permits:
					// Until the oldest segment counted leaves, from a
					// moment of the attempt within segment cur.
					leaves := time.Duration(oldest+segments) * seg
					refusable = refusable || e.RetryAfter >= leaves-min(after, time.Duration(cur+1)*seg-1) && e.RetryAfter <= leaves-max(before, time.Duration(cur)*seg)
				}
			}
			if refusable {
				next = append(next, w) // a refusal counts nowhere
			}
		}
		if len(next) == 0 {
			t.Fatalf("an attempt in segments %d to %d: admitted %v, retry after %v; the window says otherwise", before/seg, after/seg, admitted, e.RetryAfter)
		}
		windows = next
		return admitted
	}

	// Segments are numbered from the monotonic clock; start 50ms into one.
	// Run on time, the steps are: 6 admitted in segment k; 4 of 5 in k+1,
	// the window then full; none in k+2; 6 of 7 once k has left the
	// window, its 6 back; 4 of 5 once k+1 has left.
	base := (monotonic()/seg + 1) * seg
	for _, st := range []struct {
		at  time.Duration
		try int
	}{{0, 6}, {seg, 5}, {2 * seg, 1}, {window, 7}, {window + seg, 5}} {
		// The window's segments run on the kernel's clock: it must reach the step.
		time.Sleep(base + st.at + 50*time.Millisecond - monotonic())
		got := 0
		for range st.try {
			if try() {
				got++
			}
		}
		t.Logf("at %v: admitted %d of %d", st.at, got, st.try)
	}
}
