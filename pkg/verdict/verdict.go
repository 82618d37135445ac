// Package verdict is the vocabulary for what one attempt at a call came to.
//
// A Verdict is one of four kinds - OK, Transient, Throttled, Permanent - plus
// two facts that ride along for free: whether the refusal came from this
// process (SelfImposed) and the pushback the refuser gave (RetryAfter). A
// limiter refusal is not a fifth kind. Nothing was attempted, so it is
// Throttled - something is defending the dependency - with SelfImposed set;
// everything that handles throttling handles a refusal unchanged, and the
// retry budget reads the bit to leave it uncharged.
//
// The zero Verdict is OK, not self-imposed, with no RetryAfter. The polarity
// is deliberate: a default verdict claims to have reached the dependency, the
// conservative answer that keeps it subject to the retry budget.
//
// A Verdict is 16 bytes: the self-imposed bit shares the kind's byte, and
// RetryAfter is stored as nanoseconds biased by one, so that zero means "the
// refuser said nothing" while a RetryAfter of exactly zero ("retry now") stays
// representable. Attempt records pack the same byte into the top of a 64-bit
// duration field.
//
// A refusal's error form is [RateLimitedError], matched by [ErrRateLimited]:
// limiters return it, and an executor maps it to [Refused]. It lives here so
// that a limiter needs no more than this vocabulary; package sdk re-exports
// it under the same names.
//
// The package is pure: it imports nothing beyond the standard library.
package verdict

import (
	"math"
	"strings"
	"time"
)

//go:generate go tool stringer -type=Kind

// Kind is what an attempt came to. OK is the zero value.
type Kind uint8

const (
	// OK: the attempt produced an answer the caller accepts.
	OK Kind = iota
	// Transient: the dependency failed in a way that may pass; retry on the
	// transient curve, and count it as evidence against the dependency.
	Transient
	// Throttled: something is defending the dependency from load; retry on
	// the longer throttled curve, honouring RetryAfter. Not evidence.
	Throttled
	// Permanent: retrying will not help. Not evidence.
	Permanent

	kindLen = iota // sentinel: number of kinds, untyped for stringer; keep last.
)

// Valid reports whether k is one of the four kinds.
func (k Kind) Valid() bool { return k < kindLen }

const (
	// selfImposedBit is the top bit of the packed kind byte.
	selfImposedBit = 0x80
	kindMask       = 0x7f

	// maxBiased is the largest biased RetryAfter; RetryAfter saturates at
	// maxRetryAfter rather than overflowing.
	maxBiased     = math.MaxInt64
	maxRetryAfter = time.Duration(maxBiased - 1)
)

// NoRetryAfter passed where a RetryAfter is expected means "nothing said".
// Any negative duration means the same.
const NoRetryAfter time.Duration = -1

// Verdict is what one attempt came to. Compare verdicts with ==.
type Verdict struct {
	// retryAfter is the pushback in nanoseconds plus one; 0 means none.
	retryAfter int64
	// packed is the Kind in the low bits and SelfImposed in the top bit.
	packed uint8
}

// New returns a verdict of kind k with no RetryAfter that reached the
// dependency. It panics if k is not one of the four kinds.
func New(k Kind) Verdict {
	if !k.Valid() {
		panic("verdict: invalid kind " + k.String())
	}
	return Verdict{packed: uint8(k)}
}

// Refused returns Throttled with SelfImposed set: something in this process
// (a limiter, a concurrency bound, a lock, a load shedder) said no before the
// call left it. retryAfter is the refuser's hint, kept verbatim; zero means
// "retry now", and a negative value (NoRetryAfter) means no hint.
func Refused(retryAfter time.Duration) Verdict {
	return Verdict{packed: uint8(Throttled) | selfImposedBit}.WithRetryAfter(retryAfter)
}

// WithRetryAfter returns v carrying d as its RetryAfter. A negative d clears
// it. Durations beyond the representable range saturate.
func (v Verdict) WithRetryAfter(d time.Duration) Verdict {
	v.retryAfter = bias(d)
	return v
}

// Kind returns the verdict's kind.
func (v Verdict) Kind() Kind { return Kind(v.packed & kindMask) }

// SelfImposed reports whether this process refused the attempt before it
// reached the dependency. Only refusals set it; it is false on the zero value.
func (v Verdict) SelfImposed() bool { return v.packed&selfImposedBit != 0 }

// RetryAfter returns the refuser's hint and whether one was given. A hint of
// exactly zero means "retry now".
func (v Verdict) RetryAfter() (time.Duration, bool) { return unbias(v.retryAfter) }

// String formats the verdict as "Kind" or "Kind(self-imposed, retry after d)".
func (v Verdict) String() string {
	d, hasHint := v.RetryAfter()
	if !v.SelfImposed() && !hasHint {
		return v.Kind().String()
	}
	var b strings.Builder
	b.WriteString(v.Kind().String())
	b.WriteByte('(')
	if v.SelfImposed() {
		b.WriteString("self-imposed")
		if hasHint {
			b.WriteString(", ")
		}
	}
	if hasHint {
		b.WriteString("retry after ")
		b.WriteString(d.String())
	}
	b.WriteByte(')')
	return b.String()
}

func bias(d time.Duration) int64 {
	switch {
	case d < 0:
		return 0
	case d >= maxRetryAfter:
		return maxBiased
	default:
		return int64(d) + 1
	}
}

func unbias(b int64) (time.Duration, bool) {
	if b == 0 {
		return 0, false
	}
	return time.Duration(b - 1), true
}
