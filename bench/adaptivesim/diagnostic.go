package main

import (
	"math"
	"time"

	"github.com/egressd/egressd/pkg/adaptive"
)

// pinnedRule is a diagnostic, not a peer and not a proposal: pkg/adaptive's
// round rule re-implemented line for line (a round is one limit's worth of
// completed calls; fastest > Multiple × baseline → ⌊limit × DecreaseFactor⌋,
// else +1 if the limit constrained the round; defaults throughout), judged
// against a baseline that cannot drift: the true 10th percentile of the
// service time, with no queueing in it. Set beside egressd's row, it
// separates what the decision rule does from what the measured baseline does.
type pinnedRule struct {
	baseline    time.Duration
	limit       int
	inflight    int
	constrained bool
	calls       int
	fastest     time.Duration
}

func newPinned(sc *Scenario) Controller {
	// The lognormal's 10th percentile: exp(μ + σ·z₀.₁), z₀.₁ = −1.2816.
	mu := math.Log(float64(sc.Mean)) - sc.Sigma*sc.Sigma/2
	return &pinnedRule{
		baseline: time.Duration(math.Exp(mu - 1.2816*sc.Sigma)),
		limit:    adaptive.DefaultInitial,
		fastest:  math.MaxInt64,
	}
}

func (p *pinnedRule) Acquire(time.Duration) (any, bool) {
	if p.inflight >= p.limit {
		p.constrained = true
		return nil, false
	}
	p.inflight++
	if p.inflight >= p.limit {
		p.constrained = true
	}
	return nil, true
}

func (p *pinnedRule) Done(_ time.Duration, _ any, latency time.Duration, failed bool) {
	p.inflight--
	if failed {
		return
	}
	p.fastest = min(p.fastest, latency)
	p.calls++
	if p.calls < p.limit {
		return
	}
	switch {
	case float64(p.fastest) > adaptive.DefaultMultiple*float64(p.baseline):
		p.limit = max(int(math.Floor(float64(p.limit)*adaptive.DefaultDecreaseFactor)), adaptive.DefaultMinimum)
	case p.constrained:
		p.limit = min(p.limit+1, adaptive.DefaultMaximum)
	}
	p.calls, p.fastest, p.constrained = 0, math.MaxInt64, false
}

func (p *pinnedRule) Limit() int { return p.limit }

// probeRule is a diagnostic of one possible fix, not pkg/adaptive: the same
// round rule, with the baseline measured only on calls that cannot have
// queued behind our own traffic. Every probeEvery rounds the limit is held
// for one round at half its value (never below Minimum); calls admitted
// while in-flight is under that half are the probe's, and once half a limit
// of them have completed, normal rounds resume. The baseline is the 10th
// percentile of the last five minutes of probe calls (of all calls until
// the first probe ends). If the limit is at most 2c, half of it queues
// nothing, so the probe measures the dependency rather than our queue in it
// — the idea of BBR's ProbeRTT and of the no-load probe in Netflix's Vegas.
type probeRule struct {
	pinnedRule
	probeEvery int

	rounds    int  // normal rounds since the last probe
	probing   bool // admitting probe calls
	probeLeft int  // probe calls still to complete
	probed    bool // a probe has completed: judge against probe calls only
	samples   []sample
}

type sample struct {
	at      time.Duration
	latency time.Duration
}

const probeEvery = 100

func newProbe(*Scenario) Controller {
	return &probeRule{
		pinnedRule: pinnedRule{limit: adaptive.DefaultInitial, fastest: math.MaxInt64},
		probeEvery: probeEvery,
	}
}

func (p *probeRule) Acquire(now time.Duration) (any, bool) {
	if !p.probing {
		_, ok := p.pinnedRule.Acquire(now)
		return false, ok
	}
	if p.inflight >= max(p.limit/2, adaptive.DefaultMinimum) {
		return nil, false
	}
	p.inflight++
	return true, true
}

func (p *probeRule) Done(now time.Duration, token any, latency time.Duration, failed bool) {
	if failed {
		p.inflight--
		return
	}
	if !p.probing {
		if !p.probed {
			p.samples = append(p.samples, sample{now, latency})
		}
		if p.calls+1 >= p.limit {
			p.refresh(now) // the round ends with this call
		}
		p.pinnedRule.Done(now, token, latency, failed)
		if p.calls == 0 {
			if p.rounds++; p.rounds >= p.probeEvery {
				p.probing, p.rounds = true, 0
				p.probeLeft = max(p.limit/2, adaptive.DefaultMinimum)
			}
		}
		return
	}
	p.inflight--
	if probe, _ := token.(bool); !probe {
		return
	}
	if !p.probed {
		p.probed, p.samples = true, p.samples[:0]
	}
	p.samples = append(p.samples, sample{now, latency})
	if p.probeLeft--; p.probeLeft == 0 {
		p.probing = false
		p.calls, p.fastest, p.constrained = 0, math.MaxInt64, false
		p.refresh(now)
	}
}

// refresh drops samples older than five minutes and recomputes the
// baseline from the rest.
func (p *probeRule) refresh(now time.Duration) {
	i := 0
	for i < len(p.samples) && p.samples[i].at < now-5*time.Minute {
		i++
	}
	p.samples = p.samples[i:]
	if len(p.samples) < 10 {
		p.baseline = math.MaxInt64 / 4 // no opinion yet: never decrease
		return
	}
	lat := make([]time.Duration, len(p.samples))
	for i, s := range p.samples {
		lat[i] = s.latency
	}
	p.baseline = percentile(sortedCopy(lat), 0.1)
}
