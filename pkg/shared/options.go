package shared

import (
	"fmt"
	"strings"
	"time"

	"github.com/egressd/egressd/pkg/limit"
)

const (
	// MaxSegments is the most segments a sliding window may have.
	MaxSegments = 1000
	// MinSegment is the shortest segment a sliding window may have, and the
	// shortest window and replenishment period.
	MinSegment = time.Millisecond
	// MinLeaseDuration is the shortest concurrency LeaseDuration.
	MinLeaseDuration = 30 * time.Millisecond
	// DefaultLeaseDuration is LeaseDuration when it is zero.
	DefaultLeaseDuration = 30 * time.Second
	// DefaultQueuePollInterval is QueuePollInterval when it is zero.
	DefaultQueuePollInterval = 50 * time.Millisecond
	// DefaultMaxRetries is MaxRetries when it is zero.
	DefaultMaxRetries = 8
	// DefaultStoreCooldown is StoreCooldown when it is zero.
	DefaultStoreCooldown = time.Second
	// NoCooldown is the StoreCooldown that asks Redis on every call.
	NoCooldown = -1
	// NoRetries is the MaxRetries that retries nothing.
	NoRetries = -1
)

// FixedWindowOptions is a fixed window.
type FixedWindowOptions struct {
	// Permits is the most acquires in one window, at least 1.
	Permits int
	// Window is the window's length, at least MinSegment; windows are
	// aligned to the server's clock (multiples of Window since the epoch).
	Window time.Duration
}

// SlidingWindowOptions is a segmented sliding window.
type SlidingWindowOptions struct {
	// Permits is the most acquires in any window, at least 1.
	Permits int
	// Window is the window's length.
	Window time.Duration
	// Segments is how many parts the window slides in, 1..MaxSegments;
	// Window / Segments must be at least MinSegment.
	Segments int
}

// TokenBucketOptions is a token bucket.
type TokenBucketOptions struct {
	// TokenLimit is the bucket's size, at least 1; a new bucket is full.
	TokenLimit int
	// TokensPerPeriod is added for each whole ReplenishmentPeriod, at
	// least 1, up to TokenLimit.
	TokensPerPeriod int
	// ReplenishmentPeriod is at least MinSegment.
	ReplenishmentPeriod time.Duration
}

// ConcurrencyOptions is a bound on leases held at once.
type ConcurrencyOptions struct {
	// Permits is the most leases held at once, across every process, at
	// least 1.
	Permits int
	// LeaseDuration is how long a lease outlives its holder's last renewal:
	// at least MinLeaseDuration; zero means DefaultLeaseDuration. The
	// holder renews every third of it.
	LeaseDuration time.Duration
	// Holders says that holders of [Slots] (egressd daemons, whose
	// kernels enforce their slots where Redis cannot see) share the key.
	// An Acquire that finds the budget's epoch missing then makes it as a
	// holder that never held slots would, by Durability: after Redis lost
	// the state, a Limiter must not take the slots those kernels still
	// use before their holders come back to freeze the budget. Without
	// Holders the epoch is left to holders, and a budget Redis has no
	// record of admits at once: a key of Limiters alone is never frozen,
	// its first use included.
	Holders bool
	// Durability is the holders' [SlotsOptions.Durability]; it matters
	// only with Holders. Ephemeral (the default) freezes a budget with no
	// epoch for LeaseDuration, its first use too, refusing every Acquire
	// until then; Persistent takes it for new and admits at once.
	Durability Durability
}

//go:generate go tool stringer -type=FailureMode -linecomment

// FailureMode is what Acquire does when Redis gives no decision.
type FailureMode uint8

const (
	// Throw returns a *StoreError. The default.
	Throw FailureMode = iota // throw
	// Allow grants a lease and records nothing: the limit is lifted while
	// Redis is unreachable.
	Allow // allow
	// Deny refuses, with an *sdk.RateLimitedError wrapping the
	// *StoreError. With a queue, a waiter keeps waiting (and polling)
	// through the outage: bound it with its context.
	Deny // deny

	failureModeLen = iota // sentinel, untyped for stringer; keep last.
)

// Options configure a shared [Limiter]. Set Key and exactly one shape.
// Settings are copied by [New]; every process sharing Key must use the same
// shape and settings.
type Options struct {
	// Key is the Redis key of the budget's state. Required.
	Key string
	// Name says which limiter refused, in a *sdk.RateLimitedError and in
	// a *StoreError. Empty means Key.
	Name string

	FixedWindow   *FixedWindowOptions
	SlidingWindow *SlidingWindowOptions
	TokenBucket   *TokenBucketOptions
	Concurrency   *ConcurrencyOptions

	// QueueLimit is how many permits may wait in this process. Zero, the
	// default, refuses at once.
	QueueLimit int
	// QueueOrder is the order waiting callers are served in, as in
	// package limit: NewestFirst refuses the oldest waiter to make room.
	QueueOrder limit.QueueOrder
	// QueuePollInterval is how often the first waiter asks Redis again when
	// a refusal gave no RetryAfter (concurrency, or Deny through an outage):
	// at least a millisecond; zero means DefaultQueuePollInterval.
	QueuePollInterval time.Duration

	// FailureMode is what Acquire does when Redis gives no decision.
	FailureMode FailureMode
	// MaxRetries is how many more times a retryable Redis reply (LOADING,
	// BUSY, TRYAGAIN, MASTERDOWN, CLUSTERDOWN) is retried, with jittered
	// backoff. Zero means DefaultMaxRetries; NoRetries retries none.
	MaxRetries int
	// StoreCooldown is how long, after Redis failed to give a decision,
	// Acquire applies the FailureMode at once instead of asking again:
	// a dead or hung Redis then costs one timeout per cooldown, not one
	// per call. After it, one call asks (the others still do not) and its
	// answer reopens the way. Zero means DefaultStoreCooldown; NoCooldown
	// asks on every call.
	StoreCooldown time.Duration
}

func (o *Options) shapes() []string {
	var set []string
	if o.FixedWindow != nil {
		set = append(set, "FixedWindow")
	}
	if o.SlidingWindow != nil {
		set = append(set, "SlidingWindow")
	}
	if o.TokenBucket != nil {
		set = append(set, "TokenBucket")
	}
	if o.Concurrency != nil {
		set = append(set, "Concurrency")
	}
	return set
}

const noShape = "no shape: set one of FixedWindow, SlidingWindow, TokenBucket or Concurrency"

// Validate reports every problem with o at once, as an [*OptionsError].
func (o *Options) Validate() error {
	if o == nil {
		return &OptionsError{Problems: []string{"Key is required", noShape}}
	}
	var problems []string
	add := func(format string, args ...any) { problems = append(problems, fmt.Sprintf(format, args...)) }

	if o.Key == "" {
		add("Key is required")
	}
	switch set := o.shapes(); len(set) {
	case 0:
		add(noShape)
	case 1:
	default:
		add("%s are set: set exactly one shape", and(set))
	}
	if p := o.FixedWindow; p != nil {
		if p.Permits < 1 {
			add("FixedWindow.Permits %d must be at least 1", p.Permits)
		}
		if p.Window < MinSegment {
			add("FixedWindow.Window %v must be at least %v", p.Window, MinSegment)
		}
	}
	if p := o.SlidingWindow; p != nil {
		if p.Permits < 1 {
			add("SlidingWindow.Permits %d must be at least 1", p.Permits)
		}
		segmentsOK := p.Segments >= 1 && p.Segments <= MaxSegments
		if !segmentsOK {
			add("SlidingWindow.Segments %d must lie between 1 and %d", p.Segments, MaxSegments)
		}
		switch {
		case p.Window <= 0:
			add("SlidingWindow.Window %v must be positive", p.Window)
		case segmentsOK && p.Window/time.Duration(p.Segments) < MinSegment:
			add("SlidingWindow.Window %v in %d segments makes segments shorter than %v", p.Window, p.Segments, MinSegment)
		}
	}
	if p := o.TokenBucket; p != nil {
		if p.TokenLimit < 1 {
			add("TokenBucket.TokenLimit %d must be at least 1", p.TokenLimit)
		}
		if p.TokensPerPeriod < 1 {
			add("TokenBucket.TokensPerPeriod %d must be at least 1", p.TokensPerPeriod)
		}
		if p.ReplenishmentPeriod < MinSegment {
			add("TokenBucket.ReplenishmentPeriod %v must be at least %v", p.ReplenishmentPeriod, MinSegment)
		}
	}
	if p := o.Concurrency; p != nil {
		if p.Permits < 1 {
			add("Concurrency.Permits %d must be at least 1", p.Permits)
		}
		if p.LeaseDuration != 0 && p.LeaseDuration < MinLeaseDuration {
			add("Concurrency.LeaseDuration %v must be at least %v (0 means %v)", p.LeaseDuration, MinLeaseDuration, DefaultLeaseDuration)
		}
		if p.Durability >= durabilityLen {
			add("Concurrency.Durability %d is neither Ephemeral nor Persistent", p.Durability)
		}
	}
	if o.QueueLimit < 0 {
		add("QueueLimit %d must not be negative", o.QueueLimit)
	}
	if o.QueueOrder != limit.OldestFirst && o.QueueOrder != limit.NewestFirst {
		add("QueueOrder %d is neither OldestFirst nor NewestFirst", o.QueueOrder)
	}
	if o.QueuePollInterval != 0 && o.QueuePollInterval < time.Millisecond {
		add("QueuePollInterval %v must be at least 1ms (0 means %v)", o.QueuePollInterval, DefaultQueuePollInterval)
	}
	if o.FailureMode >= failureModeLen {
		add("FailureMode %d is none of Throw, Allow or Deny", o.FailureMode)
	}
	if o.StoreCooldown < NoCooldown {
		add("StoreCooldown %v must not be negative but NoCooldown (%d)", o.StoreCooldown, NoCooldown)
	}
	if o.MaxRetries < NoRetries {
		add("MaxRetries %d must be at least 1, 0 (%d) or NoRetries (%d)", o.MaxRetries, DefaultMaxRetries, NoRetries)
	}
	if len(problems) == 0 {
		return nil
	}
	return &OptionsError{Problems: problems}
}

// and joins names as "A and B" or "A, B and C".
func and(names []string) string {
	if len(names) < 2 {
		return strings.Join(names, "")
	}
	return strings.Join(names[:len(names)-1], ", ") + " and " + names[len(names)-1]
}
