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
	began   time.Time     // when the round began: when the last ended
	window  window        // five minutes of latencies
	probe   *prober       // nil with NoProbes or a fixed Baseline
	source  Source        // of the last baseline judged by
	probes  uint64        // probes ended
}

//go:generate go tool stringer -type=Source -linecomment

// Source says where a baseline comes from. Its String is the control API's
// baselineSource.
type Source uint8

const (
	// NoSource: not enough calls for a baseline yet.
	NoSource Source = iota // none
	// FromWindow: the 10th percentile of the last five minutes of calls,
	// as the reference specifies: with NoProbes, and before the first
	// probe.
	FromWindow // window
	// FromProbes: the calls of drain probes.
	FromProbes // probes
	// Fixed: Options.Baseline.
	Fixed // fixed
)

// State is what a Controller is doing, for a dashboard or an API.
type State struct {
	// Limit is the limit in force; Settled is the one the loop settled
	// on: Limit, or during a probe the limit the probe restores.
	Limit, Settled int
	Probing        bool
	// Baseline is what the last round was judged against (0 for none),
	// and Source where it came from.
	Baseline time.Duration
	Source   Source
	// LastProbe is when the last probe ended and NextProbe when the next
	// is due, both zero without probes or before the first; Probes counts
	// the probes that ended.
	LastProbe, NextProbe time.Time
	Probes               uint64
	// NoProbes says the loop never probes: ProbeEvery is NoProbes, or the
	// baseline is fixed.
	NoProbes bool
}

// State returns a snapshot of c. It takes c's lock, as Sample does.
func (c *Controller) State() State {
	c.mu.Lock()
	defer c.mu.Unlock()
	st := State{Limit: c.Limit(), Source: c.source, Probes: c.probes}
	st.Settled = st.Limit
	if restore, ok := c.Probing(); ok {
		st.Settled, st.Probing = restore, true
	}
	if b, ok := c.Baseline(); ok {
		st.Baseline = b
	}
	if p := c.probe; p != nil {
		st.LastProbe, st.NextProbe = p.end, p.next
	} else {
		st.NoProbes = true
	}
	return st
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
		c.probe = newProber(c.opts.ProbeSeed)
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
// [0, ~68.7s]. It takes constant time; once every ten seconds of now it
// allocates the window's next 4 KiB slot and retires the oldest ten seconds
// of the window, and with probes, once per batch of a probe it passes over
// a 4 KiB histogram and once per probe over an 8 KiB one. A Controller
// holds 8 KiB plus 4 KiB for each ten seconds of the last five minutes in
// which it was called (at most about 128 KiB), and with probes 20 KiB more.
//
// Every call enters the window. During a probe a call counts toward no
// round: it is measured if it started (now − latency) during the probe's
// batch, and drains unmeasured otherwise. After a probe, a call that started
// during the batch that made its measurement is measured too, and counts
// toward the round as well.
func (c *Controller) Sample(now time.Time, latency time.Duration) {
	latency = min(max(latency, 0), maxLatency)

	c.mu.Lock()
	defer c.mu.Unlock()
	if c.opts.Baseline == 0 {
		c.window.record(now, latency)
	}
	if p := c.probe; p != nil {
		if p.active {
			end, low := p.sample(now, latency, &c.opts)
			if end {
				c.endProbe(now)
				return
			}
			c.restore.Store(int64(p.held))
			c.set(c.Limit(), low)
			return
		}
		p.straggler(now, latency, nil)
	}
	c.fastest = min(c.fastest, latency)
	c.calls++
	if limit := c.Limit(); c.calls >= limit {
		c.endRound(now, limit)
	}
}

// endRound judges the round that just completed at limit and starts the next.
// Without a baseline the limit holds, since there is nothing to judge
// against, unless the round broke MaxHealthy. With probes, the next may be a
// probe.
func (c *Controller) endRound(now time.Time, limit int) {
	constrained := c.constrained.Swap(false)
	fastest := c.fastest
	c.calls, c.fastest = 0, maxLatency
	// Rounds before the first probe are the start's (demand ramping up,
	// connections opening): they say little of how long rounds take, and
	// one slow one would hold the first probe, whose length follows the
	// period, down for a third of a long period.
	if p := c.probe; p != nil && !c.began.IsZero() && !p.end.IsZero() {
		p.roundTook(now.Sub(c.began))
	}
	c.began = now

	baseline, ok := c.judgeBaseline(now)
	if ok {
		c.baseline.Store(int64(baseline))
	} else {
		c.baseline.Store(noBaseline)
		baseline = maxLatency // nothing to judge against: never a queue, never growth
		constrained = false
	}
	next := c.opts.next(limit, fastest, baseline, constrained)
	// A probe does not start at the end of a round that showed a queue:
	// the limit is coming down, and that is what rounds are for. At the
	// floor it lowers nothing, but it still holds the limit there while
	// other callers' probes may drain the dependency, and measures.
	if p := c.probe; ok && p != nil && p.due(now, next, &c.opts) && next >= limit {
		c.restore.Store(int64(next))
		c.set(limit, p.begin(now, next, baseline, &c.opts))
		return
	}
	c.set(limit, next)
}

// judgeBaseline is what a round ending at now is judged against: a fixed
// Baseline; else, with probes, the 10th percentile of the calls of the
// last probes that found the dependency without a queue; before the first,
// the window's 10th percentile, as specified.
func (c *Controller) judgeBaseline(now time.Time) (time.Duration, bool) {
	if c.opts.Baseline > 0 {
		c.source = Fixed
		return c.opts.Baseline, true
	}
	if c.probe != nil {
		if b, ok := c.probe.baseline(); ok {
			c.source = FromProbes
			return b, true
		}
	}
	b, ok := c.window.baseline()
	c.source = FromWindow
	if !ok {
		c.source = NoSource
	}
	return b, ok
}

// endProbe ends the probe at now: no round is judged on it; the limit it
// held down is restored, and the next round starts afresh, refusals during
// the probe forgotten, since they said nothing about the restored limit.
func (c *Controller) endProbe(now time.Time) {
	held := c.probe.finish(now, &c.opts)
	c.probes++
	c.began = now
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
	case o.MaxHealthy > 0 && fastest > o.MaxHealthy:
		return o.decrease(limit)
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
