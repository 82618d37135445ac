package partition

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/egressd/egressd/pkg/limit"
	"github.com/egressd/egressd/pkg/shared"
)

const (
	// DefaultIdleTimeout is IdleTimeout when it is zero.
	DefaultIdleTimeout = time.Minute
	// DefaultMaxPartitions is MaxPartitions when it is zero.
	DefaultMaxPartitions = 1 << 16
)

// Options configure a [Partitioned] limiter. Set exactly one of Local,
// Shared or New: what each partition's limiter is. Settings are copied by
// [New].
type Options struct {
	// Name says which partitioned limiter refused a key beyond
	// MaxPartitions. Empty means "partition".
	Name string

	// Local, if set, makes each partition a limit.Local with these
	// options: the same Name and Observer for every partition, so that
	// refusals and metrics name the limiter, not the partition. An
	// adaptive partition's limit is its own, so the Observer is not told
	// it (OnLimit): one gauge for every partition would show whichever
	// moved last, often a new partition's Initial. Adaptive.OnChange is
	// still called, for every partition, without saying which.
	Local *limit.Options
	// Shared, if set, makes each partition a shared.Limiter over Redis
	// with these options, but for Key: Shared.Key is the prefix, and the
	// partition's key is shared.KeyFor(Shared.Key, partition) (the prefix
	// alone for the empty partition). Name, if empty, is the prefix, not
	// the partition's key, for the reason Local gives.
	Shared *shared.Options
	// Redis is the client of Shared's limiters: a *redis.Client, a
	// *redis.ClusterClient, or anything that runs scripts. Required with
	// Shared, and only with it.
	Redis redis.Scripter
	// New, if set, makes the limiter of the partition key: wrap what it
	// makes with Adapt. It is called with no lock held, and may be called
	// twice for one key by callers racing to make it; one result is kept.
	// A partition it fails to make is not kept, and its error is returned
	// to the Acquire that asked.
	New func(key string) (Limiter, error)

	// IdleTimeout is how long a partition goes unused before it may be
	// evicted (a local rate partition waits longer when it must: see the
	// package documentation). Zero means DefaultIdleTimeout.
	IdleTimeout time.Duration
	// MaxPartitions is the most partitions held at once; zero means
	// DefaultMaxPartitions.
	MaxPartitions int
	// OnCount, if set, is told how many partitions there are each time a
	// partition is made or evicted, for a gauge. It is called with the
	// partitioned limiter's lock held: it must be quick, and must not call
	// back into it. It should not panic; if it does, the panic reaches the
	// Acquire or Sweep that made or evicted the partition, and the limiter
	// stays usable.
	OnCount func(partitions int)
}

func (o *Options) kinds() []string {
	var set []string
	if o.Local != nil {
		set = append(set, "Local")
	}
	if o.Shared != nil {
		set = append(set, "Shared")
	}
	if o.New != nil {
		set = append(set, "New")
	}
	return set
}

const noKind = "no limiter: set one of Local, Shared or New"

// Validate reports every problem with o at once, as an [*OptionsError]: no
// limiter or more than one, every problem of Local's or Shared's options,
// prefixed with the field's name, and every bad value of its own.
func (o *Options) Validate() error {
	if o == nil {
		return &OptionsError{Problems: []string{noKind}}
	}
	var problems []string
	add := func(format string, args ...any) { problems = append(problems, fmt.Sprintf(format, args...)) }

	switch set := o.kinds(); len(set) {
	case 0:
		add(noKind)
	case 1:
	default:
		add("%s are set: set exactly one of Local, Shared or New", strings.Join(set, " and "))
	}
	if o.Local != nil {
		for _, p := range nested(o.Local.Validate()) {
			add("Local.%s", p)
		}
	}
	if o.Shared != nil {
		for _, p := range nested(o.Shared.Validate()) {
			add("Shared.%s", p)
		}
		if o.Redis == nil {
			add("Redis is required with Shared")
		}
	} else if o.Redis != nil {
		add("Redis is set without Shared: only Shared's limiters use it")
	}
	if o.IdleTimeout < 0 {
		add("IdleTimeout %v must not be negative (0 means %v)", o.IdleTimeout, DefaultIdleTimeout)
	}
	if o.MaxPartitions < 0 {
		add("MaxPartitions %d must not be negative (0 means %d)", o.MaxPartitions, DefaultMaxPartitions)
	}
	if len(problems) == 0 {
		return nil
	}
	return &OptionsError{Problems: problems}
}

// nested returns the problems of a nested Validate's error.
func nested(err error) []string {
	if err == nil {
		return nil
	}
	if oe, ok := errors.AsType[*OptionsError](err); ok {
		return oe.Problems
	}
	return []string{err.Error()}
}

// cloneLocal copies o and the shapes it points to, so that changing the
// caller's options after New changes no partition made later.
func cloneLocal(o limit.Options) limit.Options {
	if o.PerSecond != nil {
		p := *o.PerSecond
		o.PerSecond = &p
	}
	if o.PerWindow != nil {
		p := *o.PerWindow
		o.PerWindow = &p
	}
	if o.Adaptive != nil {
		p := *o.Adaptive
		o.Adaptive = &p
	}
	return o
}

// cloneShared is cloneLocal for shared options.
func cloneShared(o shared.Options) shared.Options {
	if o.FixedWindow != nil {
		p := *o.FixedWindow
		o.FixedWindow = &p
	}
	if o.SlidingWindow != nil {
		p := *o.SlidingWindow
		o.SlidingWindow = &p
	}
	if o.TokenBucket != nil {
		p := *o.TokenBucket
		o.TokenBucket = &p
	}
	if o.Concurrency != nil {
		p := *o.Concurrency
		o.Concurrency = &p
	}
	return o
}

// retention is how long a local partition made with o must go unused
// before forgetting it changes nothing: a bucket's time to fill from empty,
// a window's length. The concurrency shapes hold nothing once their leases
// are back.
func retention(o *limit.Options) time.Duration {
	switch {
	case o.PerSecond != nil:
		burst := int64(o.PerSecond.Burst)
		if burst == 0 {
			burst = int64(o.PerSecond.Permits)
		}
		// burst and Permits are at most MaxRate (1e9): no overflow.
		rate := int64(o.PerSecond.Permits)
		return time.Duration((burst*int64(time.Second) + rate - 1) / rate)
	case o.PerWindow != nil:
		return o.PerWindow.Window
	}
	return 0
}
