package limit

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/egressd/egressd/pkg/adaptive"
)

const (
	// MaxRate is the largest PerSecond Permits and Burst: one permit per
	// nanosecond, the resolution of the token arithmetic (permits are
	// counted in billionths in 64 bits). The kernel's bound is lower.
	MaxRate = 1_000_000_000
	// DefaultSegments is how many segments a window slides in when
	// PerWindowOptions.Segments is zero.
	DefaultSegments = 8
	// MaxSegments is the most segments a window may have, as in the kernel.
	MaxSegments = 32
	// MinSegment is the shortest segment a window may have, as in the
	// kernel: Window / Segments must be at least this.
	MinSegment = time.Millisecond
)

// PerSecondOptions is a token bucket.
type PerSecondOptions struct {
	// Permits is the refill rate, per second, from 1 to MaxRate.
	Permits int
	// Burst is the bucket's size: how many permits may be taken at once
	// after a quiet spell. Zero means one second's worth (Permits).
	Burst int
}

// PerWindowOptions is a sliding window.
type PerWindowOptions struct {
	// Permits is the most acquires in any Window.
	Permits int
	// Window is the length of the window.
	Window time.Duration
	// Segments is how many parts the window slides in (zero means 8): a
	// permit counts until the segment it was taken in leaves the window,
	// so more segments slide more smoothly. Window / Segments is the
	// segment length, at least MinSegment.
	Segments int
}

//go:generate go tool stringer -type=QueueOrder -linecomment

// QueueOrder is the order queued callers get permits in.
type QueueOrder uint8

const (
	// OldestFirst serves the queue in arrival order, and refuses a caller
	// that finds it full. The default.
	OldestFirst QueueOrder = iota // oldest first
	// NewestFirst serves the most recent caller first, and a caller that
	// finds the queue full takes the place of the oldest, which is refused:
	// under overload the callers most likely still to be waited for are
	// served.
	NewestFirst // newest first

	queueOrderLen = iota // sentinel, untyped for stringer; keep last.
)

// Options configure a [Local] limiter. Set exactly one shape: PerSecond,
// PerWindow, Concurrency or Adaptive. A section that sets two was written by
// someone who expected one to win, and none does: [Options.Validate] refuses
// it.
type Options struct {
	// Name says which limiter refused, in a *verdict.RateLimitedError and in
	// metrics. Empty means the shape's name: "perSecond", "perWindow",
	// "concurrency" or "adaptive".
	Name string

	// PerSecond, if set, makes a token bucket.
	PerSecond *PerSecondOptions
	// PerWindow, if set, makes a sliding window.
	PerWindow *PerWindowOptions
	// Concurrency, if not zero, bounds the leases held at once.
	Concurrency int
	// Adaptive, if set, makes a concurrency limit that package adaptive
	// moves between its Minimum and Maximum. Its presence turns it on:
	// &adaptive.Options{} takes every default. Its OnChange, if any, is
	// still called, from a Release; it must not panic, but if it does,
	// the panic reaches that Release, whose permit is freed all the same.
	Adaptive *adaptive.Options

	// QueueLimit is how many callers may wait for a permit. Zero, the
	// default, refuses at once. A waiting Acquire is bounded by its
	// context, so raise the attempt timeout to cover the wait: time spent
	// queued is indistinguishable from a slow dependency to a policy.
	QueueLimit int
	// QueueOrder is the order waiting callers are served in.
	QueueOrder QueueOrder

	// Observer, if set, is told about every acquire (see [Observer]).
	Observer Observer
}

// shapes returns the names of the shapes o sets.
func (o *Options) shapes() []string {
	var set []string
	if o.PerSecond != nil {
		set = append(set, "PerSecond")
	}
	if o.PerWindow != nil {
		set = append(set, "PerWindow")
	}
	if o.Concurrency != 0 {
		set = append(set, "Concurrency")
	}
	if o.Adaptive != nil {
		set = append(set, "Adaptive")
	}
	return set
}

// Validate reports every problem with o at once, as an [*OptionsError]: no
// shape or more than one, and every bad value of every shape that is set.
func (o *Options) Validate() error {
	if o == nil {
		return &OptionsError{Problems: []string{noShape}}
	}
	var problems []string
	add := func(format string, args ...any) { problems = append(problems, fmt.Sprintf(format, args...)) }

	switch set := o.shapes(); len(set) {
	case 0:
		add(noShape)
	case 1:
	default:
		add("%s are set: set exactly one shape", and(set))
	}
	if p := o.PerSecond; p != nil {
		if p.Permits < 1 || p.Permits > MaxRate {
			add("PerSecond.Permits %d must lie between 1 and %d", p.Permits, MaxRate)
		}
		if p.Burst != 0 && (p.Burst < 1 || p.Burst > MaxRate) {
			add("PerSecond.Burst %d must lie between 1 and %d (0 means Permits)", p.Burst, MaxRate)
		}
	}
	if p := o.PerWindow; p != nil {
		if p.Permits < 1 {
			add("PerWindow.Permits %d must be at least 1", p.Permits)
		}
		segments, segmentsOK := p.segments(), true
		if p.Segments != 0 && (p.Segments < 1 || p.Segments > MaxSegments) {
			add("PerWindow.Segments %d must lie between 1 and %d (0 means %d)", p.Segments, MaxSegments, DefaultSegments)
			segmentsOK = false
		}
		switch {
		case p.Window <= 0:
			add("PerWindow.Window %v must be positive", p.Window)
		case segmentsOK && p.Window/time.Duration(segments) < MinSegment:
			add("PerWindow.Window %v in %d segments makes segments shorter than %v", p.Window, segments, MinSegment)
		}
	}
	if o.Concurrency < 0 {
		add("Concurrency %d must be at least 1", o.Concurrency)
	}
	if o.Adaptive != nil {
		if err := o.Adaptive.Validate(); err != nil {
			ae, ok := errors.AsType[*adaptive.OptionsError](err)
			if !ok {
				ae = &adaptive.OptionsError{Problems: []string{err.Error()}}
			}
			// Each of adaptive's problems starts with its field's name.
			for _, p := range ae.Problems {
				add("Adaptive.%s", p)
			}
		}
	}
	if o.QueueLimit < 0 {
		add("QueueLimit %d must not be negative", o.QueueLimit)
	}
	if o.QueueOrder >= queueOrderLen {
		add("QueueOrder %d is neither OldestFirst nor NewestFirst", o.QueueOrder)
	}
	if len(problems) == 0 {
		return nil
	}
	return &OptionsError{Problems: problems}
}

const noShape = "no shape: set one of PerSecond, PerWindow, Concurrency or Adaptive"

// and joins names as "A and B" or "A, B and C".
func and(names []string) string {
	if len(names) < 2 {
		return strings.Join(names, "")
	}
	return strings.Join(names[:len(names)-1], ", ") + " and " + names[len(names)-1]
}

func (p *PerWindowOptions) segments() int {
	if p.Segments == 0 {
		return DefaultSegments
	}
	return p.Segments
}

func (p *PerSecondOptions) burst() int {
	if p.Burst == 0 {
		return p.Permits
	}
	return p.Burst
}
