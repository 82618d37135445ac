package partition

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/egressd/egressd/pkg/limit"
	"github.com/egressd/egressd/pkg/shared"
	"github.com/egressd/egressd/pkg/verdict"
)

// Partitioned is a limiter per partition key, each made on first use and
// evicted once idle. It is safe for concurrent use, and holds no goroutine.
type Partitioned struct {
	name    string
	make    func(key string) (Limiter, error)
	idleFor int64 // ticks a partition must go unused: max(IdleTimeout, retention)
	every   int64 // ticks between lazy sweeps
	max     int
	origin  time.Time // ticks are nanoseconds since this
	onCount func(int)
	full    *verdict.RateLimitedError

	mu        sync.Mutex
	parts     map[string]*part
	lastSweep int64 // tick
}

// part is one partition.
type part struct {
	l Limiter
	// busy counts the Acquires in progress and the leases held. It rises
	// only under the Partitioned's lock, where eviction reads it, so that
	// nothing enters a partition being evicted; it falls without the lock.
	busy atomic.Int64
	// last is the tick of the latest Acquire or Release, stored before busy
	// falls, so that an evictor that sees busy at zero sees it too.
	last atomic.Int64
}

// New returns a partitioned limiter, or an [*OptionsError] listing every
// problem with opts.
func New(opts Options) (*Partitioned, error) {
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	p := &Partitioned{
		name:    opts.Name,
		max:     opts.MaxPartitions,
		onCount: opts.OnCount,
		parts:   map[string]*part{},
	}
	if p.name == "" {
		p.name = "partition"
	}
	if p.max == 0 {
		p.max = DefaultMaxPartitions
	}
	idle := opts.IdleTimeout
	if idle == 0 {
		idle = DefaultIdleTimeout
	}
	var keep time.Duration
	switch {
	case opts.Local != nil:
		lo := cloneLocal(*opts.Local)
		if lo.Adaptive != nil && lo.Observer != nil {
			lo.Observer = leasesOnly{lo.Observer}
		}
		keep = retention(&lo)
		p.make = func(string) (Limiter, error) {
			l, err := limit.New(lo)
			if err != nil {
				return nil, err
			}
			return Adapt(l), nil
		}
	case opts.Shared != nil:
		so, client := cloneShared(*opts.Shared), opts.Redis
		prefix := so.Key
		if so.Name == "" {
			so.Name = prefix
		}
		p.make = func(key string) (Limiter, error) {
			o := so
			o.Key = shared.KeyFor(prefix, key)
			l, err := shared.New(client, o)
			if err != nil {
				return nil, err
			}
			return Adapt(l), nil
		}
	default:
		p.make = opts.New
	}
	p.idleFor = int64(max(idle, keep))
	p.every = int64(max(idle/2, time.Millisecond))
	p.full = &verdict.RateLimitedError{Limiter: p.name, Err: ErrTooManyPartitions}
	p.origin = time.Now() // with its monotonic reading, for time.Since
	return p, nil
}

// Name returns the partitioned limiter's name.
func (p *Partitioned) Name() string { return p.name }

// Len returns how many partitions are held.
func (p *Partitioned) Len() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.parts)
}

// leasesOnly passes on what an adaptive partition's limiter tells its
// observer, but for its limit: see Options.Local.
type leasesOnly struct{ limit.Observer }

func (leasesOnly) OnLimit(int) {}

// tick returns the time as nanoseconds since origin: time.Since reads the
// monotonic clock alone, half what time.Now costs.
func (p *Partitioned) tick() int64 { return int64(time.Since(p.origin)) }

// Lease is a permit held in one partition, with package limit's contract:
// Release it once, through the variable Acquire returned, however the work
// ended; Release zeroes it, so a second call does nothing. A copy released
// as well does nothing either when the partition's limiter came from Adapt
// (every Local and Shared partition's does); a Releaser of Options.New's
// own is released again, and its partition counted idle too soon. Until a
// lease that holds a permit is released its partition is not evicted; a
// rate permit, spent when taken, holds nothing. The zero Lease holds
// nothing.
type Lease struct {
	r Releaser
	p *Partitioned
	e *part
}

// releaseOnce is a Releaser that can tell a second release, Adapt's box.
type releaseOnce interface {
	release() bool
}

// Release returns the permit to its partition's limiter. It is safe on the
// zero Lease and on one already released.
func (ls *Lease) Release() {
	e := ls.e
	if e == nil {
		return
	}
	r, p := ls.r, ls.p
	*ls = Lease{}
	if o, ok := r.(releaseOnce); ok {
		if !o.release() {
			return // a copy was released: the partition has counted it
		}
	} else {
		r.Release()
	}
	p.done(e)
}

// done marks the end of an Acquire that came to nothing, or of a lease.
func (p *Partitioned) done(e *part) {
	e.last.Store(p.tick())
	e.busy.Add(-1)
}

// Acquire takes a permit from key's partition, making the partition if it
// has none. It returns what that partition's limiter returns: a lease; a
// refusal, a *verdict.RateLimitedError; the context's error, when it ended
// while the caller waited; or the limiter's error. A key that would be a
// partition beyond MaxPartitions is refused with a *verdict.RateLimitedError
// wrapping ErrTooManyPartitions; one whose limiter cannot be made returns
// the factory's error. A key longer than MaxKeyLen is shortened first.
func (p *Partitioned) Acquire(ctx context.Context, key string) (Lease, error) {
	if len(key) > MaxKeyLen {
		key = boundKey(key)
	}
	e, err := p.enter(key)
	if err != nil {
		return Lease{}, err
	}
	r, err := e.l.Acquire(ctx)
	if err != nil {
		p.done(e)
		return Lease{}, err
	}
	if _, ok := r.(nothing); ok {
		// Nothing to give back, so nothing to keep the partition for: and
		// no box for a copy released as well to find empty.
		p.done(e)
		return Lease{}, nil
	}
	return Lease{r: r, p: p, e: e}, nil
}

// MaxKeyLen is the longest partition key kept as it is. A longer one -
// often a header a client chose - is kept as its first bytes and the hex
// SHA-256 of the whole, MaxKeyLen+1 bytes in all: as distinct as the keys
// were, and longer than any key kept as it is, so never taken for one.
const MaxKeyLen = 256

// boundKey is a key longer than MaxKeyLen as it is kept.
func boundKey(key string) string {
	sum := sha256.Sum256([]byte(key))
	return key[:MaxKeyLen+1-hex.EncodedLen(len(sum))] + hex.EncodeToString(sum[:])
}

// enter returns key's partition, made if need be, counted busy.
func (p *Partitioned) enter(key string) (*part, error) {
	now := p.tick()
	e, err := p.find(key, now)
	if e != nil || err != nil {
		return e, err
	}
	l, err := p.make(key) // a factory may be slow: not under the lock
	if err != nil {
		return nil, fmt.Errorf("partition %q of %s: %w", key, p.name, err)
	}
	return p.insert(key, l, now)
}

// find returns key's partition counted busy, or nil when it has none and
// there is room to make it. It unlocks by defer, as insert and Sweep do,
// so that an OnCount that panics does not leave the lock held.
func (p *Partitioned) find(key string, now int64) (*part, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if now-p.lastSweep >= p.every {
		p.sweepLocked(now)
	}
	e := p.parts[key]
	if e == nil {
		if !p.roomLocked(now) {
			return nil, p.full
		}
		return nil, nil
	}
	e.enter(now)
	return e, nil
}

// insert keeps l as key's partition, unless a racing caller made one
// first, and returns the partition kept, counted busy.
func (p *Partitioned) insert(key string, l Limiter, now int64) (*part, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	e := p.parts[key]
	if e == nil {
		if !p.roomLocked(now) {
			return nil, p.full
		}
		e = &part{l: l}
		p.parts[key] = e
		if p.onCount != nil {
			p.onCount(len(p.parts))
		}
	}
	e.enter(now)
	return e, nil
}

// enter counts e busy at now. Call with the Partitioned's lock held.
func (e *part) enter(now int64) {
	e.busy.Add(1)
	e.last.Store(now)
}

// roomLocked reports whether there is room for one more partition at now,
// sweeping first when the map is full and a second has passed since the
// last sweep: often enough to let newcomers in soon after partitions go
// idle, seldom enough that a flood of new keys does not sweep on every
// request. Call with mu held.
func (p *Partitioned) roomLocked(now int64) bool {
	if len(p.parts) < p.max {
		return true
	}
	if now-p.lastSweep >= min(p.every, int64(time.Second)) {
		p.sweepLocked(now)
	}
	return len(p.parts) < p.max
}

// Sweep evicts every partition that is idle now, and returns how many it
// evicted. Acquire sweeps by itself; call Sweep to free memory on a
// schedule of your own, when traffic may stop altogether.
func (p *Partitioned) Sweep() int {
	now := p.tick()
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.sweepLocked(now)
}

// sweepLocked evicts the partitions with nothing inside that have gone
// unused for idleFor at now. Call with mu held.
func (p *Partitioned) sweepLocked(now int64) int {
	p.lastSweep = now
	n := 0
	for key, e := range p.parts {
		if e.busy.Load() == 0 && now-e.last.Load() >= p.idleFor {
			delete(p.parts, key)
			n++
		}
	}
	if n > 0 && p.onCount != nil {
		p.onCount(len(p.parts))
	}
	return n
}
