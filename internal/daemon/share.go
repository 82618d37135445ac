package daemon

import (
	"context"
	"fmt"
	"math"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/egressd/egressd/pkg/control"
	"github.com/egressd/egressd/pkg/loader"
	"github.com/egressd/egressd/pkg/policy"
	"github.com/egressd/egressd/pkg/shared"
)

// How a host keeps its share of a shared budget.
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
	// shareRegrow is how long after an outage a share only takes back
	// what it held, so that hosts find their shares again in a Redis that
	// restarted empty before any grows into another's.
	shareRegrow = time.Second
	// shareCallTimeout bounds one Redis call; the next tick tries again.
	shareCallTimeout = 500 * time.Millisecond
	// shareLease is how long a concurrency slot outlives a daemon that
	// stops renewing it; a daemon restarted sooner takes its slots back.
	shareLease = 30 * time.Second
)

// share is this host's part of one rule's shared budget. Its loop claims
// and hands back that part in Redis and keeps the kernel rule equal to it:
// for concurrency, the kernel limit is the slots held; for a rate, the
// kernel is granted the permits claimed (loader.ShapeGranted).
type share struct {
	d      *Daemon
	rule   string
	spec   policy.Rule
	mode   string
	slots  *shared.Slots  // concurrency
	grants *shared.Grants // rate shapes
	batch  uint64         // rate: permits claimed at once

	stop context.CancelFunc
	done chan struct{}

	// Read by the kernel rule and the API; written by the loop.
	mu      sync.Mutex
	limit   int    // concurrency: the kernel limit
	held    int    // concurrency: slots held in Redis
	fair    int    // concurrency: this host's fair share, as Redis last said
	granted uint64 // rate: the kernel rule's Granted
	failing bool   // Redis cannot be reached: mode is in force
	lastErr string
	since   time.Time // when failing started
	// regrowAt ends the hold on growth after an outage.
	regrowAt time.Time
	// fallback is the per-second rate a rate share keeps in mode throw.
	fallback uint32

	// The loop's own.
	active      time.Time // last connection or refusal
	lastRefused uint64
	lastSpent   uint64
	claims      []claim // rate: recent claims, for the fallback rate

	errors, claimed, returned uint64 // counters, under mu
}

type claim struct {
	at time.Time
	n  uint64
}

// newShare makes the share of a valid shared rule; its loop starts with
// start.
func (d *Daemon) newShare(r policy.Rule) (*share, error) {
	client, err := d.redisClient(r.Shared.Redis)
	if err != nil {
		return nil, err
	}
	s := &share{d: d, rule: r.Name, spec: r, mode: r.Shared.FailureMode, active: time.Now()}
	if s.mode == "" {
		s.mode = policy.FailureThrow
	}
	switch l := r.Limit.(type) {
	case policy.Concurrency:
		s.fair = int(l)
		s.slots, err = shared.NewSlots(client, shared.SlotsOptions{
			Key:           r.Shared.Key,
			Permits:       int(l),
			Holder:        d.cfg.HostID + ":" + r.Name,
			LeaseDuration: shareLease,
		})
	case policy.PerSecond:
		burst := l.Burst
		if burst == 0 {
			burst = l.Permits
		}
		s.batch = batchOf(float64(l.Permits), uint64(burst))
		s.grants, err = shared.NewGrants(client, shared.GrantsOptions{Key: r.Shared.Key, TokenBucket: &shared.TokenBucketOptions{
			TokenLimit: burst, TokensPerPeriod: l.Permits, ReplenishmentPeriod: time.Second,
		}})
	case policy.PerWindow:
		segments := l.Segments
		if segments == 0 {
			segments = loader.DefaultSegments
		}
		s.batch = batchOf(float64(l.Permits)/l.Window.Seconds(), uint64(l.Permits))
		s.grants, err = shared.NewGrants(client, shared.GrantsOptions{Key: r.Shared.Key, SlidingWindow: &shared.SlidingWindowOptions{
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

// batchOf is shareBatchTime of perSecond, at least 1 and at most most.
func batchOf(perSecond float64, most uint64) uint64 {
	b := uint64(math.Ceil(perSecond * shareBatchTime.Seconds()))
	return max(1, min(b, most))
}

// redisClient returns the daemon's one client for a Redis URL. Calls fail
// fast and are not retried: the next tick is the retry, and a lost reply
// may have spent a permit.
func (d *Daemon) redisClient(url string) (*redis.Client, error) {
	d.redisMu.Lock()
	defer d.redisMu.Unlock()
	if c, ok := d.redis[url]; ok {
		return c, nil
	}
	opts, err := redis.ParseURL(url)
	if err != nil {
		return nil, fmt.Errorf("shared.redis: %w", err)
	}
	opts.DialTimeout = shareCallTimeout
	opts.ReadTimeout = shareCallTimeout
	opts.WriteTimeout = shareCallTimeout
	opts.MaxRetries = -1
	opts.PoolSize = 4
	c := redis.NewClient(opts)
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

// shape sets the kernel rule's shape to the share as it stands.
func (s *share) shape(r *loader.Rule) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.slots != nil {
		r.Limit = uint32(s.limit)
		if s.failing {
			switch s.mode {
			case policy.FailureAllow:
				r.Limit = uint32(s.spec.Limit.(policy.Concurrency))
			case policy.FailureDeny:
				r.Limit = 0
			}
		}
		return
	}
	if s.failing && s.mode != policy.FailureDeny {
		// The rule's own shape: the whole budget (allow), or this
		// host's recent share of it as a bucket (throw).
		if s.mode == policy.FailureThrow {
			r.Shape, r.Limit, r.Burst = loader.ShapePerSecond, s.fallback, uint32(s.batch)
		}
		return
	}
	r.Shape, r.Limit, r.Burst, r.Window, r.Segments, r.Granted = loader.ShapeGranted, 0, 0, 0, 0, s.granted
}

// inherit carries on where old left off when a rule's settings change but
// its budget does not: the slots are the same holder's in Redis, and the
// permits granted are the kernel's.
func (s *share) inherit(old *share) {
	if old == nil || old.spec.Shared.Key != s.spec.Shared.Key || (old.slots == nil) != (s.slots == nil) {
		return
	}
	old.mu.Lock()
	defer old.mu.Unlock()
	s.limit, s.held, s.fair, s.granted = old.limit, old.held, min(old.fair, s.fair), old.granted
}

// adopt starts a share from the kernel rule a previous daemon left
// pinned, so that a restart neither refuses connections until the first
// tick nor loses permits it had granted: the slots are this holder's in
// Redis, and the first tick confirms (or cuts) them; granted permits came
// from Redis already.
func (s *share) adopt(kr loader.Rule) {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.slots != nil && kr.Shape == loader.ShapeConcurrency:
		s.limit, s.held = int(kr.Limit), int(kr.Limit)
	case s.grants != nil && kr.Shape == loader.ShapeGranted:
		s.granted = kr.Granted
	}
}

// releases reports whether a share's slots go back when its rule becomes
// next (nil: removed): unless the same budget is still this rule's.
func (s *share) releases(next *entry) bool {
	return next == nil || next.share == nil || next.share.spec.Shared.Key != s.spec.Shared.Key
}

// start runs the share's loop until stopped.
func (s *share) start() {
	ctx, cancel := context.WithCancel(context.Background())
	s.stop, s.done = cancel, make(chan struct{})
	go func() {
		defer close(s.done)
		t := time.NewTicker(shareTick)
		defer t.Stop()
		for {
			s.tick(ctx, time.Now())
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
func (s *share) end(release bool) {
	if s.stop == nil {
		return
	}
	s.stop()
	<-s.done
	if release && s.slots != nil {
		ctx, cancel := context.WithTimeout(context.Background(), shareCallTimeout)
		defer cancel()
		if _, _, err := s.slots.Resize(ctx, 0, 0); err != nil {
			s.d.log.Warn("shared budget: slots not handed back; they expire", "rule", s.rule, "err", err)
		}
	}
}

func (s *share) tick(ctx context.Context, now time.Time) {
	st, err := s.d.dp.Stats(s.rule)
	if err != nil {
		return // not in the kernel (pending, or being replaced)
	}
	if st.Refused > s.lastRefused || st.Live > 0 || st.Spent > s.lastSpent {
		s.active = now
	}
	demand := st.Refused - min(st.Refused, s.lastRefused)
	s.lastRefused, s.lastSpent = st.Refused, st.Spent
	idle := now.Sub(s.active) >= shareIdle
	cctx, cancel := context.WithTimeout(ctx, shareCallTimeout)
	defer cancel()
	if s.slots != nil {
		err = s.tickSlots(cctx, now, st, demand, idle)
	} else {
		err = s.tickGrants(cctx, now, st, demand, idle)
	}
	if err != nil && ctx.Err() == nil {
		s.fail(now, err)
	}
}

// tickSlots asks for a slot per live connection and one spare, or as many
// more as were refused since the last tick, so the share grows with
// demand; idle, it asks for none. Redis answers with what this host holds
// and its fair share of the budget among the hosts asking. Shrinking lowers
// the kernel limit before the slots are handed back, so no connection is
// admitted on a slot another host has; a host above its fair share stops
// admitting beyond it and gives slots back as its connections close.
func (s *share) tickSlots(ctx context.Context, now time.Time, st loader.Stats, refused uint64, idle bool) error {
	permits := int(s.spec.Limit.(policy.Concurrency))
	live := int(max(st.Live, 0))
	need := min(permits, live+max(1, int(min(refused, uint64(permits)))))
	if idle {
		need = live
	}
	s.mu.Lock()
	held, fair, failing, regrow := s.held, s.fair, s.failing, s.regrowAt
	s.mu.Unlock()
	target := min(need, fair)
	switch {
	case failing:
		// Claim what was held to learn whether Redis is back.
		target = held
	case now.Before(regrow):
		// Redis came back, perhaps empty: every host takes back its
		// own share before any grows into another's.
		target = min(target, held)
	}
	keep := target
	if target < held {
		s.setLimit(target)
		// Connections admitted before keep their slots.
		if n, err := s.d.dp.Live(s.rule); err == nil {
			keep = min(held, max(target, int(n)))
		} else {
			keep = held
		}
	}
	got, fair, err := s.slots.Resize(ctx, keep, need)
	if err != nil {
		return err
	}
	s.mu.Lock()
	s.held, s.fair = got, fair
	s.mu.Unlock()
	s.recovered(now, min(got, target, fair))
	return nil
}

// tickGrants keeps a batch of permits granted ahead of demand while the
// host is busy, and hands unspent permits back, but one, when it goes idle.
func (s *share) tickGrants(ctx context.Context, now time.Time, st loader.Stats, demand uint64, idle bool) error {
	s.mu.Lock()
	granted, failing := s.granted, s.failing
	s.mu.Unlock()
	base := max(granted, st.Spent)
	if failing {
		// The kernel counted nothing while it enforced the fallback:
		// grant from what it has spent.
		base = st.Spent
	}
	unspent := base - st.Spent
	if idle && !failing {
		// One permit stays, so that the next connection after an idle
		// spell is not refused for want of a claim.
		if unspent <= 1 {
			return nil
		}
		taken, left, err := s.d.dp.Reclaim(s.rule, 1)
		if err != nil {
			return nil // the rule changed under us; next tick
		}
		s.mu.Lock()
		s.granted = left
		s.mu.Unlock()
		if taken == 0 {
			return nil
		}
		if err := s.grants.Return(ctx, int(taken)); err != nil {
			return err
		}
		s.mu.Lock()
		s.returned += taken
		s.mu.Unlock()
		return nil
	}
	// While failing, every tick claims: that is how recovery is found.
	if !failing && (idle || unspent > s.batch/2) {
		return nil
	}
	want := s.batch + min(demand, s.batch)
	got, _, err := s.grants.Claim(ctx, int(want))
	if err != nil {
		return err
	}
	s.mu.Lock()
	s.granted = base + uint64(got)
	s.claimed += uint64(got)
	s.claims = append(s.claims, claim{at: now, n: uint64(got)})
	for len(s.claims) > 0 && now.Sub(s.claims[0].at) > shareRateWindow {
		s.claims = s.claims[1:]
	}
	s.mu.Unlock()
	s.recovered(now, 0)
	if got > 0 {
		s.push()
	}
	return nil
}

// setLimit moves a concurrency share's kernel limit.
func (s *share) setLimit(n int) {
	s.mu.Lock()
	changed := s.limit != n
	s.limit = n
	s.mu.Unlock()
	if changed {
		s.push()
	}
}

// fail puts the failure mode in force, once per outage.
func (s *share) fail(now time.Time, err error) {
	s.mu.Lock()
	s.errors++
	s.lastErr = err.Error()
	first := !s.failing
	if first {
		s.failing, s.since = true, now
		var n uint64
		for _, c := range s.claims {
			n += c.n
		}
		s.fallback = uint32(max(1, math.Ceil(float64(n)/shareRateWindow.Seconds())))
	}
	s.mu.Unlock()
	if !first {
		return
	}
	s.d.log.Warn("shared budget unreachable; failure mode in force", "rule", s.rule, "mode", s.mode, "err", err)
	if s.grants != nil && s.mode == policy.FailureDeny {
		// Zero: the unspent permits are taken back (and lost, with
		// Redis unreachable to take them).
		if _, left, err := s.d.dp.Reclaim(s.rule, 0); err == nil {
			s.mu.Lock()
			s.granted = left
			s.mu.Unlock()
		}
	}
	s.push()
}

// recovered ends an outage; a concurrency share's kernel limit becomes the
// slots it now holds.
func (s *share) recovered(now time.Time, limit int) {
	s.mu.Lock()
	was := s.failing
	s.failing, s.lastErr = false, ""
	if was {
		s.regrowAt = now.Add(shareRegrow)
	}
	if s.slots != nil {
		s.limit = limit
	}
	s.mu.Unlock()
	if was {
		s.d.log.Info("shared budget reachable again", "rule", s.rule)
	}
	if was || s.slots != nil {
		s.push()
	}
}

// push writes the kernel rule as the share now shapes it.
func (s *share) push() {
	d := s.d
	d.mu.Lock()
	defer d.mu.Unlock()
	e, ok := d.entries[s.rule]
	if !ok || e.share != s || !e.installed() {
		return
	}
	r := e.base
	s.shape(&r)
	k := e.kernel
	if r.Shape == k.Shape && r.Limit == k.Limit && r.Granted == k.Granted && r.Burst == k.Burst && r.Window == k.Window && r.Segments == k.Segments {
		return
	}
	if err := d.dp.Put(r); err != nil {
		d.log.Error("push shared share", "rule", s.rule, "err", err)
		return
	}
	e.kernel = r
}

// shareView is what the API and metrics show of a share.
type shareView struct {
	key, mode       string
	failing         bool
	lastErr         string
	since           time.Time
	held, limit     int
	granted         uint64
	errors          uint64
	claimed, handed uint64
	rate            bool
}

func (s *share) control(st loader.Stats) *control.Share {
	v := s.view()
	out := &control.Share{Key: v.key, FailureMode: v.mode, Reachable: !v.failing, Error: v.lastErr, Slots: v.held, Returned: v.handed}
	if v.failing {
		out.Since = v.since
	}
	if v.rate {
		out.Granted, out.Spent = v.granted, st.Spent
	}
	return out
}

func (s *share) view() shareView {
	s.mu.Lock()
	defer s.mu.Unlock()
	return shareView{
		key: s.spec.Shared.Key, mode: s.mode, failing: s.failing, lastErr: s.lastErr, since: s.since,
		held: s.held, limit: s.limit, granted: s.granted, errors: s.errors,
		claimed: s.claimed, handed: s.returned, rate: s.grants != nil,
	}
}
