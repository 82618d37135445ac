package limit

import "time"

// nsPerSec is one permit in the bucket's units: permits are counted in
// billionths, so that a nanosecond at a rate of r per second adds exactly r.
const nsPerSec = int64(time.Second)

// tokenBucket is the kernel's take_token in Go: the same integer arithmetic,
// so that the two agree to the nanosecond. It is not safe for concurrent use.
type tokenBucket struct {
	origin time.Time // instants are measured from here
	rate   int64     // permits per second: billionths added per nanosecond
	cap    int64     // burst × nsPerSec
	fill   int64     // nanoseconds an empty bucket takes to fill
	tokens int64     // billionths of a permit, at last
	last   int64     // nanoseconds since origin of the latest refill
}

// newTokenBucket returns a full bucket of burst permits refilled at rate per
// second, from origin on. 1 ≤ rate, burst ≤ MaxRate.
func newTokenBucket(origin time.Time, rate, burst int) tokenBucket {
	r, c := int64(rate), int64(burst)*nsPerSec
	return tokenBucket{origin: origin, rate: r, cap: c, fill: (c + r - 1) / r, tokens: c}
}

// take takes one permit at now and returns 0, or takes nothing and returns
// how long until the next permit. Time never goes backwards: an instant
// before the latest one seen (a goroutine that read the clock, then lost the
// race for the lock) refills nothing.
//
// A refill is capped at the bucket's fill time, which keeps elapsed × rate
// in 64 bits (the product is at most cap + rate); the kernel's take_token
// does the same.
func (b *tokenBucket) take(now time.Time) time.Duration {
	return b.takeAt(int64(now.Sub(b.origin)))
}

// takeAt is take at ns nanoseconds after origin: what a limiter calls, with
// a reading of the monotonic clock alone, which costs half of time.Now.
func (b *tokenBucket) takeAt(ns int64) time.Duration {
	elapsed := ns - b.last
	if elapsed <= 0 {
		elapsed = 0
	} else {
		b.last = ns
	}
	t := min(b.tokens+min(elapsed, b.fill)*b.rate, b.cap)
	if t >= nsPerSec {
		b.tokens = t - nsPerSec
		return 0
	}
	b.tokens = t
	return time.Duration((nsPerSec - t + b.rate - 1) / b.rate)
}

// refund puts back a permit that was taken but not used: one granted to a
// waiter whose context ended in the same instant.
func (b *tokenBucket) refund() {
	b.tokens = min(b.tokens+nsPerSec, b.cap)
}
