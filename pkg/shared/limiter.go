package shared

import (
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"errors"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/egressd/egressd/pkg/limit"
	"github.com/egressd/egressd/pkg/verdict"
	"github.com/redis/go-redis/v9"
)

// Limiter is a limiter whose state is in Redis, shared with every process
// that uses its key. It is safe for concurrent use. It holds no goroutine of
// its own; each concurrency lease holds one, renewing it, until Release.
//
// It has package limit's method set, but not its interface: a limit.Lease
// can only be made by a limit.Local, and a shared concurrency lease must
// carry its id and its renewal. [Lease] is the same contract.
type Limiter struct {
	name    string
	key     []string // the budget's key: every script's, but concurrency admission's
	keys    []string // the admission script's: key, and for concurrency the epoch's
	client  redis.Scripter
	script  *redis.Script
	args    []any // the script's ARGV; concurrency appends the lease id
	conc    bool
	lease   time.Duration // concurrency's LeaseDuration
	idBase  string        // this limiter's random prefix of lease ids
	nextID  atomic.Uint64
	mode    FailureMode
	retries int
	store   cooldown

	queueLimit int
	newest     bool
	poll       time.Duration

	// refused and queueFull are the concurrency refusals: shared, since
	// they carry no RetryAfter.
	refused, queueFull *verdict.RateLimitedError

	successful, failed atomic.Int64
	available          atomic.Int64

	mu     sync.Mutex
	head   *waiter // oldest
	tail   *waiter // newest
	queued int
}

// Statistics are one limiter's, in this process.
type Statistics struct {
	// SuccessfulLeases and FailedLeases count this limiter's Acquires that
	// returned a lease, and those that did not (refused, failed, or ended by
	// their context).
	SuccessfulLeases, FailedLeases int64
	// QueuedPermits is how many permits wait in this process now.
	QueuedPermits int
	// AvailablePermits is what Redis said was left at this limiter's latest
	// decision (0 after a refusal): a hint, likely already spent by another
	// process, and not a cluster-wide figure.
	AvailablePermits int64
}

// New returns a limiter over client (a *redis.Client, *redis.ClusterClient
// or anything that runs scripts: every script touches the one key, so a
// cluster is fine), or an [*OptionsError] listing every problem with opts.
func New(client redis.Scripter, opts Options) (*Limiter, error) {
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	l := &Limiter{
		name:       opts.Name,
		key:        []string{opts.Key},
		keys:       []string{opts.Key},
		client:     client,
		mode:       opts.FailureMode,
		retries:    opts.MaxRetries,
		queueLimit: opts.QueueLimit,
		newest:     opts.QueueOrder == limit.NewestFirst,
		poll:       opts.QueuePollInterval,
	}
	if l.name == "" {
		l.name = opts.Key
	}
	switch opts.StoreCooldown {
	case 0:
		l.store.every = DefaultStoreCooldown
	case NoCooldown:
	default:
		l.store.every = opts.StoreCooldown
	}
	switch l.retries {
	case 0:
		l.retries = DefaultMaxRetries
	case NoRetries:
		l.retries = 0
	}
	if l.poll == 0 {
		l.poll = DefaultQueuePollInterval
	}
	us := func(d time.Duration) int64 { return d.Microseconds() }
	switch {
	case opts.FixedWindow != nil:
		p := opts.FixedWindow
		l.script, l.args = fixedWindowLua, []any{p.Permits, us(p.Window)}
		l.available.Store(int64(p.Permits))
	case opts.SlidingWindow != nil:
		p := opts.SlidingWindow
		l.script, l.args = slidingWindowLua, []any{p.Permits, us(p.Window) / int64(p.Segments), p.Segments}
		l.available.Store(int64(p.Permits))
	case opts.TokenBucket != nil:
		p := opts.TokenBucket
		l.script, l.args = tokenBucketLua, []any{p.TokenLimit, p.TokensPerPeriod, us(p.ReplenishmentPeriod)}
		l.available.Store(int64(p.TokenLimit))
	default:
		p := opts.Concurrency
		l.lease = p.LeaseDuration
		if l.lease == 0 {
			l.lease = DefaultLeaseDuration
		}
		l.conc = true
		l.script, l.args = concurrencyLua, []any{p.Permits, us(l.lease), flag(p.Holders), flag(p.Durability == Persistent)}
		l.keys = budgetKeys(opts.Key)
		l.available.Store(int64(p.Permits))
		var b [8]byte
		_, _ = crand.Read(b[:]) // never fails (crypto/rand)
		l.idBase = hex.EncodeToString(b[:]) + ":"
	}
	l.refused = &verdict.RateLimitedError{Limiter: l.name}
	l.queueFull = &verdict.RateLimitedError{Limiter: l.name, Err: limit.ErrQueueFull}
	return l, nil
}

// Name returns the limiter's name.
func (l *Limiter) Name() string { return l.name }

// Statistics returns this process's counts.
func (l *Limiter) Statistics() Statistics {
	l.mu.Lock()
	q := l.queued
	l.mu.Unlock()
	return Statistics{
		SuccessfulLeases: l.successful.Load(),
		FailedLeases:     l.failed.Load(),
		QueuedPermits:    q,
		AvailablePermits: l.available.Load(),
	}
}

// Acquire takes a permit from the shared budget. It returns a lease; or a
// refusal, an *sdk.RateLimitedError (wrapping limit.ErrQueueFull when the
// caller could not even wait, or the *StoreError under Deny); or, under
// Throw, a *StoreError; or ctx's error once ctx is done, whatever the
// FailureMode. Without a queue it asks Redis once (plus retries of
// retryable replies); with one, it waits its turn in this process and asks
// again after each refusal's RetryAfter.
func (l *Limiter) Acquire(ctx context.Context) (Lease, error) {
	lease, _, err := l.acquire(ctx)
	if err != nil {
		l.failed.Add(1)
	} else {
		l.successful.Add(1)
	}
	return lease, err
}

// result is one decision: what the script returned.
type result struct {
	ok    bool
	retry time.Duration
	avail int64
	id    int64 // the window or segment the decision was made in
}

// outcome is what try came to.
type outcome uint8

const (
	admitted outcome = iota
	refused          // by the budget
	denied           // no decision, refused under Deny
	failed           // no decision, returned (Throw), or ctx ended
)

func (l *Limiter) acquire(ctx context.Context) (Lease, result, error) {
	if err := ctx.Err(); err != nil {
		return Lease{}, result{}, err
	}
	if l.queueLimit == 0 {
		lease, res, _, err := l.try(ctx)
		return lease, res, err
	}
	return l.acquireQueued(ctx)
}

// try asks Redis once for a permit, retrying retryable replies, and applies
// the FailureMode.
func (l *Limiter) try(ctx context.Context) (Lease, result, outcome, error) {
	args, id := l.args, ""
	if l.conc {
		id = l.idBase + strconv.FormatUint(l.nextID.Add(1), 36)
		args = append(args[:len(args):len(args)], id)
	}
	vals, err := l.ask(ctx, args)
	if err != nil {
		if cerr := ctx.Err(); cerr != nil {
			return Lease{}, result{}, failed, cerr
		}
		se := &StoreError{Limiter: l.name, Op: "acquire", Err: err}
		switch l.mode {
		case Allow:
			return Lease{}, result{ok: true}, admitted, nil
		case Deny:
			return Lease{}, result{}, denied, &verdict.RateLimitedError{Limiter: l.name, Err: se}
		default:
			return Lease{}, result{}, failed, se
		}
	}
	res := result{ok: vals[0] == 1, retry: time.Duration(vals[1]) * time.Microsecond, avail: vals[2], id: vals[3]}
	l.available.Store(res.avail)
	if !res.ok {
		if l.conc && res.retry == 0 {
			return Lease{}, res, refused, l.refused
		}
		return Lease{}, res, refused, &verdict.RateLimitedError{Limiter: l.name, RetryAfter: res.retry}
	}
	if !l.conc {
		return Lease{}, res, admitted, nil
	}
	return l.hold(id), res, admitted, nil
}

// ask runs the admission script, retrying retryable replies, unless the
// store's cooldown says Redis just failed: then it fails at once.
func (l *Limiter) ask(ctx context.Context, args []any) ([]int64, error) {
	if err := l.store.ask(time.Now()); err != nil {
		return nil, err
	}
	var vals []int64
	var err error
	for attempt := 0; ; attempt++ {
		vals, err = l.script.Run(ctx, l.client, l.keys, args...).Int64Slice()
		if err == nil || attempt >= l.retries || !retryable(err) || ctx.Err() != nil {
			break
		}
		if err := sleep(ctx, backoff(attempt)); err != nil {
			l.store.abandon()
			return nil, err
		}
	}
	if err == nil && len(vals) != 4 {
		err = errors.New("script returned " + strconv.Itoa(len(vals)) + " values, want 4")
	}
	if err != nil && ctx.Err() != nil {
		l.store.abandon()
	} else {
		l.store.done(time.Now(), err)
	}
	return vals, err
}

// retryable reports whether err is a reply Redis means to be retried.
func retryable(err error) bool {
	for _, p := range [...]string{"LOADING", "BUSY", "TRYAGAIN", "MASTERDOWN", "CLUSTERDOWN"} {
		if redis.HasErrorPrefix(err, p) {
			return true
		}
	}
	return false
}

// backoff is the wait before retry attempt+1: up to 1ms·2^attempt, capped
// at 100ms, jittered over its upper half.
func backoff(attempt int) time.Duration {
	d := min(time.Millisecond<<min(attempt, 10), 100*time.Millisecond)
	return d/2 + rand.N(d/2+1)
}

// sleep waits d or until ctx is done, and returns ctx's error if it is.
func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
