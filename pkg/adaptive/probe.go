package adaptive

import (
	"math"
	"time"
)

// Drain probes (Options.ProbeEvery > 0) give the loop a baseline that its own
// queue cannot teach it, the idea of BBR's ProbeRTT: now and then hold the
// limit well under where it settled, so that the calls admitted meanwhile
// find the dependency without our queue in it, and measure "a fast call" on
// those calls only.
//
// Which calls are a probe's is decided from what Sample is given: a call that
// ended at now after latency started at now − latency, and it is the probe's
// if that lies in [the instant the probe began, the instant it ended). A call
// admitted before the probe, under the full limit and possibly queued, drains
// without being measured, however long it takes; a call admitted during the
// probe is measured even when it completes after the probe has ended, since
// otherwise the probe would keep the calls that finished first, the fast
// ones, and its 10th percentile would be low. No per-call token is needed,
// only that now and latency come from one clock, as a kernel timestamp pair
// or a lease's start and end do.
const (
	// probeMemory is how many probes the baseline remembers. It is the 10th
	// percentile of their calls pooled: at least 3 × minSamples calls, where
	// one probe's own 10th percentile is its first or second fastest call
	// and a noisy estimate. One probe that did meet a queue (the capacity
	// had just dropped, or the limit had grown above twice it) moves the
	// pooled 10th percentile only to about the 15th of the other two; a
	// dependency that really did get slower is believed once this many
	// probes have seen it.
	probeMemory = 3

	// probeAge is how long a probe's measurement counts: the five minutes of
	// the specified window. With none left the loop falls back to the window
	// and probes again at the next round's end.
	probeAge = slots * slotWidth
)

// prober is a Controller's probe state, guarded by the Controller's mutex.
type prober struct {
	every int

	rounds int // rounds judged since the last probe ended

	active bool
	start  time.Time // when the active or the last probe began
	end    time.Time // when the last probe ended
	last   int       // probes index of the last probe that ended
	held   int       // the limit the active probe restores
	need   int       // probe calls it completes before it ends
	seen   int       // calls completed since it began, its own or not
	giveUp int       // calls after which it ends however few were its own

	// The calls of the last probeMemory probes, the active one included, as
	// a ring of histograms (the active probe's is probes[next]) and their
	// sum over the probes that ended less than probeAge ago.
	probes [probeMemory]probeCalls
	next   int
	total  [buckets]uint32
	n      uint64 // sum of total
}

// probeCalls is the calls one probe measured. Counts are 32-bit: a probe
// measures max(limit × ProbeFactor, minSamples) calls and limits are 32-bit.
type probeCalls struct {
	ended   time.Time // zero while active or unused
	counted bool      // included in total
	hist    [buckets]uint32
	n       uint64
}

// baseline returns the 10th percentile of the calls of the remembered
// probes that ended less than probeAge before now, or false when they hold
// fewer than minSamples calls (none ended so recently, or one gave up).
// Probes that have aged out leave the sum here, at a cost of one pass over
// their histogram each.
func (p *prober) baseline(now time.Time) (time.Duration, bool) {
	for i := range p.probes {
		if pc := &p.probes[i]; pc.counted && now.Sub(pc.ended) >= probeAge {
			p.uncount(pc)
		}
	}
	if p.n < minSamples {
		return 0, false
	}
	return percentile10(&p.total, p.n), true
}

// uncount takes a probe's calls out of the sum.
func (p *prober) uncount(pc *probeCalls) {
	for i, c := range pc.hist {
		p.total[i] -= c
	}
	p.n -= pc.n
	pc.counted = false
}

// due counts a judged round and reports whether a probe starts at its end:
// every ProbeEvery rounds, and at once when no probe has ended in the last
// probeAge (the first round with a baseline, or after a quiet spell), so
// that the window's baseline, which learns our own queue, is judged against
// as few rounds as possible.
func (p *prober) due(now time.Time) bool {
	p.rounds++
	if p.rounds >= p.every {
		return true
	}
	for _, pc := range p.probes {
		if !pc.ended.IsZero() && now.Sub(pc.ended) < probeAge {
			return false
		}
	}
	return true
}

// begin starts a probe at now that will restore held, and returns the limit
// in force meanwhile.
func (p *prober) begin(now time.Time, held int, o *Options) int {
	limit := o.probeLimit(held)
	p.active, p.start, p.held = true, now, held
	// The oldest probe makes room for this one.
	pc := &p.probes[p.next]
	if pc.counted {
		p.uncount(pc)
	}
	pc.hist, pc.n, pc.ended = [buckets]uint32{}, 0, time.Time{}
	// At least minSamples calls, so that the probe has a 10th percentile
	// that is a whole call even at a small limit.
	p.need = max(limit, minSamples)
	// A guard, not a rule: at most held calls were in flight when the
	// probe began, so by held + need completions at least need were its
	// own, unless now − latency misplaces them (now and latency from
	// different clocks). Then the probe ends anyway, twice that late,
	// rather than hold the limit down for good.
	p.seen, p.giveUp = 0, 2*(held+p.need)
	return limit
}

// sample counts one call during a probe, and reports whether the probe has
// measured enough calls to end.
func (p *prober) sample(now time.Time, latency time.Duration) bool {
	p.seen++
	if now.Sub(p.start) < latency {
		// Admitted before the probe began: draining, not measured.
		return p.seen >= p.giveUp
	}
	pc := &p.probes[p.next]
	pc.hist[bucketOf(latency)]++
	pc.n++
	return pc.n >= uint64(p.need) || p.seen >= p.giveUp
}

// straggler counts one call outside a probe if it was admitted during the
// last one.
func (p *prober) straggler(now time.Time, latency time.Duration) {
	pc := &p.probes[p.last]
	if pc.ended.IsZero() || now.Sub(p.start) < latency || now.Sub(p.end) >= latency {
		return
	}
	i := bucketOf(latency)
	pc.hist[i]++
	pc.n++
	if pc.counted {
		p.total[i]++
		p.n++
	}
}

// finish ends the probe at now, adds its calls to the baseline, and returns
// the limit to restore.
func (p *prober) finish(now time.Time) int {
	pc := &p.probes[p.next]
	for i, c := range pc.hist {
		p.total[i] += c
	}
	p.n += pc.n
	pc.ended, pc.counted = now, true
	p.end, p.last = now, p.next
	p.next = (p.next + 1) % probeMemory
	p.active, p.rounds = false, 0
	return p.held
}

// probeLimit returns ⌈limit × ProbeFactor⌉, never below Minimum. A product
// within a rounding error of a whole number is that number, so that
// ⌈100 × 0.07⌉ is 7 although 100 × 0.07 is 7.000000000000001 in floating
// point.
func (o *Options) probeLimit(limit int) int {
	x := float64(limit) * o.ProbeFactor
	if r := math.Round(x); math.Abs(x-r) <= x*1e-12 {
		x = r
	}
	return max(int(math.Ceil(x)), o.Minimum)
}
