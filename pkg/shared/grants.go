package shared

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
)

// GrantsOptions configure [Grants]: Key and exactly one shape, with the
// settings every Limiter and holder on Key uses.
type GrantsOptions struct {
	// Key is the Redis key of the rate budget: a Limiter's Key, when
	// in-process users share it. Required.
	Key string

	TokenBucket   *TokenBucketOptions
	SlidingWindow *SlidingWindowOptions

	// Replicas, when above 0, makes each Claim wait (Redis's WAIT, up to
	// ReplicaWait) until that many replicas have its writes, and say
	// whether they did: permits a failover could still lose are not to be
	// used. It needs a client that pipelines.
	Replicas    int
	ReplicaWait time.Duration
}

const noGrantsShape = "no shape: set one of TokenBucket or SlidingWindow"

// Validate reports every problem with o at once, as an [*OptionsError].
// The shapes are checked by [Options.Validate] itself, so that a budget
// Grants accepts is one a Limiter accepts too.
func (o *GrantsOptions) Validate() error {
	if o == nil {
		o = &GrantsOptions{}
	}
	err := (&Options{Key: o.Key, TokenBucket: o.TokenBucket, SlidingWindow: o.SlidingWindow}).Validate()
	more := replication(Ephemeral, o.Replicas, o.ReplicaWait)
	oe, ok := AsOptionsError(err)
	if !ok {
		if len(more) == 0 {
			return err
		}
		return &OptionsError{Problems: more}
	}
	for i, p := range oe.Problems {
		if p == noShape {
			oe.Problems[i] = noGrantsShape
		}
	}
	oe.Problems = append(oe.Problems, more...)
	return oe
}

// Grants is one holder's claims on a shared rate budget, a TokenBucket or a
// SlidingWindow in the layout a [Limiter] of that shape keeps: a daemon
// claims permits for its host and hands them to the kernel, while Limiters
// in other processes spend from the same budget. A claimed permit is spent
// in Redis at once, as if a Limiter had admitted it, and stays spent unless
// it is returned.
//
// Claiming many at once, rather than one per Acquire, keeps Redis off the
// path of each admission; Return gives back what the holder did not spend
// (what the kernel did not use before its share was taken back) so that
// other holders may. It is safe for concurrent use and keeps no goroutine.
type Grants struct {
	name   string
	key    []string
	client redis.Scripter
	claim  *redis.Script
	back   *redis.Script // Return's
	args   []any         // the shape's ARGV, as a Limiter's; Claim and Return append n
	wait   replicaWait
}

// NewGrants returns claims over client (as [New]'s), or an
// [*OptionsError] listing every problem with opts.
func NewGrants(client redis.Scripter, opts GrantsOptions) (*Grants, error) {
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	wait, err := newReplicaWait(client, opts.Replicas, opts.ReplicaWait)
	if err != nil {
		return nil, err
	}
	g := &Grants{name: opts.Key, key: []string{opts.Key}, client: client, wait: wait}
	if p := opts.TokenBucket; p != nil {
		g.claim, g.back = bucketClaimLua, bucketReturnLua
		g.args = []any{p.TokenLimit, p.TokensPerPeriod, p.ReplenishmentPeriod.Microseconds()}
	} else {
		p := opts.SlidingWindow
		g.claim, g.back = windowClaimLua, windowReturnLua
		g.args = []any{p.Permits, p.Window.Microseconds() / int64(p.Segments), p.Segments}
	}
	return g, nil
}

// Claimed is what a [Grants.Claim] took.
type Claimed struct {
	// Got is the permits taken. When none were, RetryAfter is until at
	// least one is available (the next token, or the oldest counted
	// segment's leaving the window), as a Limiter's RetryAfter: a computed
	// wait, not a reservation. It is 0 when Got is not.
	Got        int
	RetryAfter time.Duration
	// Confirmed is true when the Replicas asked for have the claim, or
	// none were asked for. False, a failover could lose it: do not spend
	// the permits (they stay spent in Redis).
	Confirmed bool
	// Segment is, for a sliding window, the id of the segment the permits
	// were counted in, on Redis's clock: what [Grants.Return] is bounded
	// by. It is 0 for a token bucket.
	Segment int64
}

// Claim takes up to n permits at once, as many as the budget has now: a
// partial grant rather than none, so that a holder asking for its share
// gets what there is.
//
// n must be at least 1. A failure is a [*StoreError] (retryable Redis
// replies are retried first), or ctx's error once ctx is done; after one a
// claim may have been made all the same, since a lost reply may have been
// applied.
func (g *Grants) Claim(ctx context.Context, n int) (Claimed, error) {
	if n < 1 {
		return Claimed{}, fmt.Errorf("shared grants %s claim: n %d must be at least 1", g.name, n)
	}
	if err := ctx.Err(); err != nil {
		return Claimed{}, err
	}
	vals, confirmed, err := g.wait.run(ctx, g.client, g.claim, g.name, "claim", g.key, 3, append(g.args[:len(g.args):len(g.args)], n)...)
	if err != nil {
		return Claimed{}, err
	}
	return Claimed{Got: int(vals[0]), RetryAfter: time.Duration(vals[1]) * time.Microsecond, Confirmed: confirmed, Segment: vals[2]}, nil
}

// Return gives back n permits claimed and not spent, so that others may
// spend them. A token bucket gets them back as tokens, never above
// TokenLimit: the bucket is then what it would have been had they never
// been claimed; it ignores since. A sliding window subtracts them from its
// newest counted segments no newer than since, never below zero: since is
// the [Claimed.Segment] of the oldest claim the permits came from. A newer
// segment counts others' permits (claimed after that one), and uncounting
// them would let them leave the window early; a segment that has left the
// window already counts nothing to subtract from. A since of 0 subtracts
// nothing.
//
// n must be at least 1; return only what Claim gave and was not spent, or
// the budget is exceeded by the difference. Failures are as Claim's.
func (g *Grants) Return(ctx context.Context, n int, since int64) error {
	if n < 1 {
		return fmt.Errorf("shared grants %s return: n %d must be at least 1", g.name, n)
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	_, err := runScript(ctx, g.client, g.back, g.name, "return", g.key, 1, append(g.args[:len(g.args):len(g.args)], n, since)...)
	return err
}
