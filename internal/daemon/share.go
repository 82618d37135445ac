package daemon

import (
	"context"
	"fmt"
	"log/slog"
	"math"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/egressd/egressd/internal/daemon/decide"
	"github.com/egressd/egressd/pkg/control"
	"github.com/egressd/egressd/pkg/loader"
	"github.com/egressd/egressd/pkg/policy"
	"github.com/egressd/egressd/pkg/shared"
)

// This host's shares of shared budgets. The decisions are package decide's
// (internal/daemon/decide); a share here runs them: a loop of its own that
// every shareTick reads the kernel rule, asks the decision, writes the
// kernel rule through the table and calls Redis. slotShare
// (share_slots.go) holds a concurrency budget's slots, grantShare
// (share_grants.go) a rate's permits.

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

// share is this host's part of one shared rule's budget.
type share interface {
	name() string
	// rate reports a rate's share (permits), not a concurrency's (slots).
	rate() bool
	// shape sets the kernel rule to enforce the share as it stands, in
	// the fields Rule.SameLimit compares; the table calls it with its
	// lock held.
	shape(r *loader.Rule)
	// sameBudget reports whether other spends the same budget under the
	// same holder: a rule whose settings changed but not its Redis, key
	// and shape carries its share over (inherit).
	sameBudget(other share) bool
	inherit(old share)
	// adopt starts the share from the kernel rule a previous daemon left
	// pinned, so that a restart neither refuses connections until the
	// first tick nor loses the permits it had granted.
	adopt(kr loader.Rule, st loader.Stats)
	// start runs the share's loop, once; end stops it and waits for it.
	// With release, the share goes back to Redis: the kernel rule is gone,
	// or no longer enforces it; but as many slots as live, the
	// connections that rule held when it went (-1: not known, all), stay
	// claimed until their leases run out, for those connections are still
	// open and uncounted. Without release, the slots stay claimed until
	// their leases run out, because the kernel keeps enforcing them
	// (fail-static) and a restarted daemon takes them back.
	start()
	end(release bool, live int)
	view() shareView
}

// shareEnv is what a share uses of the daemon's: the kernel's counts, a
// write of its rule through the table, the log.
type shareEnv struct {
	dp    datapath
	write func(s share) bool
	log   *slog.Logger
}

// shareLoop is what both kinds of share have: the rule, the loop, and the
// counts of what went wrong.
type shareLoop struct {
	env  shareEnv
	rule string
	spec policy.Rule

	startOnce sync.Once
	stop      context.CancelFunc
	done      chan struct{}

	mu                        sync.Mutex // the machine's, and these counts
	errors, lost, unconfirmed uint64
	// answered says a call to Redis has come back, with or without an
	// error: before, the share knows neither that Redis answers nor that
	// it does not. A share that inherits the budget inherits it too.
	answered bool
}

func (l *shareLoop) name() string { return l.rule }

// run starts tick every shareTick until end, once.
func (l *shareLoop) run(tick func(ctx context.Context, now time.Time)) {
	l.startOnce.Do(func() {
		ctx, cancel := context.WithCancel(context.Background())
		l.stop, l.done = cancel, make(chan struct{})
		go func() {
			defer close(l.done)
			t := time.NewTicker(shareTick)
			defer t.Stop()
			for {
				tick(ctx, time.Now())
				select {
				case <-ctx.Done():
					return
				case <-t.C:
				}
			}
		}()
	})
}

// halt stops the loop and waits for it; false if it never ran.
func (l *shareLoop) halt() bool {
	if l.stop == nil {
		return false
	}
	l.stop()
	<-l.done
	return true
}

// count keeps the counts of a tick's outcome; call with l.mu held.
func (l *shareLoop) count(ev decide.Event, err error) {
	l.answered = true
	if err != nil {
		l.errors++
	}
	if ev&decide.StateLost != 0 {
		l.lost++
	}
	if ev&decide.Unconfirmed != 0 {
		l.unconfirmed++
	}
}

func (l *shareLoop) logEvents(ev decide.Event, err error) {
	log := l.env.log.With("rule", l.rule)
	if ev&decide.Failed != 0 {
		log.Warn("shared budget unreachable; failure mode in force", "mode", l.spec.Shared.FailureMode, "err", err)
	}
	if ev&decide.Expired != 0 {
		log.Warn("shared budget unreachable for a lease: admitting nothing new, since its slots may have expired in Redis")
	}
	if ev&decide.Recovered != 0 {
		log.Info("shared budget reachable again")
	}
	if ev&decide.StateLost != 0 {
		log.Warn("Redis lost the shared budget's state; growth frozen for a lease while hosts take back what they hold")
	}
	if ev&decide.Unconfirmed != 0 {
		log.Warn("replicas did not confirm a grant in time; not used", "replicas", l.spec.Shared.Replicas)
	}
}

// sameRedis reports whether two shares name one budget in one Redis.
func (l *shareLoop) sameRedis(o *shareLoop) bool {
	return l.spec.Shared.Key == o.spec.Shared.Key && l.spec.Shared.Redis == o.spec.Shared.Redis
}

// newShare makes the share of a valid shared rule at now; start runs it.
func (t *table) newShare(r policy.Rule, now time.Time) (share, error) {
	client, err := t.redis.get(r.Shared.Redis)
	if err != nil {
		return nil, err
	}
	env := shareEnv{dp: t.dp, write: t.writeShare, log: t.log}
	switch l := r.Limit.(type) {
	case policy.Concurrency:
		return newSlotShare(env, r, client, t.cfg.HostID, int(l), now)
	case policy.PerSecond, policy.PerWindow:
		return newGrantShare(env, r, client, now)
	}
	return nil, fmt.Errorf("a %T limit cannot be shared", r.Limit)
}

func shareMode(m string) decide.Mode {
	switch m {
	case policy.FailureAllow:
		return decide.Allow
	case policy.FailureDeny:
		return decide.Deny
	}
	return decide.KeepShare
}

// after is the instant a tick that runs at now has reached: now plus the
// time since began, its own reading of the clock as it started, a call to
// Redis's included.
func after(now, began time.Time) time.Time { return now.Add(time.Since(began)) }

// batchOf is shareBatchTime of perSecond, at least 1 and at most most.
func batchOf(perSecond float64, most uint64) uint64 {
	b := uint64(math.Ceil(perSecond * shareBatchTime.Seconds()))
	return max(1, min(b, most))
}

// redisClients are the daemon's Redis clients, one per URL, which the
// shares of the rules naming it use together.
type redisClients struct {
	mu    sync.Mutex
	byURL map[string]redis.UniversalClient
}

func newRedisClients() *redisClients {
	return &redisClients{byURL: map[string]redis.UniversalClient{}}
}

// get returns the client for a Redis URL. Calls fail fast and are not
// retried: a share's next tick is the retry, and a lost reply may have
// spent a permit.
func (c *redisClients) get(url string) (redis.UniversalClient, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if rc, ok := c.byURL[url]; ok {
		return rc, nil
	}
	rc, err := shared.OpenRedis(url, shared.RedisTimeouts{Dial: shareCallTimeout, Read: shareCallTimeout, Write: shareCallTimeout, PoolSize: 4})
	if err != nil {
		return nil, fmt.Errorf("shared.redis: %w", err)
	}
	c.byURL[url] = rc
	return rc, nil
}

func (c *redisClients) close() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for url, rc := range c.byURL {
		rc.Close()
		delete(c.byURL, url)
	}
}

// endShares stops every share's loop. Their slots go back only when the
// datapath goes too (release); otherwise the kernel keeps enforcing them,
// so they stay claimed until their leases run out or a restarted daemon
// takes them.
func (t *table) endShares(release bool) {
	t.mu.Lock()
	var shares []share
	for _, e := range t.entries {
		if e.share != nil {
			shares = append(shares, e.share)
		}
	}
	t.mu.Unlock()
	for _, s := range shares {
		s.end(release, 0) // with release, the datapath and its connections' counts go too
	}
}

// writeShare writes a share's rule to the kernel as the share shapes it
// now, if that changes it. It reports whether the kernel enforces the
// share: false when the rule is not installed (pending, or replaced by
// another share) or the write failed.
func (t *table) writeShare(s share) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	e, ok := t.entries[s.name()]
	if !ok || e.share != s || !e.installed() || e.base == nil {
		return false
	}
	r := *e.base
	s.shape(&r)
	if r.SameLimit(e.kernel) { // shape changes only the limit
		return true
	}
	if err := t.dp.Put(r); err != nil {
		t.log.Error("write shared rule", "rule", s.name(), "err", err)
		return false
	}
	e.kernel = r
	return true
}

// shareView is what the API and the metrics show of a share.
type shareView struct {
	rate        bool
	slots       decide.SlotsView
	grants      decide.GrantsView
	outage      decide.Outage
	answered    bool
	frozen      bool
	errors      uint64
	lost        uint64
	unconfirmed uint64 // a concurrency share's growth left unused
	mode        string
	settings    policy.Shared
}

// baseView is the view's common part; call with l.mu held.
func (l *shareLoop) baseView() shareView {
	v := shareView{errors: l.errors, lost: l.lost, unconfirmed: l.unconfirmed, answered: l.answered,
		mode: l.spec.Shared.FailureMode, settings: l.spec.Shared}
	if v.mode == "" {
		v.mode = policy.FailureThrow
	}
	return v
}

// control is the share as the API shows it.
func (v shareView) control(st loader.Stats) *control.Share {
	out := &control.Share{Key: v.settings.Key, FailureMode: v.mode, Durability: v.settings.Durability, Replicas: v.settings.Replicas,
		Reachable: v.answered && !v.outage.Failing(), Waiting: !v.answered}
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
