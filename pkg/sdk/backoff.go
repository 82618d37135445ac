package sdk

import (
	"math"
	"time"

	"github.com/egressd/egressd/pkg/verdict"
)

// Curve is one exponential backoff curve: the delay before retry n (n = 1
// for the first retry) is Initial × Multiplier^(n-1).
type Curve struct {
	Initial time.Duration
	// Multiplier is the growth per retry; values below 1 mean 1 (constant).
	Multiplier float64
}

// Backoff chooses the delay before a retry. Transient verdicts take the
// Transient curve, Throttled verdicts (refusals included) the longer
// Throttled curve. A RetryAfter on the verdict - from a server or a limiter -
// wins over the curve and is used verbatim, without jitter.
//
// Every delay is capped by MaxDelay, and the executor never starts a delay
// that would run past the deadline.
type Backoff struct {
	Transient Curve
	Throttled Curve
	// MaxDelay caps every delay, RetryAfter included; zero means no cap.
	MaxDelay time.Duration
	// Jitter in [0, 1] spreads curve delays downward: a delay d becomes a
	// uniform pick in (d × (1-Jitter), d]. Zero means none.
	Jitter float64
}

// delay returns the delay before retry n after an attempt that came to v.
// u is a uniform sample in [0, 1), used only for jitter.
func (b *Backoff) delay(v verdict.Verdict, n int, u float64) time.Duration {
	if d, ok := v.RetryAfter(); ok {
		return b.cap(d)
	}
	c := b.Transient
	if v.Kind() == verdict.Throttled {
		c = b.Throttled
	}
	d := b.cap(c.at(n))
	if j := min(max(b.Jitter, 0), 1); j > 0 {
		d -= time.Duration(float64(d) * j * u)
	}
	return d
}

func (b *Backoff) cap(d time.Duration) time.Duration {
	if b.MaxDelay > 0 && d > b.MaxDelay {
		return b.MaxDelay
	}
	return d
}

// at returns the curve's delay before retry n, saturating at the largest
// Duration instead of overflowing.
func (c Curve) at(n int) time.Duration {
	if c.Initial <= 0 {
		return 0
	}
	m := max(c.Multiplier, 1)
	f := float64(c.Initial) * math.Pow(m, float64(max(n, 1)-1))
	if f >= math.MaxInt64 {
		return math.MaxInt64
	}
	return time.Duration(f)
}
