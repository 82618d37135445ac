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
