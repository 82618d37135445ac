//go:build linux

package loader

import (
	"errors"
	"flag"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/cilium/ebpf"

	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/internal/privtest"
	"github.com/egressd/egressd/pkg/limit"
	"github.com/egressd/egressd/pkg/verdict"
)

var progrunSeed = flag.Uint64("progrun.seed", 0, "replays TestKernelLimiterArithmetic with this seed (0: a random one)")

const (
	arithSequences = 200  // per shape
	arithTakes     = 1000 // per sequence
)

// TestKernelLimiterArithmetic holds the datapath's token bucket and sliding
// window (bpf/rule.h, run by progrun.c's syscall program with
// BPF_PROG_RUN) to pkg/limit's PerSecond and PerWindow, which claim the same
// arithmetic. Over random sequences of takes (bursts, gaps at the limit's
// rate, the instant a refusal named, segment boundaries, quiet spells,
// clock readings another CPU has already passed, a kernel clock that ends
// near 2^64) both must admit and refuse alike and name the same wait to
// the nanosecond. A failure prints the seed and the sequence;
// -progrun.seed replays it.
func TestKernelLimiterArithmetic(t *testing.T) {
	privtest.RequireRoot(t)
	var objs progrunObjects
	if err := loadProgrunObjects(&objs, nil); err != nil {
		t.Fatalf("load: %+v", err)
	}
	t.Cleanup(func() { objs.Close() })
	seed := *progrunSeed
	if seed == 0 {
		seed = rand.Uint64()
	}
	t.Logf("seed %d", seed)

	shapes := []struct {
		name string
		gen  func(*rand.Rand) arithShape
		// wraps: the kernel computes a refusal's end, (oldest + n) ×
		// segment, which passes 2^64 near it; a bucket's wait is never
		// added to the clock.
		wraps bool
	}{
		{"token", arithToken, false},
		{"window", arithWindow, true},
	}
	for _, sh := range shapes {
		t.Run(sh.name, func(t *testing.T) {
			var n arithCounts
			for seq := range arithSequences {
				r := rand.New(rand.NewPCG(seed, uint64(seq)))
				s := sh.gen(r)
				takes := s.limitTakes(t, r)
				base := s.base(r, takes[len(takes)-1].at)
				waits := arithKernel(t, &objs, s.step, base, takes)
				for i, tk := range takes {
					if waits[i] != uint64(tk.wait) {
						t.Fatalf("seed %d, sequence %d: take %d: kernel waits %d ns, pkg/limit %d (0: admitted)\n%s\nreplay: go test ./pkg/loader -run 'TestKernelLimiterArithmetic/%s' -progrun.seed=%d",
							seed, seq, i, waits[i], tk.wait, s.describe(base, takes[:i+1], waits), sh.name, seed)
					}
				}
				n.add(base, takes, waits)
			}
			t.Logf("%d sequences of %d takes: %+v", arithSequences, arithTakes, n)
			if n.Admitted == 0 || n.Refused == 0 || n.Stale == 0 || sh.wraps && n.PastWrap == 0 {
				t.Fatalf("the sequences did not take every path: %+v", n)
			}
		})
	}
}

// arithShape is one sequence's rate shape, as the kernel's rule (in step)
// and as pkg/limit's options, and the pace its takes come at: gap is the
// mean gap at the limit's rate, tick the shape's unit (a token's period, a
// segment) whose boundaries takes are steered onto, idle a quiet spell long
// enough to fill or empty the state, rush how often a take comes at once.
type arithShape struct {
	desc            string
	step            progrunStep
	opts            limit.Options
	gap, tick, idle int64
	rush            float64
}

// arithTake is one acquire at at nanoseconds after the limiter began
// (pkg/limit's clock). The kernel's reading is stale nanoseconds earlier,
// as a CPU's is that read the clock before another CPU, reading later,
// took the lock; pkg/limit takes an instant before the latest it saw as
// that one (its time never goes backwards), so it takes at at. wait is
// what pkg/limit answered, 0 for a permit.
type arithTake struct{ at, stale, wait int64 }

// arithToken is a token bucket of up to MaxRate per second whose burst is
// its rate, anything, few enough for a sequence to drain, or, at a few per
// second, slower to fill than the 100 s the kernel refills for without a
// division.
func arithToken(r *rand.Rand) arithShape {
	var rate, burst int64
	switch r.IntN(4) {
	case 0:
		rate = arithLogUniform(r, 1, MaxRate)
		burst = rate
	case 1:
		rate, burst = arithLogUniform(r, 1, MaxRate), arithLogUniform(r, 1, MaxRate)
	case 2:
		rate, burst = arithLogUniform(r, 1, MaxRate), arithLogUniform(r, 1, arithTakes)
	default:
		rate = 1 + r.Int64N(3)
		burst = 100*rate + 1 + r.Int64N(50*rate)
	}
	var s progrunStep
	s.Rule.Shape, s.Rule.Limit, s.Rule.Burst, s.Rule.Epoch = uint8(ShapePerSecond), uint32(rate), uint32(burst), 1
	period := (int64(time.Second) + rate - 1) / rate
	return arithShape{
		desc: fmt.Sprintf("%d per second, burst %d", rate, burst),
		step: s,
		opts: limit.Options{PerSecond: &limit.PerSecondOptions{Permits: int(rate), Burst: int(burst)}},
		gap:  period, tick: period, idle: (burst*int64(time.Second) + rate - 1) / rate,
		rush: arithRush(r),
	}
}

// arithWindow is a sliding window of 1 to MaxSegments segments of 1 ms to
// 10 s.
func arithWindow(r *rand.Rand) arithShape {
	n := 1 + r.Int64N(MaxSegments)
	seg := arithLogUniform(r, int64(time.Millisecond), int64(10*time.Second))
	permits := arithLogUniform(r, 1, 1000)
	var s progrunStep
	s.Rule.Shape, s.Rule.Limit, s.Rule.Segments, s.Rule.SegmentNs, s.Rule.Epoch = uint8(ShapePerWindow), uint32(permits), uint32(n), uint64(seg), 1
	return arithShape{
		desc: fmt.Sprintf("%d per %d segments of %d ns", permits, n, seg),
		step: s,
		opts: limit.Options{PerWindow: &limit.PerWindowOptions{Permits: int(permits), Window: time.Duration(n * seg), Segments: int(n)}},
		gap:  max(1, n*seg/permits), tick: seg, idle: n * seg,
		rush: arithRush(r),
	}
}

// arithRush is how often a sequence's takes come at once: from never to
// nearly always, above 99% for one sequence in ten, which then drains a
// bucket of hundreds.
func arithRush(r *rand.Rand) float64 {
	u := r.Float64()
	return 1 - u*u
}

// arithLogUniform returns an integer in [lo, hi] whose logarithm is
// uniform: as many small values as large ones.
func arithLogUniform(r *rand.Rand, lo, hi int64) int64 {
	l, h := math.Log(float64(lo)), math.Log(float64(hi))
	return min(max(int64(math.Round(math.Exp(l+r.Float64()*(h-l)))), lo), hi)
}

// next returns the take that follows takes.
func (s *arithShape) next(r *rand.Rand, takes []arithTake) arithTake {
	if len(takes) == 0 {
		return arithTake{at: r.Int64N(s.tick)}
	}
	last := takes[len(takes)-1]
	at := last.at
	if r.Float64() < s.rush {
		return arithTake{at: at}
	}
	switch k := r.IntN(8); {
	case k < 3: // about the limit's rate
		at += 1 + r.Int64N(2*s.gap)
	case k < 4 && last.wait > 0: // when the refusal said, to the nanosecond or either side
		at += last.wait - 1 + r.Int64N(3)
	case k < 5: // onto the next boundary, or either side
		at = (at/s.tick+1)*s.tick - 1 + r.Int64N(3)
	case k < 6: // after a quiet spell
		at += s.idle/2 + r.Int64N(3*s.idle)
	case at > takes[0].at: // on a stale clock reading
		return arithTake{at: at, stale: 1 + r.Int64N(min(at-takes[0].at, 2*s.tick))}
	}
	return arithTake{at: at}
}

// limitTakes runs a sequence through pkg/limit on synctest's clock,
// choosing each take from the answers before it.
func (s *arithShape) limitTakes(t *testing.T, r *rand.Rand) []arithTake {
	takes := make([]arithTake, 0, arithTakes)
	synctest.Test(t, func(t *testing.T) {
		l, err := limit.New(s.opts)
		if err != nil {
			t.Fatalf("limit: %v", err)
		}
		var now int64
		for range arithTakes {
			tk := s.next(r, takes)
			clocktest.Advance(time.Duration(tk.at - now))
			now = tk.at
			lease, err := l.Acquire(t.Context())
			if err != nil {
				rl, ok := errors.AsType[*verdict.RateLimitedError](err)
				if !ok || rl.RetryAfter <= 0 {
					t.Fatalf("take %d: %v; want a permit or a refusal with a wait", len(takes), err)
				}
				tk.wait = int64(rl.RetryAfter)
			}
			lease.Release()
			takes = append(takes, tk)
		}
	})
	return takes
}

// base returns where the kernel's clock starts, a multiple of tick, so that
// a window's segments begin where pkg/limit's do (a bucket reads only
// differences): up to 11 days after boot, or, one time in four, so near
// 2^64 that the sequence ends within a tick of it, where a window's
// (oldest + n) × segment passes 2^64 and must still come out right.
func (s *arithShape) base(r *rand.Rand, span int64) uint64 {
	b := uint64(r.Int64N(1e15))
	if r.IntN(4) == 0 {
		b = math.MaxUint64 - uint64(span) - uint64(r.Int64N(s.tick))
	}
	return b - b%uint64(s.tick)
}

// arithKernel runs takes through the kernel's arithmetic from a fresh
// state, its clock starting at base, and returns its waits.
func arithKernel(t *testing.T, objs *progrunObjects, step progrunStep, base uint64, takes []arithTake) []uint64 {
	t.Helper()
	if err := objs.State.Put(uint32(0), progrunRuleState{}); err != nil {
		t.Fatalf("reset state: %v", err)
	}
	waits := make([]uint64, len(takes))
	for i, tk := range takes {
		step.Now, step.Wait = base+uint64(tk.at)-uint64(tk.stale), 0
		ret, err := objs.ProgrunTake.Run(&ebpf.RunOptions{Context: step, ContextOut: &step})
		if err != nil || ret != 0 {
			t.Fatalf("take %d: run: %d, %v", i, ret, err)
		}
		waits[i] = step.Wait
	}
	return waits
}

// describe writes a sequence out: the shape, then a take a line.
func (s *arithShape) describe(base uint64, takes []arithTake, kernel []uint64) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s, the kernel's clock from %d\ntake: at ns (-stale ns): pkg/limit's wait, the kernel's", s.desc, base)
	for i, tk := range takes {
		fmt.Fprintf(&b, "\n%d: %d (-%d): %d, %d", i, tk.at, tk.stale, tk.wait, kernel[i])
	}
	return b.String()
}

// arithCounts says which paths a run took: permits, refusals, stale clock
// readings, and refusals whose end (the clock plus the wait) lies past
// 2^64.
type arithCounts struct{ Admitted, Refused, Stale, PastWrap int }

func (n *arithCounts) add(base uint64, takes []arithTake, waits []uint64) {
	for i, tk := range takes {
		now := base + uint64(tk.at)
		switch {
		case waits[i] == 0:
			n.Admitted++
		case now+waits[i] < now:
			n.Refused++
			n.PastWrap++
		default:
			n.Refused++
		}
		if tk.stale > 0 {
			n.Stale++
		}
	}
}
