package adaptive

import (
	"math"
	"sync"
	"sync/atomic"
	"time"
)

// Controller runs the loop for one destination. It is safe for concurrent use:
// the daemon feeds it from one ring-buffer reader, an SDK limiter from every
// goroutine that releases a lease. Sample serializes on a mutex; Limit,
// Baseline, Probing and Constrained are lock-free, because a limiter calls
// them on every acquire and every refusal, and refusals come fastest when it
// is busiest.
type Controller struct {
	opts Options // with defaults applied; never changes

	limit       atomic.Int64 // in force: during a probe, the probe's
	baseline    atomic.Int64 // nanoseconds; noBaseline when there is none
	constrained atomic.Bool  // the limit constrained the current round
	restore     atomic.Int64 // during a probe, the limit it restores; 0 otherwise

	mu      sync.Mutex
	calls   int           // completed calls in the current round
	fastest time.Duration // fastest of them
	window  window        // five minutes of latencies
	probe   *prober       // nil unless Options.ProbeEvery > 0
}

// noBaseline marks the absence of a baseline; zero is a (degenerate) latency.
const noBaseline = -1

// New returns a Controller at opts.Initial, or an [*OptionsError] listing every
// problem with opts. A nil opts takes every default.
func New(opts *Options) (*Controller, error) {
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	c := &Controller{opts: opts.withDefaults(), fastest: maxLatency}
	c.limit.Store(int64(c.opts.Initial))
	c.baseline.Store(noBaseline)
	if c.opts.ProbeEvery > 0 {
		c.probe = &prober{every: c.opts.ProbeEvery}
	}
	return c, nil
}

// Limit returns the limit in force: the one to admit calls against, and
// during a probe the probe's.
func (c *Controller) Limit() int {
	return int(c.limit.Load())
}

// Probing reports whether a drain probe holds the limit down, and if so the
// limit the loop has settled on, which the probe restores when it ends. It
// is always false unless Options.ProbeEvery is set. A dashboard that shows
// what the loop settled on shows restore during a probe and Limit otherwise.
func (c *Controller) Probing() (restore int, ok bool) {
	r := c.restore.Load()
	return int(r), r != 0
}

// Baseline returns the latency the last round was judged against: what the
// controller thinks a fast call looks like. It reports false until a round
// ends with at least ten calls in the five-minute window, and again after a
// round ends with fewer (a long idle spell emptied the window); the limit
// holds meanwhile, since there is nothing to judge against. With probes, a
// probe's end also sets it, to the probe baseline the next round is judged
// against.
func (c *Controller) Baseline() (time.Duration, bool) {
	b := c.baseline.Load()
	if b == noBaseline {
		return 0, false
	}
	return time.Duration(b), true
}

// Constrained records that the limit constrained the current round: in-flight
// calls reached it, or an acquire was refused. Without it a round can shrink
// the limit but never grow it, which is what keeps an idle destination from
// ratcheting up to Maximum. A call that races with the end of a round counts
// toward that round or the next; either is true.
func (c *Controller) Constrained() {
	if !c.constrained.Load() {
		c.constrained.Store(true)
	}
}

// Sample records one completed call that took latency and ended at now, and
// ends the round when it is the round's last call. Latencies are clamped to
// [0, ~68.7s]. It takes constant time and allocates nothing; once every ten
// seconds of now it also retires the oldest ten seconds of the window, and
// with probes, once per probe it passes over a few 4 KiB histograms.
//
// Every call enters the window. During a probe a call counts toward no
// round: it is measured if it started (now − latency) no earlier than the
// probe, and drains unmeasured otherwise. After a probe, a call that started
// during it is measured too, and counts toward the round as well.
func (c *Controller) Sample(now time.Time, latency time.Duration) {
	latency = min(max(latency, 0), maxLatency)

	c.mu.Lock()
	defer c.mu.Unlock()
	c.window.record(now, latency)
	if p := c.probe; p != nil {
		if p.active {
			if p.sample(now, latency) {
				c.endProbe(now)
			}
			return
		}
		p.straggler(now, latency)
	}
	c.fastest = min(c.fastest, latency)
	c.calls++
	if limit := c.Limit(); c.calls >= limit {
		c.endRound(now, limit)
	}
}

// endRound judges the round that just completed at limit and starts the next.
// Without a baseline the limit holds: there is nothing to judge against.
// With probes, the next may be a probe.
func (c *Controller) endRound(now time.Time, limit int) {
	constrained := c.constrained.Swap(false)
	fastest := c.fastest
	c.calls, c.fastest = 0, maxLatency

	baseline, ok := c.judgeBaseline(now)
	if !ok {
		c.baseline.Store(noBaseline)
		return
	}
	c.baseline.Store(int64(baseline))
	next := c.opts.next(limit, fastest, baseline, constrained)
	if p := c.probe; p != nil && p.due(now) {
		c.restore.Store(int64(next))
		c.set(limit, p.begin(now, next, &c.opts))
		return
	}
	c.set(limit, next)
}

// judgeBaseline is what a round ending at now is judged against: the probes'
// baseline while one is fresh, otherwise the window's 10th percentile.
func (c *Controller) judgeBaseline(now time.Time) (time.Duration, bool) {
	if c.probe != nil {
		if b, ok := c.probe.baseline(now); ok {
			return b, true
		}
	}
	return c.window.baseline()
}

// endProbe ends the probe at now: no round is judged on it; the limit it
// held down is restored, and the next round starts afresh, refusals during
// the probe forgotten, since they said nothing about the restored limit.
func (c *Controller) endProbe(now time.Time) {
	held := c.probe.finish(now)
	c.calls, c.fastest = 0, maxLatency
	c.constrained.Store(false)
	if b, ok := c.judgeBaseline(now); ok {
		c.baseline.Store(int64(b))
	}
	from := c.Limit()
	c.restore.Store(0)
	c.set(from, held)
}

// set puts to in force in place of from, and tells OnChange if it moved.
func (c *Controller) set(from, to int) {
	if to == from {
		return
	}
	c.limit.Store(int64(to))
	if c.opts.OnChange != nil {
		c.opts.OnChange(from, to)
	}
}

// next is the decision at the end of a round, as a pure function of the
// round's outcome.
func (o *Options) next(limit int, fastest, baseline time.Duration, constrained bool) int {
	switch {
	case float64(fastest) > o.Multiple*float64(baseline):
		return o.decrease(limit)
	case constrained:
		return min(limit+1, o.Maximum)
	default:
		return limit
	}
}

// decrease returns ⌊limit × DecreaseFactor⌋, never below Minimum. Rounding
// down errs toward the dependency, which pays for a limit too high, and always
// moves the limit, where rounding to nearest would hold 4 × 0.9 at 4. That
// holds in floating point too: the largest factor below 1 is 1−2⁻⁵³, and
// limit × (1−2⁻⁵³) rounds to a double below limit for every limit under 2⁵³.
func (o *Options) decrease(limit int) int {
	return max(int(math.Floor(float64(limit)*o.DecreaseFactor)), o.Minimum)
}
