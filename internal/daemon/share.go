package daemon

import (
	"context"
	"fmt"
	"github.com/egressd/egressd/pkg/control"
	"math"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/egressd/egressd/internal/daemon/share"
	"github.com/egressd/egressd/pkg/loader"
	"github.com/egressd/egressd/pkg/policy"
	"github.com/egressd/egressd/pkg/shared"
	"github.com/egressd/egressd/pkg/shared/redisurl"
)

// How a host keeps its share of a shared budget. The decisions are
// package share's; this file runs them.
const (
	// shareTick is how often a share is checked against demand: the
	// longest a connection waits for a share to grow, counted as a
	// refusal the caller retries.
	shareTick = 50 * time.Millisecond
	// shareIdle is how long a host must go without a connection, or a
	// refusal, before it hands its whole share back.
	shareIdle = time.Second
	// shareBatchTime is the stretch of the whole budget's rate a host
	// claims at once: small, so an idle host holds little, and large
	// enough that a busy one asks Redis a few times a second.
	shareBatchTime = 100 * time.Millisecond
	// shareRateWindow is how far back a host's share of a rate is
	// measured, for FailureMode throw to keep it.
	shareRateWindow = 5 * time.Second
	// shareRenew is how often a concurrency share that holds what it
	// wants asks Redis all the same, to renew its slots and learn its fair
	// share anew: how long a busy host takes to notice others came, and
	// (with a lease a quarter of it) what a thousand hosts cost Redis.
	shareRenew = time.Second
	// shareCallTimeout bounds one Redis call; the next tick tries again.
	shareCallTimeout = 500 * time.Millisecond
	// shareMargin is how long before a slot's lease could run out in
	// Redis an unreachable host stops admitting on it: two ticks that
	// each wait out a call.
	shareMargin = 2 * (shareTick + shareCallTimeout)
)

// shareRunner runs one shared rule's share: a goroutine that ticks every
// shareTick, shows the pure share what the kernel holds, and does what it
// says: writes the kernel rule through the daemon and calls Redis.
type shareRunner struct {
	d    *Daemon
	rule string
	spec policy.Rule

	mu     sync.Mutex // the machine's; the API and the metrics read it
	slots  *share.Slots
	grants *share.Grants
	store  *shared.Slots
	claims *shared.Grants
	batch  uint64
	errors uint64 // Redis calls that failed
	lost   uint64 // times Redis answered with a new epoch
	// unconfirmed counts a concurrency share's growth left unused because
	// replicas did not confirm it.
	unconfirmed uint64

	// The kernel enforcement the share asked for last; guarded by d.mu,
	// so that the rule table writes the rule as the share has it.
	limit  int
	kernel share.GrantsKernel

	stop context.CancelFunc
	done chan struct{}
}

// newShare makes the runner of a valid shared rule; start runs it.
func (d *Daemon) newShare(r policy.Rule) (*shareRunner, error) {
	client, err := d.redisClient(r.Shared.Redis)
	if err != nil {
		return nil, err
	}
	s := &shareRunner{d: d, rule: r.Name, spec: r}
	now := time.Now()
	mode := shareMode(r.Shared.FailureMode)
	switch l := r.Limit.(type) {
	case policy.Concurrency:
		lease := r.Shared.Lease
		if lease == 0 {
			lease = policy.DefaultLease
		}
		durability := shared.Ephemeral
		if r.Shared.Durability == policy.DurabilityPersistent {
			durability = shared.Persistent
		}
		s.slots = share.NewSlots(share.SlotsConfig{Budget: int(l), Lease: lease, Margin: shareMargin, Idle: shareIdle, Renew: min(lease/4, shareRenew), Mode: mode}, now)
		s.store, err = shared.NewSlots(client, shared.SlotsOptions{
			Key: r.Shared.Key, Permits: int(l), Holder: d.cfg.HostID + ":" + r.Name,
			LeaseDuration: lease, Durability: durability, Replicas: r.Shared.Replicas,
		})
	case policy.PerSecond:
		burst := l.Burst
		if burst == 0 {
			burst = l.Permits
		}
		s.batch = batchOf(float64(l.Permits), uint64(burst))
		s.grants = share.NewGrants(s.grantsConfig(0, mode), now)
		s.claims, err = shared.NewGrants(client, shared.GrantsOptions{Key: r.Shared.Key, Replicas: r.Shared.Replicas, TokenBucket: &shared.TokenBucketOptions{
			TokenLimit: burst, TokensPerPeriod: l.Permits, ReplenishmentPeriod: time.Second,
		}})
	case policy.PerWindow:
		segments := l.Segments
		if segments == 0 {
			segments = loader.DefaultSegments
		}
		s.batch = batchOf(float64(l.Permits)/l.Window.Seconds(), uint64(l.Permits))
		s.grants = share.NewGrants(s.grantsConfig(l.Window, mode), now)
		s.claims, err = shared.NewGrants(client, shared.GrantsOptions{Key: r.Shared.Key, Replicas: r.Shared.Replicas, SlidingWindow: &shared.SlidingWindowOptions{
			Permits: l.Permits, Window: l.Window, Segments: segments,
		}})
	default:
		return nil, fmt.Errorf("a %T limit cannot be shared", r.Limit)
	}
	if err != nil {
		return nil, err
	}
	return s, nil
}

func (s *shareRunner) grantsConfig(window time.Duration, mode share.Mode) share.GrantsConfig {
	return share.GrantsConfig{Batch: s.batch, Window: window, Margin: shareMargin, Idle: shareIdle, RateWindow: shareRateWindow, Mode: mode}
}

func shareMode(m string) share.Mode {
	switch m {
	case policy.FailureAllow:
		return share.Allow
	case policy.FailureDeny:
		return share.Deny
	}
	return share.Throw
}

// batchOf is shareBatchTime of perSecond, at least 1 and at most most.
func batchOf(perSecond float64, most uint64) uint64 {
	b := uint64(math.Ceil(perSecond * shareBatchTime.Seconds()))
	return max(1, min(b, most))
}

// redisClient returns the daemon's one client for a Redis URL. Calls fail
// fast and are not retried: the next tick is the retry, and a lost reply
// may have spent a permit.
func (d *Daemon) redisClient(url string) (redis.UniversalClient, error) {
	d.redisMu.Lock()
	defer d.redisMu.Unlock()
	if c, ok := d.redis[url]; ok {
		return c, nil
	}
	c, err := redisurl.Open(url, redisurl.Timeouts{Dial: shareCallTimeout, Read: shareCallTimeout, Write: shareCallTimeout, PoolSize: 4})
	if err != nil {
		return nil, fmt.Errorf("shared.redis: %w", err)
	}
	d.redis[url] = c
	return c, nil
}

func (d *Daemon) closeRedis() {
	d.redisMu.Lock()
	defer d.redisMu.Unlock()
	for url, c := range d.redis {
		c.Close()
		delete(d.redis, url)
	}
}

// shape sets the kernel rule to enforce the share as it stands. Call with
// d.mu held.
func (s *shareRunner) shape(r *loader.Rule) {
	if s.slots != nil {
		r.Limit = uint32(s.limit)
		return
	}
	k := s.kernel
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

// sameBudget reports whether next spends the same budget as s under the
// same holder: a rule whose settings changed but not its key and shape
// carries its share over.
func (s *shareRunner) sameBudget(next *shareRunner) bool {
	return next != nil && next.spec.Shared.Key == s.spec.Shared.Key && next.spec.Shared.Redis == s.spec.Shared.Redis &&
		(next.slots == nil) == (s.slots == nil)
}

// inherit carries on where old left off (see sameBudget). Call with d.mu
// held, before either runs.
func (s *shareRunner) inherit(old *shareRunner) {
	old.mu.Lock()
	defer old.mu.Unlock()
	if s.slots != nil {
		s.slots.Inherit(old.slots)
	} else {
		s.grants.Inherit(old.grants)
	}
	s.limit, s.kernel = old.limit, old.kernel
}

// adopt starts the share from the kernel rule a previous daemon left
// pinned, so that a restart neither refuses connections until the first
// tick nor loses the permits it had granted. Call with d.mu held, before
// it runs.
func (s *shareRunner) adopt(kr loader.Rule, st loader.Stats) {
	switch {
	case s.slots != nil && kr.Shape == loader.ShapeConcurrency:
		s.slots.Adopt(share.SlotsObs{Limit: int(kr.Limit), Live: int(st.Live), Refused: st.Refused})
		s.limit = int(kr.Limit)
	case s.grants != nil && kr.Shape == loader.ShapeGranted:
		s.grants.Adopt(share.GrantsObs{Granted: kr.Granted, Spent: st.Spent, Refused: st.Refused, Live: int(st.Live)})
		s.kernel = share.GrantsKernel{Granted: kr.Granted}
	}
}

// start runs the share's loop until end.
func (s *shareRunner) start() {
	ctx, cancel := context.WithCancel(context.Background())
	s.stop, s.done = cancel, make(chan struct{})
	go func() {
		defer close(s.done)
		t := time.NewTicker(shareTick)
		defer t.Stop()
		for {
			if s.slots != nil {
				s.tickSlots(ctx)
			} else {
				s.tickGrants(ctx)
			}
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
		}
	}()
}

// end stops the loop. With release, the share is handed back: the kernel
// rule is gone, or no longer enforces it. Without, the slots stay claimed
// until their leases run out, because the kernel keeps enforcing them
// (fail-static) and a restarted daemon takes them back.
func (s *shareRunner) end(release bool) {
	if s.stop == nil {
		return
	}
	s.stop()
	<-s.done
	if release && s.store != nil {
		ctx, cancel := context.WithTimeout(context.Background(), shareCallTimeout)
		defer cancel()
		if _, err := s.store.Resize(ctx, shared.SlotsRequest{}); err != nil {
			s.d.log.Warn("shared budget: slots not handed back; they expire", "rule", s.rule, "err", err)
		}
	}
}

// tickSlots runs one tick of a concurrency share: lower the kernel first
// when shrinking, read what is live after that, ask Redis, and raise the
// kernel only to what Redis confirmed.
func (s *shareRunner) tickSlots(ctx context.Context) {
	kr, st, err := s.observe()
	if err != nil {
		return // not in the kernel (pending, or being replaced)
	}
	s.mu.Lock()
	p := s.slots.Plan(share.SlotsObs{Limit: int(kr.Limit), Live: int(st.Live), Refused: st.Refused}, time.Now())
	s.mu.Unlock()
	live := int(st.Live)
	if p.Limit != int(kr.Limit) {
		if !s.setLimit(p.Limit) {
			return
		}
		// Connections admitted before the lowering took effect keep
		// their slots.
		n, err := s.d.dp.Live(s.rule)
		if err != nil {
			return
		}
		live = int(n)
	}
	s.mu.Lock()
	req, ask := s.slots.Request(p, live, time.Now())
	s.mu.Unlock()
	if !ask {
		return
	}
	cctx, cancel := context.WithTimeout(ctx, shareCallTimeout)
	sent := time.Now()
	reply, err := s.store.Resize(cctx, shared.SlotsRequest(req))
	cancel()
	if ctx.Err() != nil {
		return // stopping: the answer no longer matters
	}
	s.mu.Lock()
	limit, ev := s.slots.Reply(p, req, share.SlotsReply(reply), err, sent, time.Now())
	if err != nil {
		s.errors++
	}
	if ev&share.StateLost != 0 {
		s.lost++
	}
	if ev&share.Unconfirmed != 0 {
		s.unconfirmed++
	}
	s.mu.Unlock()
	s.setLimit(limit)
	s.logEvents(ev, err)
}

// observe reads the share's kernel rule and its counts.
func (s *shareRunner) observe() (loader.Rule, loader.Stats, error) {
	kr, err := s.d.dp.Rule(s.rule)
	if err != nil {
		return kr, loader.Stats{}, err
	}
	st, err := s.d.dp.Stats(s.rule)
	return kr, st, err
}

// tickGrants runs one tick of a rate share: claim a batch ahead of demand
// and grant what came, or take unspent permits back and return them.
func (s *shareRunner) tickGrants(ctx context.Context) {
	kr, st, err := s.observe()
	if err != nil {
		return
	}
	s.mu.Lock()
	p := s.grants.Plan(share.GrantsObs{Granted: kr.Granted, Spent: st.Spent, Refused: st.Refused, Live: int(st.Live)}, time.Now())
	s.mu.Unlock()
	cctx, cancel := context.WithTimeout(ctx, shareCallTimeout)
	defer cancel()
	switch p.Op {
	case share.Claim:
		c, err := s.claims.Claim(cctx, int(p.N))
		if ctx.Err() != nil {
			return
		}
		s.mu.Lock()
		k, ev := s.grants.Claimed(p, uint64(c.Got), c.Confirmed, err, time.Now())
		if err != nil {
			s.errors++
		}
		s.mu.Unlock()
		s.setGrants(k)
		s.logEvents(ev, err)
	case share.Return:
		taken, granted, err := s.d.dp.Reclaim(s.rule, p.Keep)
		if err != nil {
			return // the rule changed under us; next tick
		}
		s.mu.Lock()
		n := s.grants.Reclaimed(taken, granted, time.Now())
		s.mu.Unlock()
		s.d.mu.Lock()
		s.kernel.Granted = granted
		s.d.mu.Unlock()
		if n == 0 {
			return
		}
		err = s.claims.Return(cctx, int(n))
		s.mu.Lock()
		s.grants.Returned(n, err)
		s.mu.Unlock()
	}
}

// setLimit writes a concurrency share's kernel limit; false if it could
// not.
func (s *shareRunner) setLimit(n int) bool {
	return s.d.writeShare(s, func() { s.limit = n })
}

// setGrants writes a rate share's kernel enforcement.
func (s *shareRunner) setGrants(k share.GrantsKernel) {
	s.d.writeShare(s, func() { s.kernel = k })
}

func (s *shareRunner) logEvents(ev share.Event, err error) {
	log := s.d.log.With("rule", s.rule)
	if ev&share.Failed != 0 {
		log.Warn("shared budget unreachable; failure mode in force", "mode", s.spec.Shared.FailureMode, "err", err)
	}
	if ev&share.Expired != 0 {
		log.Warn("shared budget unreachable for a lease: admitting nothing new, since its slots may have expired in Redis")
	}
	if ev&share.Recovered != 0 {
		log.Info("shared budget reachable again")
	}
	if ev&share.StateLost != 0 {
		log.Warn("Redis lost the shared budget's state; growth frozen for a lease while hosts take back what they hold")
	}
	if ev&share.Unconfirmed != 0 {
		log.Warn("replicas did not confirm a grant in time; not used", "replicas", s.spec.Shared.Replicas)
	}
}

// writeShare changes what a share asks of the kernel (set, under d.mu) and
// writes the rule if that changed it. It reports whether the kernel now
// enforces the share: false when the rule is not installed (pending,
// replaced by another share) or the write failed.
func (d *Daemon) writeShare(s *shareRunner, set func()) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	set()
	e, ok := d.entries[s.rule]
	if !ok || e.share != s || !e.installed() {
		return false
	}
	r := e.base
	s.shape(&r)
	k := e.kernel
	if r.Shape == k.Shape && r.Limit == k.Limit && r.Granted == k.Granted && r.Burst == k.Burst && r.Window == k.Window && r.Segments == k.Segments {
		return true
	}
	if err := d.dp.Put(r); err != nil {
		d.log.Error("write shared rule", "rule", s.rule, "err", err)
		return false
	}
	e.kernel = r
	return true
}

// shareView is what the API and the metrics show of a share.
type shareView struct {
	rate        bool
	lost        uint64
	unconfirmed uint64 // a concurrency share's growth left unused
	slots       share.SlotsView
	grants      share.GrantsView
	outage      share.Outage
	errors      uint64
	frozen      bool
	mode        string
	settings    policy.Shared
}

func (s *shareRunner) view() shareView {
	s.mu.Lock()
	defer s.mu.Unlock()
	v := shareView{rate: s.grants != nil, errors: s.errors, lost: s.lost, unconfirmed: s.unconfirmed, mode: s.spec.Shared.FailureMode, settings: s.spec.Shared}
	if v.mode == "" {
		v.mode = policy.FailureThrow
	}
	if s.slots != nil {
		v.slots = s.slots.View()
		v.outage = v.slots.Outage
		v.frozen = time.Now().Before(v.slots.FrozenUntil)
	} else {
		v.grants = s.grants.View()
		v.outage = v.grants.Outage
	}
	return v
}

// control is the share as the API shows it.
func (v shareView) control(st loader.Stats) *control.Share {
	out := &control.Share{Key: v.settings.Key, FailureMode: v.mode, Durability: v.settings.Durability, Replicas: v.settings.Replicas,
		Reachable: !v.outage.Failing()}
	if out.Durability == "" {
		out.Durability = policy.DurabilityEphemeral
	}
	if v.outage.Failing() {
		out.Since, out.Error = v.outage.Since, v.outage.Err.Error()
	}
	if v.rate {
		g := v.grants
		out.Granted, out.Spent, out.Returned, out.Unconfirmed = g.Kernel.Granted, st.Spent, g.Returned, g.Unconfirmed
		return out
	}
	lease := v.settings.Lease
	if lease == 0 {
		lease = policy.DefaultLease
	}
	out.Slots, out.FairShare, out.LeaseSeconds, out.Expired, out.Epoch = v.slots.Held, max(v.slots.Fair, 0), lease.Seconds(), v.slots.Expired, v.slots.Epoch
	out.Unconfirmed = v.unconfirmed
	if v.frozen {
		out.FrozenUntil = v.slots.FrozenUntil
	}
	return out
}
