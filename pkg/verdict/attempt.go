package verdict

import (
	"fmt"
	"time"
)

const (
	durationBits = 56
	durationMask = 1<<durationBits - 1

	// MaxAttemptDuration is the longest attempt duration an Attempt holds
	// (about 833 days); longer ones saturate.
	MaxAttemptDuration = time.Duration(durationMask)
)

// Attempt is one entry of an attempt log: the verdict the attempt came to,
// how long it took, and the delay that followed it before the next attempt.
//
// It packs the verdict's kind byte - kind and SelfImposed bit - into the top
// eight bits of the duration field, so a reader of the log can tell a limiter
// this process runs from a 429 the dependency sent, at no extra cost.
type Attempt struct {
	// packed: kind byte << 56 | duration in nanoseconds.
	packed uint64
	// delay after this attempt, nanoseconds; 0 when none followed.
	delay int64
	// retryAfter is the verdict's biased RetryAfter.
	retryAfter int64
}

// NewAttempt records an attempt. Negative durations are stored as zero, and
// a duration beyond MaxAttemptDuration saturates.
func NewAttempt(v Verdict, duration, delay time.Duration) Attempt {
	duration = min(max(duration, 0), MaxAttemptDuration)
	return Attempt{
		packed:     uint64(v.packed)<<durationBits | uint64(duration),
		delay:      int64(max(delay, 0)),
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
func (a Attempt) Delay() time.Duration { return time.Duration(a.delay) }

// String formats the attempt for logs.
func (a Attempt) String() string {
	return fmt.Sprintf("%v in %v, then %v", a.Verdict(), a.Duration(), a.Delay())
}
