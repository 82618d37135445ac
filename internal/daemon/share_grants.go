package daemon

import (
	"context"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/egressd/egressd/internal/daemon/decide"
	"github.com/egressd/egressd/pkg/loader"
	"github.com/egressd/egressd/pkg/policy"
	"github.com/egressd/egressd/pkg/shared"
)

// grantShare is this host's part of a shared rate budget: permits claimed
// from Redis in batches and granted to the kernel rule (ShapeGranted), or,
// while Redis is away, the failure mode's shape.
type grantShare struct {
	shareLoop
	grants *decide.Grants // under mu
	claims *shared.Grants
	kernel decide.GrantsKernel // how the kernel enforces it, as asked for; under mu
}

func newGrantShare(env shareEnv, spec policy.Rule, client redis.UniversalClient, now time.Time) (*grantShare, error) {
	sh := spec.Shared
	opts := shared.GrantsOptions{Key: sh.Key, Replicas: sh.Replicas}
	cfg := decide.GrantsConfig{Margin: shareMargin, Idle: shareIdle, RateWindow: shareRateWindow, Mode: shareMode(sh.FailureMode)}
	switch l := spec.Limit.(type) {
	case policy.PerSecond:
		burst := l.Burst
		if burst == 0 {
			burst = l.Permits
		}
		cfg.Batch = batchOf(float64(l.Permits), uint64(burst))
		opts.TokenBucket = &shared.TokenBucketOptions{TokenLimit: burst, TokensPerPeriod: l.Permits, ReplenishmentPeriod: time.Second}
	case policy.PerWindow:
		segments := l.Segments
		if segments == 0 {
			segments = loader.DefaultSegments
		}
		cfg.Batch, cfg.Window = batchOf(float64(l.Permits)/l.Window.Seconds(), uint64(l.Permits)), l.Window
		opts.SlidingWindow = &shared.SlidingWindowOptions{Permits: l.Permits, Window: l.Window, Segments: segments}
	}
	claims, err := shared.NewGrants(client, opts)
	if err != nil {
		return nil, err
	}
	return &grantShare{shareLoop: shareLoop{env: env, rule: spec.Name, spec: spec}, grants: decide.NewGrants(cfg, now), claims: claims}, nil
}

func (g *grantShare) rate() bool { return true }

func (g *grantShare) shape(r *loader.Rule) {
	g.mu.Lock()
	k := g.kernel
	g.mu.Unlock()
	switch {
	case k.Own:
		// The rule's own shape: the whole budget, FailureMode allow.
	case k.PerSecond > 0:
		r.Shape, r.Limit, r.Burst = loader.ShapePerSecond, k.PerSecond, k.Burst
	case k.Closed:
		r.Shape, r.Limit, r.Burst, r.Window, r.Segments = loader.ShapeConcurrency, 0, 0, 0, 0
	default:
		r.Shape, r.Limit, r.Burst, r.Window, r.Segments, r.Granted = loader.ShapeGranted, 0, 0, 0, 0, k.Granted
	}
}

func (g *grantShare) sameBudget(other share) bool {
	o, ok := other.(*grantShare)
	return ok && g.sameRedis(&o.shareLoop)
}

func (g *grantShare) inherit(old share) {
	o := old.(*grantShare)
	o.mu.Lock()
	defer o.mu.Unlock()
	g.mu.Lock()
	defer g.mu.Unlock()
	g.grants.Inherit(o.grants)
	g.kernel = o.kernel
	g.answered = o.answered
}

func (g *grantShare) adopt(kr loader.Rule, st loader.Stats) {
	if kr.Shape != loader.ShapeGranted {
		return
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	g.grants.Adopt(decide.GrantsObs{Granted: kr.Granted, Spent: st.Spent, Refused: st.Refused, Live: int(st.Live)})
	g.kernel = decide.GrantsKernel{Granted: kr.Granted}
}

func (g *grantShare) start() { g.run(g.tick) }

// end stops the loop. A rate's permits are spent once claimed: nothing
// goes back but what an idle tick already returned.
func (g *grantShare) end(bool, int) { g.halt() }

// tick runs one tick at now: claim a batch ahead of demand and grant what
// came, or take unspent permits back from the kernel and return them.
func (g *grantShare) tick(ctx context.Context, now time.Time) {
	began := time.Now()
	kr, st, err := observe(g.env.dp, g.rule)
	if err != nil {
		return
	}
	g.mu.Lock()
	p := g.grants.Plan(decide.GrantsObs{Granted: kr.Granted, Spent: st.Spent, Refused: st.Refused, Live: int(st.Live)}, now)
	g.mu.Unlock()
	cctx, cancel := context.WithTimeout(ctx, shareCallTimeout)
	defer cancel()
	switch p.Op {
	case decide.Claim:
		g.claim(ctx, cctx, p, now, began)
	case decide.Return:
		g.giveBack(cctx, p, now, began)
	}
}

// claim and giveBack carry out a tick's plan p; now and began are the
// tick's (see after).
func (g *grantShare) claim(ctx, cctx context.Context, p decide.GrantsPlan, now, began time.Time) {
	c, err := g.claims.Claim(cctx, int(p.N))
	if ctx.Err() != nil {
		return
	}
	g.mu.Lock()
	k, ev := g.grants.Claimed(p, c, err, after(now, began))
	g.count(ev, err)
	g.kernel = k
	g.mu.Unlock()
	g.env.write(g)
	g.logEvents(ev, err)
}

func (g *grantShare) giveBack(ctx context.Context, p decide.GrantsPlan, now, began time.Time) {
	taken, granted, err := g.env.dp.Reclaim(g.rule, p.Keep)
	if err != nil {
		return // the rule changed under us; next tick
	}
	g.mu.Lock()
	n, since := g.grants.Reclaimed(taken, granted, after(now, began))
	g.kernel.Granted = granted
	g.mu.Unlock()
	g.env.write(g) // the table's copy of the rule, lowered as the kernel's
	if n == 0 {
		return
	}
	err = g.claims.Return(ctx, int(n), since)
	g.mu.Lock()
	g.grants.Returned(n, err)
	g.mu.Unlock()
}

func (g *grantShare) view() shareView {
	g.mu.Lock()
	defer g.mu.Unlock()
	v := g.baseView()
	v.rate = true
	v.grants = g.grants.View()
	v.outage = v.grants.Outage
	return v
}
