package verdict

import (
	"fmt"
	"time"
)

const (
	durationBits = 56
	durationMask = 1<<durationBits - 1

	// MaxAttemptDuration is the longest attempt duration (and delay) an
	// Attempt holds (about 833 days); longer ones saturate.
	MaxAttemptDuration = time.Duration(durationMask)
)

// Attempt is one entry of an attempt log: the verdict the attempt came to,
// how long it took, and the delay that followed it before the next attempt.
//
// It packs the verdict's kind byte - kind and SelfImposed bit - into the top
// eight bits of the duration field, so a reader of the log can tell a limiter
// this process runs from a 429 the dependency sent, at no extra cost. The
// top eight bits of the delay field say, as freely, how the attempt took
// part in hedging: whether it was a hedge, whether it lost to another
// attempt, and why a hedge that came due while it ran was not sent.
type Attempt struct {
	// packed: kind byte << 56 | duration in nanoseconds.
	packed uint64
	// hedging byte << 56 | delay after this attempt in nanoseconds (0 when
	// none followed).
	delay uint64
	// retryAfter is the verdict's biased RetryAfter.
	retryAfter int64
}

// The hedging byte: two flags and a Suppression in the low bits.
const (
	hedgeBit        = 0x80
	lostBit         = 0x40
	suppressionMask = 0x3f
)

// NewAttempt records an attempt. Negative durations are stored as zero, and
// a duration or delay beyond MaxAttemptDuration saturates.
func NewAttempt(v Verdict, duration, delay time.Duration) Attempt {
	duration = min(max(duration, 0), MaxAttemptDuration)
	delay = min(max(delay, 0), MaxAttemptDuration)
	return Attempt{
		packed:     uint64(v.packed)<<durationBits | uint64(duration),
		delay:      uint64(delay),
		retryAfter: v.retryAfter,
	}
}

// Verdict returns the attempt's verdict, RetryAfter included.
func (a Attempt) Verdict() Verdict {
	return Verdict{packed: uint8(a.packed >> durationBits), retryAfter: a.retryAfter}
}

// Kind returns the kind of the attempt's verdict.
func (a Attempt) Kind() Kind { return a.Verdict().Kind() }

// SelfImposed reports whether the attempt was refused by this process.
func (a Attempt) SelfImposed() bool { return a.Verdict().SelfImposed() }

// Duration returns how long the attempt took.
func (a Attempt) Duration() time.Duration { return time.Duration(a.packed & durationMask) }

// Delay returns the delay that followed the attempt; zero for the last one.
// Of the attempts of one round - a first attempt and the hedges sent while
// it ran - only the last in the log carries the delay before the next
// round.
func (a Attempt) Delay() time.Duration { return time.Duration(a.delay & durationMask) }

// Hedge reports whether the attempt was a hedge: a copy started while an
// earlier attempt of the same round was still running.
func (a Attempt) Hedge() bool { return a.hedging()&hedgeBit != 0 }

// Lost reports whether another attempt of the attempt's round answered
// first, so that this one was cancelled and its answer, if any, was not
// used. A lost attempt's verdict is Permanent: it is no evidence either way.
func (a Attempt) Lost() bool { return a.hedging()&lostBit != 0 }

// Suppressed says why a hedge that came due while this attempt ran was not
// sent; SuppressedNone when none was held back.
func (a Attempt) Suppressed() Suppression { return Suppression(a.hedging() & suppressionMask) }

// AsHedge returns a marked as a hedge.
func (a Attempt) AsHedge() Attempt { a.delay |= hedgeBit << durationBits; return a }

// AsLost returns a marked as having lost to another attempt of its round.
func (a Attempt) AsLost() Attempt { a.delay |= lostBit << durationBits; return a }

// WithSuppressed returns a noting that a hedge due while it ran was held
// back for s.
func (a Attempt) WithSuppressed(s Suppression) Attempt {
	a.delay = a.delay&^(suppressionMask<<durationBits) | uint64(s&suppressionMask)<<durationBits
	return a
}

func (a Attempt) hedging() uint8 { return uint8(a.delay >> durationBits) }

// String formats the attempt for logs.
func (a Attempt) String() string {
	s := fmt.Sprintf("%v in %v, then %v", a.Verdict(), a.Duration(), a.Delay())
	if a.Hedge() {
		s = "hedge: " + s
	}
	if a.Lost() {
		s += " (lost)"
	}
	if w := a.Suppressed(); w != SuppressedNone {
		s += " (hedge suppressed: " + w.String() + ")"
	}
	return s
}

//go:generate go tool stringer -type=Suppression -linecomment

// Suppression is why a hedge that came due was not sent. The executor's
// hedge gate decides it; see package sdk's Hedge. Its String is the label
// value metrics use.
type Suppression uint8

const (
	// SuppressedNone: no hedge was held back.
	SuppressedNone Suppression = iota // none
	// SuppressedCriticality: the work is below Critical; nobody is waiting
	// for it, so no copy of it is raced.
	SuppressedCriticality // criticality
	// SuppressedBreaker: the circuit breaker was not closed.
	SuppressedBreaker // breaker
	// SuppressedRefused: an attempt of the round had been refused by this
	// process or host; the dependency was not even asked, and a copy would
	// only ask the same limit again.
	SuppressedRefused // refused
	// SuppressedBudget: the retry budget was down to half its capacity;
	// hedges, like retries of work below Critical, may not take the rest.
	SuppressedBudget // budget
	// SuppressedAttempts: the call had made as many attempts as its policy
	// allows, hedges included.
	SuppressedAttempts // attempts

	suppressionLen = iota // sentinel, untyped for stringer; keep last.
)

// Valid reports whether s is one of the reasons (SuppressedNone included),
// so that an adapter can range over them.
func (s Suppression) Valid() bool { return s < suppressionLen }
