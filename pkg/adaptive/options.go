package adaptive

import (
	"fmt"
	"math"
	"time"
)

// Defaults for the zero value of each [Options] field. Every valid value of
// every field is non-zero, so zero can mean "default" without hiding a choice.
const (
	DefaultMinimum        = 4
	DefaultMaximum        = 200
	DefaultInitial        = 20
	DefaultMultiple       = 2.0
	DefaultDecreaseFactor = 0.9
	DefaultProbeEvery     = 100
	DefaultProbeFactor    = 0.5

	// NoProbes is the ProbeEvery that turns drain probes off: the loop as
	// the reference specifies it, judged against the 10th percentile of
	// every call of the last five minutes. A policy file writes it as
	// probeEvery: 0.
	NoProbes = -1

	// ProbeJitter is how far from the start of its window, as a fraction
	// of the probe period, a probe may begin, drawn at random for each
	// probe so that hosts calling one dependency do not begin in lockstep.
	ProbeJitter = 0.15
)

// Options bound and tune a [Controller]. The zero value is a complete
// configuration: every zero-valued field takes its default.
type Options struct {
	// Minimum is the floor (default 4). It is a liveness guarantee: without
	// one, a dependency that is slow for reasons unrelated to our concurrency
	// drives the limit to zero and its recovery is never sampled.
	Minimum int

	// Maximum is the ceiling (default 200), and the one worth setting per
	// destination: it bounds the damage when the measurement is wrong.
	Maximum int

	// Initial is where the limit starts and holds until there is a baseline
	// to judge against (default 20).
	Initial int

	// Multiple is how many times the baseline latency counts as queueing
	// (default 2.0).
	Multiple float64

	// DecreaseFactor multiplies the limit when a round shows queueing
	// (default 0.9).
	DecreaseFactor float64

	// ProbeEvery is the period of drain probes in rounds (default 100), a
	// round counted as long as rounds lately take (Multiple × baseline
	// before one was timed) and the period rounded up to a power of two
	// and capped at five minutes, however many rounds that is, or NoProbes
	// for none: the reference loop exactly,
	// judged against the 10th percentile of every call of the last five
	// minutes, which learns the standing queue the loop itself settles
	// with, so that under sustained demand above capacity the limit climbs
	// to Maximum and stops following the dependency (see the package
	// documentation). A fixed Baseline turns probes off too, since there is
	// nothing to learn. Must be at least 1, or NoProbes.
	ProbeEvery int

	// ProbeFactor is what the limit is multiplied by, rounded up and never
	// below Minimum, for the length of a probe (default 0.5). Half the limit
	// admits calls into an empty queue whenever the limit is at most twice
	// what the dependency serves at once, which is where the loop settles.
	// Must lie strictly between 0 and 1; it is not checked when there are
	// no probes.
	ProbeFactor float64

	// ProbeSeed seeds the draw of where in its window each probe begins.
	// Zero, the default, draws a seed at random, which is what keeps hosts
	// from beginning in lockstep; set it for runs that must repeat exactly
	// (tests, simulations).
	ProbeSeed uint64

	// MaxHealthy, if set, is the slowest a round's fastest call may be: a
	// round whose fastest call took longer decreases the limit whatever the
	// baseline says, also before there is one. It guards against a baseline
	// learned while the dependency was already slow. Must not be negative.
	MaxHealthy time.Duration

	// Baseline, if set, is the latency of a fast call, fixed, for a
	// dependency whose normal latency is known: rounds are judged against
	// it instead of a measured one, and there are no probes. Must not be
	// negative.
	Baseline time.Duration

	// OnChange, if set, is called with the old and the new limit every time
	// the limit in force moves, a probe's start and end included, so that a
	// daemon can push it into a kernel map and record a metric. It is called
	// from [Controller.Sample] while the controller's lock is held, so calls
	// arrive one at a time and in the order the changes happened: a stale
	// limit never overwrites a newer one. It may call Limit, Baseline,
	// Probing and Constrained; calling Sample deadlocks.
	OnChange func(from, to int)
}

// withDefaults returns a copy of o with every zero-valued field set to its
// default; a nil o is all defaults.
func (o *Options) withDefaults() Options {
	var d Options
	if o != nil {
		d = *o
	}
	d.Minimum = or(d.Minimum, DefaultMinimum)
	d.Maximum = or(d.Maximum, DefaultMaximum)
	d.Initial = or(d.Initial, DefaultInitial)
	d.Multiple = or(d.Multiple, DefaultMultiple)
	d.DecreaseFactor = or(d.DecreaseFactor, DefaultDecreaseFactor)
	if d.ProbeEvery == 0 {
		d.ProbeEvery = DefaultProbeEvery
		if d.Baseline > 0 {
			d.ProbeEvery = NoProbes
		}
	}
	d.ProbeFactor = or(d.ProbeFactor, DefaultProbeFactor)
	return d
}

// Validate reports every problem with o at once, as an [*OptionsError], so
// that a policy file is fixed in one pass rather than one error per run. A nil
// o is valid.
func (o *Options) Validate() error {
	var set Options
	if o != nil {
		set = *o
	}
	d := set.withDefaults()
	minimum := describe("Minimum", set.Minimum, d.Minimum)
	maximum := describe("Maximum", set.Maximum, d.Maximum)
	initial := describe("Initial", set.Initial, d.Initial)

	var problems []string
	if d.Minimum < 1 {
		problems = append(problems, minimum+" must be at least 1")
	}
	if d.Maximum < d.Minimum {
		problems = append(problems, maximum+" must be at least "+minimum)
	}
	if d.Initial < d.Minimum || d.Initial > d.Maximum {
		problems = append(problems, initial+" must lie between "+minimum+" and "+maximum)
	}
	if !(d.Multiple > 1) || math.IsInf(d.Multiple, 1) {
		problems = append(problems, describe("Multiple", set.Multiple, d.Multiple)+" must be a finite number above 1")
	}
	if !(d.DecreaseFactor > 0 && d.DecreaseFactor < 1) {
		problems = append(problems, describe("DecreaseFactor", set.DecreaseFactor, d.DecreaseFactor)+" must lie strictly between 0 and 1")
	}
	switch {
	case d.ProbeEvery < NoProbes:
		problems = append(problems, fmt.Sprintf("ProbeEvery %d must be at least 1, or NoProbes (-1) for none", d.ProbeEvery))
	case set.ProbeEvery > 0 && d.Baseline > 0:
		problems = append(problems, fmt.Sprintf("ProbeEvery %d with a fixed Baseline: probes learn a baseline, and this one is given", d.ProbeEvery))
	}
	// A factor matters only to a controller that probes.
	if d.ProbeEvery != NoProbes && !(d.ProbeFactor > 0 && d.ProbeFactor < 1) {
		problems = append(problems, describe("ProbeFactor", set.ProbeFactor, d.ProbeFactor)+" must lie strictly between 0 and 1")
	}
	if d.MaxHealthy < 0 {
		problems = append(problems, fmt.Sprintf("MaxHealthy %v must not be negative (0: no such guard)", d.MaxHealthy))
	}
	switch {
	case d.Baseline < 0:
		problems = append(problems, fmt.Sprintf("Baseline %v must not be negative (0: measured)", d.Baseline))
	case d.Baseline > 0 && d.MaxHealthy > 0 && d.MaxHealthy <= d.Baseline:
		problems = append(problems, fmt.Sprintf("MaxHealthy %v must be above Baseline %v: every normal call would decrease the limit", d.MaxHealthy, d.Baseline))
	}
	if len(problems) == 0 {
		return nil
	}
	return &OptionsError{Problems: problems}
}

// or returns v, or def when v is zero.
func or[T int | float64](v, def T) T {
	if v == 0 {
		return def
	}
	return v
}

// describe names a field and its effective value, and says when that value is
// a default: "Initial 20 (default) must lie between ... Maximum 10" explains
// itself, "Initial 20" does not when the caller never wrote 20.
func describe[T int | float64](name string, set, effective T) string {
	if set == 0 {
		return fmt.Sprintf("%s %v (default)", name, effective)
	}
	return fmt.Sprintf("%s %v", name, effective)
}
