package adaptive

import (
	"math"
	"math/bits"
	"math/rand/v2"
	"time"
)

// Drain probes give the loop a baseline that its own queue cannot teach it,
// the idea of BBR's ProbeRTT: now and then hold the limit well under where it
// settled, so that the calls admitted meanwhile find the dependency without
// our queue in it, and measure "a fast call" on those calls only. The
// package documentation says why and what was measured; this is how.
//
// Which calls a probe measures is decided from what Sample is given: a call
// that ended at now after latency was admitted at now − latency. A probe
// measures batches of at least minEstimate calls, each the calls admitted
// since the batch began; a call admitted before, under a higher limit and
// possibly queued, drains without being measured. No per-call token is
// needed, only that now and latency come from one clock, as a kernel
// timestamp pair or a lease's start and end do.
//
// When several hosts call one dependency, each host's queue is only a part
// of its queue, and one host halving its limit drains nothing: the probes
// of all the hosts must overlap. So probes happen in windows that hosts
// share without talking to each other: at multiples of a period (see period)
// of their clocks, each host beginning its probe at a random moment within
// ± ProbeJitter of the period around the window's start so that they do not
// begin in lockstep, and a probe that meets a queue holds on, deeper, until
// the window's last probes have begun.
const (
	// probeAge is the five minutes of the specified window: the longest
	// probe period; after this long at the floor with every probe meeting
	// a queue, the dependency is believed slower.
	probeAge = slots * slotWidth

	// probeMemory is how many probes the baseline remembers: it is the 10th
	// percentile of the calls of the probes that found the dependency
	// without a queue, each probe's calls weighing 1 − 1/probeMemory as
	// much as the next one's, about probeMemory × minEstimate calls in
	// all. Hosts that call one dependency each judge it by their own
	// baseline, and the round rule shares the dependency fairly only when
	// those agree within a few percent: in bench/adaptivesim, ten hosts
	// whose baselines are ±10% apart get shares with Jain's index 0.88,
	// ±3% apart 0.97. The 10th percentile of 400 calls is within about ±5%.
	probeMemory = 20

	// firstEstimate is how many calls the first probe measures, for the
	// same reason: the 10th percentile of 200 calls is within about ±6%.
	firstEstimate = 200

	// drainedWithin is how far above the baseline a batch's 10th
	// percentile may be and still count as the dependency without a
	// queue: the noise of the 2nd fastest of 20 calls, where a queue of
	// other callers' a fifth of a fast call long is not.
	drainedWithin = 1.2

	// acceptWithin is how far above the baseline a probe's measurement may
	// be and still join it. Tighter than drainedWithin, so that a queue
	// too short to tell a batch from noise does not, probe after probe,
	// creep into the baseline: the baseline is a pool of many probes'
	// calls, and what a tight bound keeps out of it is mostly queue.
	acceptWithin = 1.05

	// improvement is how much faster than the last a probe's batch must be
	// (its 10th percentile, × improvement) for the probe to measure another
	// rather than end: other callers' probes are still draining the queue.
	improvement = 0.9
)

// prober is a Controller's probe state, guarded by the Controller's mutex.
type prober struct {
	rng    rand.PCG      // draws where in its window a probe begins
	round  time.Duration // how long rounds have lately taken
	next   time.Time     // when the next probe is due
	window time.Time     // the start of its window
	end    time.Time     // when the last probe ended

	// The active probe.
	active  bool
	first   bool          // it measures a baseline no probe has confirmed
	deep    bool          // it went deeper than its first limit
	wait    time.Time     // until when it holds on while it meets a queue
	judge   time.Duration // the baseline when it began
	ref     time.Duration // the median of the probes' calls then
	held    int           // the limit it restores
	settled int           // the limit it began from
	low     int           // its limit
	cut     bool          // the batch runs at a limit below the last's
	flat    int           // cut batches since the level last fell
	slower  bool          // it found the dependency slower, not queued
	need    int           // calls in a batch
	batches int           // batches it has begun
	start   time.Time     // when the batch began
	seen    int           // calls completed since then that were not the batch's
	fastest time.Duration // of the batch
	prev    time.Duration // the last batch's 10th percentile
	batch   calls         // the batch being measured

	// The active probe's batch with the lowest 10th percentile, level,
	// admitted in [from, to); after the probe, the calls admitted then
	// that are still to complete join the baseline if it did.
	best     calls
	level    time.Duration
	from, to time.Time
	counting bool

	// The calls of the probes that found the dependency without a queue,
	// older ones weighing less (see probeMemory); n is their weight in all.
	total [buckets]float64
	n     float64

	// Since when the limit has been at Minimum, and since when every probe
	// has met a queue: when both exceed probeAge, the dependency is
	// believed slower.
	floor, queued time.Time
}

// calls is a histogram of latencies. Counts are 32-bit: a batch is
// max(limit × ProbeFactor, firstEstimate) calls and limits are 32-bit.
type calls struct {
	hist [buckets]uint32
	n    uint64
}

func newProber(seed uint64) *prober {
	if seed == 0 {
		seed = rand.Uint64()
	}
	p := &prober{}
	p.rng.Seed(seed, seed)
	return p
}

// baseline returns the 10th percentile of the calls of the probes that
// found the dependency without a queue, or false before there are
// minEstimate of them.
func (p *prober) baseline() (time.Duration, bool) {
	if p.n < minEstimate {
		return 0, false
	}
	return weightedPercentile(&p.total, p.n, 10), true
}

// period is the time between probe windows: ProbeEvery rounds, rounded up
// to a power of two nanoseconds, and at most probeAge. A round is counted
// as long as rounds have lately taken (an average of the last few after
// the first probe), or before one was timed as Multiple × baseline, how
// long a call takes where the loop settles. Windows start at the multiples of the period since the
// Unix epoch, so hosts whose clocks agree and whose rounds take about as
// long (within a factor of two) share them; and where they do not, the
// longer of two such periods is a power of two times the shorter, and its
// windows are some of the shorter's.
//
// The product is capped in floating point, before any conversion: a large
// ProbeEvery or Multiple would otherwise overflow it, and rounding 2⁶³ ns
// or more up to a power of two shifts 1 out of 64 bits, a period of 0.
func (p *prober) period(baseline time.Duration, o *Options) time.Duration {
	round := float64(p.round)
	if p.round <= 0 {
		round = o.Multiple * float64(baseline)
	}
	d := max(uint64(min(float64(o.ProbeEvery)*round, float64(probeAge))), 2)
	return time.Duration(min(uint64(1)<<bits.Len64(d-1), uint64(probeAge)))
}

// roundTook counts how long a round took: an average weighing the last
// round an eighth.
func (p *prober) roundTook(d time.Duration) {
	if p.round <= 0 {
		p.round = d
		return
	}
	p.round += (d - p.round) / 8
}

// spread is how far from its window's start a probe may begin.
func spread(per time.Duration) time.Duration {
	return time.Duration(ProbeJitter * float64(per))
}

// schedule draws when the next probe is due, after one that ended at now:
// at the start of a later window, ± spread at random, and at least half a
// period from now.
func (p *prober) schedule(now time.Time, baseline time.Duration, o *Options) {
	per := p.period(baseline, o)
	j := int64(spread(per))
	offset := time.Duration(int64(p.rng.Uint64()%uint64(2*j+1)) - j)
	window := time.Unix(0, (now.UnixNano()/int64(per)+1)*int64(per))
	if window.Add(offset).Sub(now) < per/2 {
		window = window.Add(per)
	}
	p.window, p.next = window, window.Add(offset)
}

// due reports whether a probe is due at the end of a round judged at now
// that leaves the limit at limit: when its time has come, and at once
// before the first, so that the window's baseline, which learns our own
// queue, is judged against as few rounds as possible. Never earlier, not
// even after a quiet spell: a probe begun before its window holds on until
// that window's last probes have begun, which is up to 1.5 periods after
// the last probe ended (see schedule); the next round after a quiet spell
// longer than that finds the probe due anyway.
func (p *prober) due(now time.Time, limit int, o *Options) bool {
	if limit > o.Minimum || p.floor.IsZero() {
		p.floor = now
	}
	return p.end.IsZero() || !now.Before(p.next)
}

// begin starts a probe at now that will restore held, judged against
// judge, and returns the limit in force meanwhile: ⌈held × ProbeFactor⌉,
// never below Minimum. Before any probe has confirmed the baseline, which
// may then be our queue's or other callers', the probe goes to Minimum,
// measures firstEstimate calls, and holds on until the window's last
// probes have begun whatever it measures: that is how the hosts of one
// dependency that start together learn one baseline, and how a host that
// joins them learns it at their next window.
func (p *prober) begin(now time.Time, held int, judge time.Duration, o *Options) int {
	p.active, p.held, p.settled, p.judge = true, held, held, judge
	p.best, p.level, p.counting, p.deep, p.batches = calls{}, maxLatency+1, false, false, 0
	p.cut, p.flat, p.slower = false, 0, false
	_, confirmed := p.baseline()
	p.first = !confirmed
	if confirmed {
		p.ref = weightedPercentile(&p.total, p.n, 50)
	}
	low := min(o.probeLimit(held), held)
	if p.first {
		low = o.Minimum
	}
	// A probe that meets a queue holds on until the last probes of its
	// window have begun, and as long again.
	per := p.period(judge, o)
	p.wait = now.Add(2 * spread(per))
	if !p.window.IsZero() && now.Sub(p.window) < per {
		p.wait = p.window.Add(2 * spread(per))
	}
	p.newBatch(now, low)
	return low
}

func (p *prober) newBatch(now time.Time, low int) {
	p.start, p.low, p.fastest, p.seen = now, low, maxLatency, 0
	p.batch = calls{}
	p.batches++
	// At least minEstimate calls, so that a batch is an estimate worth
	// remembering also at a small limit.
	p.need = max(low, minEstimate)
	if p.first {
		p.need = max(low, firstEstimate)
	}
}

// sample counts one call that completed at now during a probe. It reports
// whether the probe ends with it, and otherwise the probe's limit from now.
func (p *prober) sample(now time.Time, latency time.Duration, o *Options) (end bool, low int) {
	if p.straggler(now, latency, &p.best) {
		return false, p.low
	}
	if now.Sub(p.start) < latency {
		// Admitted before the batch began: draining, not measured. A
		// guard, not a rule: by held + need completions at least need
		// were the batch's own, unless now − latency misplaces them (now
		// and latency from different clocks); twice that, and the probe
		// ends rather than hold the limit down for good.
		p.seen++
		return p.seen >= 2*(p.held+p.need), p.low
	}
	p.batch.hist[bucketOf(latency)]++
	p.batch.n++
	p.fastest = min(p.fastest, latency)
	if p.batch.n < uint64(p.need) {
		return false, p.low
	}

	// A batch is drained by its 10th percentile, as the baseline is
	// measured; the fastest batch is the one with the least median, which
	// a queue moves as much and noise less, so that picking it does not
	// pick the low noise of the 10th percentile that the baseline is.
	level := percentile10(&p.batch.hist, p.batch.n)
	if mid := percentile(&p.batch.hist, p.batch.n, 50); mid < p.level {
		p.best, p.level, p.from, p.to = p.batch, mid, p.start, now
	}
	drained := float64(level) <= drainedWithin*float64(p.judge)
	improving := p.batches > 1 && float64(level) < improvement*float64(p.prev)
	if !drained && !p.first {
		// A queue at half the limit or less, ours or others': the batch
		// counts as a round that shows one.
		p.held = o.decrease(p.held)
		switch {
		case improving:
			p.flat = 0
		case p.cut:
			p.flat++
		}
	}
	late := !now.Before(p.wait)
	deeper := min(o.probeLimit(p.low), p.held)
	queue := !drained && !p.first
	switch {
	case queue && float64(p.fastest) > o.Multiple*float64(p.judge):
		// Even the fastest call waited, as a round judges a queue: the
		// limit is falling, not the baseline. The probe ends, and rounds
		// go on.
		return true, p.low
	case queue && late && p.flat >= 2:
		// Its limit cut twice with the level no lower, and the window's
		// last probes have begun: no queue drains, ours or the probing
		// callers'. The dependency is slower; the decreases were not a
		// queue's, and the probe's measurement is the new baseline (see
		// finish).
		p.slower, p.held = true, p.settled
		return true, p.low
	case queue && (!late || deeper < p.low):
		// Deeper, measuring afresh from now, when more of the
		// dependency's callers may be probing; past the hold, only while
		// a cut may yet tell a queue from a slower dependency, and cuts
		// end at Minimum.
		p.deep = true
		p.prev, p.cut = level, deeper < p.low
		p.newBatch(now, deeper)
		return false, p.low
	case late, !p.first && drained && !improving:
		if drained && p.deep {
			// It had to go deeper than its first limit to find the
			// dependency without a queue: it restores at most the limit
			// that would have probed at this depth.
			// Compared in floating point: low / ProbeFactor overflows an
			// int for a ProbeFactor near 0.
			if at := float64(p.low) / o.ProbeFactor; at < float64(p.held) {
				p.held = max(int(at), o.Minimum)
			}
		}
		return true, p.low
	}
	p.prev, p.cut = level, false
	p.newBatch(now, p.low)
	return false, p.low
}

// finish ends the probe at now, schedules the next and returns the limit
// to restore. The probe's measurement is its fastest batch, with the calls
// admitted during it that are still to complete: the last batch ended the
// probe by being no faster than the one before, and an earlier one may be
// faster if other callers' probes ended meanwhile and their queue came
// back. A first probe's measurement becomes the baseline; another's joins
// it if it is within acceptWithin of it. One that is not taught nothing,
// since the queue it met may be other callers'; unless it found the
// dependency slower (see sample), when its measurement replaces the
// probes' calls: a dependency 1.2 to Multiple times slower than its
// baseline is neither drained for a probe nor a queue for a round, and
// would otherwise be judged by its old baseline for good. After probeAge
// of probes that met a queue, with the limit at Minimum throughout, the
// dependency is believed slower too: the probes' calls are forgotten,
// rounds are judged against the window as specified, and the next probe
// is a first probe again.
func (p *prober) finish(now time.Time, o *Options) int {
	b := &p.best
	if p.slower {
		p.forget()
	}
	accepted := b.n >= minEstimate && (p.first || p.slower || float64(percentile(&b.hist, b.n, 50)) <= acceptWithin*float64(p.ref))
	if accepted {
		p.remember(b)
		p.queued = time.Time{}
	} else {
		if p.queued.IsZero() {
			p.queued = now
		}
		if now.Sub(p.queued) >= probeAge && now.Sub(p.floor) >= probeAge {
			p.forget()
		}
	}
	p.active, p.end = false, now
	if base, ok := p.baseline(); ok {
		p.schedule(now, base, o)
	} else {
		p.schedule(now, p.judge, o)
	}
	return p.held
}

// remember adds a probe's calls to the remembered ones, which weigh less
// by 1/probeMemory each time.
func (p *prober) remember(b *calls) {
	const keep = 1 - 1.0/probeMemory
	for i, c := range b.hist {
		p.total[i] = p.total[i]*keep + float64(c)
	}
	p.n = p.n*keep + float64(b.n)
	p.counting = true
}

func (p *prober) forget() {
	p.total, p.n, p.queued, p.counting = [buckets]float64{}, 0, time.Time{}, false
}

// straggler counts a call that completed at now with the batch b, or with
// the remembered calls when b is nil, and reports whether it did: if it was
// admitted during the batch that made the probe's measurement. Otherwise
// the measurement would keep the calls that completed first, the fast ones,
// and its 10th percentile would be low.
func (p *prober) straggler(now time.Time, latency time.Duration, b *calls) bool {
	admitted := now.Add(-latency)
	if admitted.Before(p.from) || !admitted.Before(p.to) {
		return false
	}
	i := bucketOf(latency)
	switch {
	case b != nil && b.n > 0:
		b.hist[i]++
		b.n++
	case b == nil && p.counting:
		p.total[i]++
		p.n++
	default:
		return false
	}
	return true
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
