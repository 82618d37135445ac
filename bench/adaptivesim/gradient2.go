package main

import "time"

// gradient2 is Netflix's Gradient2 concurrency limit, written in Go from its
// published description. The description used is the documentation of
// Gradient2Limit and of its builder, and the comments stating each of its
// rules, in Netflix/concurrency-limits (concurrency-limits-core, package
// com.netflix.concurrency.limits.limit), with the background in Netflix's
// technology blog post "Performance Under Load" (2018):
//
//	The core algorithm re-calculates the limit every sampling window
//	(ex. 1 second) using the formula
//	  // Calculate the gradient limiting to the range [0.5, 1.0] to filter outliers
//	  gradient = max(0.5, min(1.0, longtermRtt / currentRtt));
//	  // Calculate the new limit by applying the gradient and allowing for some queuing
//	  newLimit = gradient * currentLimit + queueSize;
//	  // Update the limit using a smoothing factor (default 0.2)
//	  newLimit = currentLimit * (1-smoothing) + newLimit * smoothing
//
// with the long-term RTT an exponential average of the measurements (a
// 600-measurement window, the first 10 a plain average, "kept stable yet
// allowed to adapt to long term changes"), cut back by 10% whenever it is
// more than twice the current RTT so that it comes back down after a spell
// of load; no change while the limiter is app-limited (in-flight below half
// the limit); and the documented builder defaults queueSize 4, smoothing 0.2,
// initial 20, minimum 20, maximum 200 (the bounds are replaced here by the
// shared guardrails, see minLimit).
//
// The same documentation leaves open what a "measurement" is. The library's
// limit is called with every sample, which is how a limiter uses it unless
// it is wrapped in the windowing decorator; the formula above speaks of a
// sampling window. window selects: zero updates on every sample, with that
// call's RTT as the current RTT; otherwise the limit is recomputed on the
// first sample after each window of at least that length holding at least
// ten samples, with their average RTT and the most calls in flight any of
// them saw.
type gradient2 struct {
	window time.Duration

	limit float64 // the estimate; the limit in force is its integer part
	long  expAvg  // long-term RTT, nanoseconds

	inflight int

	// current window
	next        time.Duration
	sum         float64
	n           int
	maxInflight int
}

const (
	g2QueueSize  = 4
	g2Smoothing  = 0.2
	g2LongWindow = 600
	g2Warmup     = 10
	g2MinSamples = 10
)

func newGradient2(window time.Duration) Controller {
	return &gradient2{
		window: window,
		limit:  initialLimit,
		long:   expAvg{window: g2LongWindow, warmup: g2Warmup},
	}
}

type g2Token struct{ inflight int }

func (g *gradient2) Acquire(time.Duration) (any, bool) {
	if g.inflight >= g.Limit() {
		return nil, false
	}
	g.inflight++
	// The in-flight count a measurement reports is the one its call saw when
	// it was admitted, itself included.
	return g2Token{g.inflight}, true
}

func (g *gradient2) Done(now time.Duration, token any, latency time.Duration, failed bool) {
	g.inflight--
	if failed {
		return // Gradient2 reads only RTTs; a drop carries none
	}
	inflight := token.(g2Token).inflight
	if g.window == 0 {
		g.update(float64(latency), inflight)
		return
	}
	g.sum += float64(latency)
	g.n++
	g.maxInflight = max(g.maxInflight, inflight)
	if now < g.next {
		return
	}
	g.next = now + g.window
	if g.n >= g2MinSamples {
		g.update(g.sum/float64(g.n), g.maxInflight)
	}
	g.sum, g.n, g.maxInflight = 0, 0, 0
}

func (g *gradient2) update(rtt float64, inflight int) {
	long := g.long.add(rtt)
	if long/rtt > 2 {
		g.long.value *= 0.9
	}
	if float64(inflight) < g.limit/2 {
		return // app-limited: the measurement says nothing about the limit
	}
	gradient := max(0.5, min(1, long/rtt))
	next := g.limit*gradient + g2QueueSize
	next = g.limit*(1-g2Smoothing) + next*g2Smoothing
	g.limit = max(minLimit, min(maxLimit, next))
}

func (g *gradient2) Limit() int { return int(g.limit) }

// expAvg is an exponential moving average over window measurements whose
// first warmup measurements are averaged plainly.
type expAvg struct {
	window, warmup int
	count          int
	sum, value     float64
}

func (e *expAvg) add(v float64) float64 {
	if e.count < e.warmup {
		e.count++
		e.sum += v
		e.value = e.sum / float64(e.count)
		return e.value
	}
	f := 2 / float64(e.window+1)
	e.value = e.value*(1-f) + v*f
	return e.value
}
