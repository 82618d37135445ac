package shared

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/internal/redistest"
	"github.com/egressd/egressd/pkg/sdk"
	"github.com/redis/go-redis/v9"
)

// step calls s.Resize with r and fails the test unless it holds held and
// growth is frozen (or not) as want says.
func step(t *testing.T, s *Slots, r SlotsRequest, held int, frozen bool) SlotsReply {
	t.Helper()
	got, err := s.Resize(context.Background(), r)
	if err != nil {
		t.Fatalf("Resize(%+v): %v", r, err)
	}
	if got.Held != held || (got.Frozen > 0) != frozen {
		t.Fatalf("Resize(%+v) = %+v; want %d held, frozen %v", r, got, held, frozen)
	}
	return got
}

// TestSlotsEpochEphemeral: a budget Redis has no record of freezes for a
// lease, its first use too; while frozen a holder takes back only its
// prior, nothing grows, and Limiters on the key are refused until the
// freeze ends; Redis losing the state (a restart without persistence)
// starts another freeze with a new epoch.
func TestSlotsEpochEphemeral(t *testing.T) {
	s := redistest.Start(t)
	c := s.Client(t)
	const lease = time.Second
	opts := func(h string) SlotsOptions {
		return SlotsOptions{Key: t.Name(), Permits: 4, Holder: h, LeaseDuration: lease, Durability: Ephemeral}
	}
	a, err := NewSlots(c, opts("a"))
	if err != nil {
		t.Fatal(err)
	}
	b, err := NewSlots(c, opts("b"))
	if err != nil {
		t.Fatal(err)
	}
	l := newLimiter(t, s, Options{Key: t.Name(), Concurrency: &ConcurrencyOptions{Permits: 4, LeaseDuration: lease}})

	first := step(t, a, SlotsRequest{Want: 2, Demand: 2}, 0, true) // first use: frozen
	if first.Frozen > lease {
		t.Errorf("frozen for %v, want at most the lease, %v", first.Frozen, lease)
	}
	_, err = l.Acquire(context.Background())
	if rl, ok := sdk.AsRateLimited(err); !ok || rl.RetryAfter <= 0 || rl.RetryAfter > lease {
		t.Errorf("Acquire while frozen = %v, want a refusal with a RetryAfter within the lease", err)
	}
	awaitThaw(t, c, t.Name())
	step(t, a, SlotsRequest{Want: 2, Demand: 2}, 2, false)
	step(t, b, SlotsRequest{Want: 2, Demand: 2}, 2, false)
	epoch := step(t, a, SlotsRequest{Want: 2, Demand: 2}, 2, false).Epoch

	// Redis loses everything.
	s.Stop()
	s.Restart()
	lost := step(t, a, SlotsRequest{Want: 3, Demand: 3, Prior: 2, HadState: true}, 2, true)
	if lost.Epoch == epoch {
		t.Errorf("epoch %d after Redis lost the state, the same as before", lost.Epoch)
	}
	// b comes back later, within the freeze: it takes back its prior,
	// and not one more, although there is room.
	step(t, b, SlotsRequest{Want: 4, Demand: 4, Prior: 2, HadState: true}, 2, true)
	// A holder with nothing before gets nothing while frozen.
	fresh, err := NewSlots(c, opts("fresh"))
	if err != nil {
		t.Fatal(err)
	}
	step(t, fresh, SlotsRequest{Want: 1, Demand: 1}, 0, true)
	if _, err := l.Acquire(context.Background()); !sdk.IsRateLimited(err) {
		t.Errorf("Acquire while frozen after the loss = %v, want a refusal", err)
	}
	// Renewed as a daemon would, every eighth of the lease on Redis's
	// clock, while the freeze has a while to run: nothing grows. Then it
	// ends.
	for at := redisTime(t, c); frozenFor(t, c, t.Name()) > lease/4; awaitRedisTime(t, c, at) {
		step(t, a, SlotsRequest{Want: 3, Demand: 3, Prior: 2, HadState: true}, 2, true)
		step(t, b, SlotsRequest{Want: 2, Demand: 4, Prior: 2, HadState: true}, 2, true)
		step(t, fresh, SlotsRequest{Want: 1, Demand: 1}, 0, true)
		at = at.Add(lease / 8)
	}
	awaitThaw(t, c, t.Name())
	// Thawed: fair shares again. Demands 3, 4 and 1 split the 4 as 1, 1
	// and 2: a and b are above theirs and give back as they drain; fresh
	// grows as they do.
	step(t, a, SlotsRequest{Want: 3, Demand: 3, HadState: true}, 2, false)
	step(t, fresh, SlotsRequest{Want: 1, Demand: 1}, 0, false)
	step(t, b, SlotsRequest{Want: 1, Demand: 4, HadState: true}, 1, false)
	step(t, fresh, SlotsRequest{Want: 1, Demand: 1}, 1, false)
}

// TestSlotsEpochPersistent: with a persistent Redis a budget it has no
// record of is new (no freeze) for a holder that held nothing, and one
// that held slots still freezes it; a restart that reads the AOF back
// keeps the epoch and the slots, and freezes nothing.
func TestSlotsEpochPersistent(t *testing.T) {
	s := redistest.StartWith(t, redistest.Config{AOF: true})
	c := s.Client(t)
	const lease = 5 * time.Second
	opts := func(h string) SlotsOptions {
		return SlotsOptions{Key: t.Name(), Permits: 4, Holder: h, LeaseDuration: lease, Durability: Persistent}
	}
	a, err := NewSlots(c, opts("a"))
	if err != nil {
		t.Fatal(err)
	}
	epoch := step(t, a, SlotsRequest{Want: 3, Demand: 3}, 3, false).Epoch

	s.Stop() // SIGKILL: what the AOF has is what comes back
	s.Restart()
	again := step(t, a, SlotsRequest{Want: 3, Demand: 3, Prior: 3, HadState: true}, 3, false)
	if again.Epoch != epoch {
		t.Errorf("epoch %d after a restart from the AOF, was %d", again.Epoch, epoch)
	}
	// The state is lost all the same (FLUSHALL): a holder that held
	// slots says so, and the budget freezes.
	if _, err := s.Do("FLUSHALL"); err != nil {
		t.Fatal(err)
	}
	step(t, a, SlotsRequest{Want: 4, Demand: 4, Prior: 3, HadState: true}, 3, true)
}

// TestLimiterAfterLossWaitsForHolders: Redis restarts empty while a
// holder's kernel holds every slot, and a Concurrency Limiter asks before
// the holder comes back. The Limiter makes the epoch, frozen, and is
// refused: the holder takes its slots back, and the budget is never held
// twice over.
func TestLimiterAfterLossWaitsForHolders(t *testing.T) {
	s := redistest.Start(t)
	c := s.Client(t)
	const lease = time.Second
	a, err := NewSlots(c, SlotsOptions{Key: t.Name(), Permits: 4, Holder: "a", LeaseDuration: lease, Durability: Ephemeral})
	if err != nil {
		t.Fatal(err)
	}
	l, err := New(c, Options{Key: t.Name(), Concurrency: &ConcurrencyOptions{Permits: 4, LeaseDuration: lease, Holders: true, Durability: Ephemeral}})
	if err != nil {
		t.Fatal(err)
	}
	step(t, a, SlotsRequest{Want: 4, Demand: 4}, 0, true)
	awaitThaw(t, c, t.Name())
	step(t, a, SlotsRequest{Want: 4, Demand: 4}, 4, false) // a's kernel holds 4 connections

	s.Stop()
	s.Restart()
	for range 4 {
		_, err := l.Acquire(context.Background())
		if rl, ok := sdk.AsRateLimited(err); !ok || rl.RetryAfter <= 0 || rl.RetryAfter > lease {
			t.Fatalf("Acquire after Redis lost the state = %v, want a refusal until the freeze ends", err)
		}
	}
	step(t, a, SlotsRequest{Want: 4, Demand: 4, Prior: 4, HadState: true}, 4, true)
}

// TestLimiterMakesEpoch: a Concurrency Limiter with Holders that finds no
// epoch makes it as a holder that never held slots would: frozen for a
// lease when Redis may lose state, its first use too, and not when it is
// persistent. Without Holders it leaves the epoch to them and admits.
func TestLimiterMakesEpoch(t *testing.T) {
	const lease = time.Second
	tests := []struct {
		name       string
		holders    bool
		durability Durability
		frozen     bool // the Limiter's first Acquire refused
		// What the holder's first Resize then finds.
		held         int
		holderFrozen bool
	}{
		{"holders ephemeral", true, Ephemeral, true, 0, true},
		{"holders persistent", true, Persistent, false, 3, false},
		// The holder makes the epoch, frozen: its first use.
		{"limiters alone", false, Ephemeral, false, 0, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := redistest.Start(t).Client(t)
			l, err := New(c, Options{Key: t.Name(), Concurrency: &ConcurrencyOptions{Permits: 4, LeaseDuration: lease, Holders: tt.holders, Durability: tt.durability}})
			if err != nil {
				t.Fatal(err)
			}
			a, err := NewSlots(c, SlotsOptions{Key: t.Name(), Permits: 4, Holder: "a", LeaseDuration: lease, Durability: tt.durability})
			if err != nil {
				t.Fatal(err)
			}
			_, err = l.Acquire(context.Background())
			if refused := sdk.IsRateLimited(err); refused != tt.frozen || (!refused && err != nil) {
				t.Errorf("first Acquire = %v, want refused %v", err, tt.frozen)
			}
			// The holder finds the epoch the Limiter made, or makes it.
			step(t, a, SlotsRequest{Want: 3, Demand: 3}, tt.held, tt.holderFrozen)
		})
	}
}

// TestSlotsReplicas: with Replicas 1, a Resize says whether a replica has
// it; with the replica gone it says no, after waiting ReplicaWait.
func TestSlotsReplicas(t *testing.T) {
	primary := redistest.Start(t)
	replica := redistest.StartWith(t, redistest.Config{ReplicaOf: primary})
	primary.WaitReplica(t, replica)
	c := primary.Client(t)
	// Long enough for a loaded machine to confirm; the short one is for
	// the replica that never will.
	const wait, short = 2 * time.Second, 50 * time.Millisecond
	opts := SlotsOptions{Permits: 4, Holder: "a", LeaseDuration: 5 * time.Second, Replicas: 1, ReplicaWait: wait}
	s := newSlots(t, c, opts)
	r, err := s.Resize(context.Background(), SlotsRequest{Want: 2, Demand: 2})
	if err != nil || r.Held != 2 || !r.Confirmed {
		t.Fatalf("Resize with a replica = %+v, %v; want 2 held, confirmed", r, err)
	}
	g, err := NewGrants(c, GrantsOptions{Key: t.Name() + ":rate", TokenBucket: &TokenBucketOptions{TokenLimit: 10, TokensPerPeriod: 10, ReplenishmentPeriod: time.Second}, Replicas: 1, ReplicaWait: wait})
	if err != nil {
		t.Fatal(err)
	}
	if cl, err := g.Claim(context.Background(), 3); err != nil || cl.Got != 3 || !cl.Confirmed {
		t.Fatalf("Claim with a replica = %+v, %v; want 3, confirmed", cl, err)
	}

	replica.Stop()
	opts.ReplicaWait = short
	s = newSlots(t, c, opts)
	start := time.Now()
	r, err = s.Resize(context.Background(), SlotsRequest{Want: 3, Demand: 3})
	if err != nil || r.Held != 3 || r.Confirmed {
		t.Fatalf("Resize with the replica gone = %+v, %v; want 3 held, unconfirmed", r, err)
	}
	if waited := time.Since(start); waited < short {
		t.Errorf("an unconfirmed Resize returned after %v, before ReplicaWait (%v)", waited, short)
	}
	g, err = NewGrants(c, GrantsOptions{Key: t.Name() + ":rate", TokenBucket: &TokenBucketOptions{TokenLimit: 10, TokensPerPeriod: 10, ReplenishmentPeriod: time.Second}, Replicas: 1, ReplicaWait: short})
	if err != nil {
		t.Fatal(err)
	}
	if cl, err := g.Claim(context.Background(), 3); err != nil || cl.Got != 3 || cl.Confirmed {
		t.Fatalf("Claim with the replica gone = %+v, %v; want 3, unconfirmed", cl, err)
	}

	// A client that cannot pipeline cannot wait for replicas.
	if _, err := NewSlots(onlyScripts{c}, SlotsOptions{Key: "k", Permits: 1, Holder: "h", Replicas: 1}); err == nil {
		t.Error("NewSlots with Replicas and a client that cannot pipeline succeeded")
	}
}

// onlyScripts hides every method of a client but running scripts.
type onlyScripts struct{ redis.Scripter }

// TestLimiterCooldownWhileRedisHangs: a hung Redis (its process stopped)
// costs the first Acquire a timeout; the calls of the next StoreCooldown
// get the failure mode at once without asking it, and the first call
// after the cooldown asks again and finds it back.
func TestLimiterCooldownWhileRedisHangs(t *testing.T) {
	s := redistest.Start(t)
	c := redis.NewClient(&redis.Options{Addr: s.Addr(), MaxRetries: -1, ReadTimeout: 200 * time.Millisecond, PoolSize: 4})
	t.Cleanup(func() { c.Close() })
	var sent scriptsSent
	c.AddHook(&sent)
	const cooldown = 2 * time.Second
	opts := func(key string, mode FailureMode) Options {
		return Options{Key: key, FailureMode: mode, StoreCooldown: cooldown, TokenBucket: &TokenBucketOptions{TokenLimit: 100, TokensPerPeriod: 100, ReplenishmentPeriod: time.Second}}
	}
	throw, err := New(c, opts("throw", Throw))
	if err != nil {
		t.Fatal(err)
	}
	deny, err := New(c, opts("deny", Deny))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range []*Limiter{throw, deny} {
		if _, err := l.Acquire(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	before := sent.Load()

	s.Pause()
	if _, err := throw.Acquire(context.Background()); !errors.Is(err, ErrStore) {
		t.Fatalf("Acquire from a hung Redis = %v, want a *StoreError", err)
	}
	for range 50 {
		_, err := throw.Acquire(context.Background())
		if !errors.Is(err, ErrStore) || !strings.Contains(err.Error(), "not asked") {
			t.Fatalf("Acquire in the cooldown = %v, want a *StoreError without asking", err)
		}
	}
	if _, err := deny.Acquire(context.Background()); !sdk.IsRateLimited(err) {
		t.Fatalf("Deny's first Acquire from a hung Redis = %v, want a refusal", err)
	}
	if _, err := deny.Acquire(context.Background()); !sdk.IsRateLimited(err) || !strings.Contains(err.Error(), "not asked") {
		t.Fatalf("Deny's Acquire in the cooldown = %v, want a refusal without asking", err)
	}
	s.Resume()
	if n := sent.Load() - before; n != 2 {
		t.Errorf("the client sent Redis %d scripts for the 53 Acquires of the outage, want the 2 that timed out", n)
	}
	awaitCooled(t, throw, deny)
	for _, l := range []*Limiter{throw, deny} {
		if _, err := l.Acquire(context.Background()); err != nil {
			t.Errorf("Acquire after the cooldown, Redis back: %v", err)
		}
	}
}

// TestSlotsStateDropped: Redis dropping the keys of a budget that have an
// expiry while sparing its epoch, which has none (evicted under a
// maxmemory policy of volatile-*, deleted), has lost the budget's state as
// a restart without persistence would: the budget begins anew, frozen,
// whoever calls first - a holder that never held slots, a Limiter - and
// though Redis is said to be persistent, so that the slots a holder's
// kernel still uses are not handed out again. Keys that expired because
// every holder left are no loss.
func TestSlotsStateDropped(t *testing.T) {
	const lease = 2 * time.Second
	del := func(suffix string) func(*testing.T, *redistest.Server, string) {
		return func(t *testing.T, s *redistest.Server, key string) {
			if suffix != "" {
				key = companion(key, suffix)
			}
			if n, err := s.Do("DEL", key); err != nil || n != int64(1) {
				t.Fatalf("DEL %s = %v, %v; want 1", key, n, err)
			}
		}
	}
	tests := []struct {
		name    string
		drop    func(t *testing.T, s *redistest.Server, key string)
		limiter bool // a Limiter calls first, not a holder
		frozen  bool
	}{
		{"evicted under maxmemory, a holder first", evictBudget, false, true},
		{"the set deleted, a Limiter first", del(""), true, true},
		{"the counts deleted, a holder first", del(":held"), false, true},
		{"the counts deleted, a Limiter first", del(":held"), true, true},
		{"expired: every holder left", awaitExpiry, false, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := redistest.Start(t)
			c := s.Client(t)
			opts := func(h string) SlotsOptions {
				return SlotsOptions{Key: t.Name(), Permits: 4, Holder: h, LeaseDuration: lease, Durability: Persistent}
			}
			a, err := NewSlots(c, opts("a"))
			if err != nil {
				t.Fatal(err)
			}
			fresh, err := NewSlots(c, opts("fresh"))
			if err != nil {
				t.Fatal(err)
			}
			l := newLimiter(t, s, Options{Key: t.Name(), Concurrency: &ConcurrencyOptions{Permits: 4, LeaseDuration: lease, Holders: true, Durability: Persistent}})
			epoch := step(t, a, SlotsRequest{Want: 3, Demand: 3}, 3, false).Epoch // a's kernel holds 3 connections

			tt.drop(t, s, t.Name())
			if tt.limiter {
				_, err := l.Acquire(context.Background())
				if refused := sdk.IsRateLimited(err); refused != tt.frozen || (!refused && err != nil) {
					t.Fatalf("first Acquire = %v, want refused %v", err, tt.frozen)
				}
			} else {
				want := 4
				if tt.frozen {
					want = 0
				}
				step(t, fresh, SlotsRequest{Want: 4, Demand: 4}, want, tt.frozen)
			}
			if !tt.frozen {
				return
			}
			back := step(t, a, SlotsRequest{Want: 3, Demand: 3, Prior: 3, HadState: true}, 3, true)
			if back.Epoch == epoch {
				t.Errorf("epoch %d after Redis dropped the state, the same as before", back.Epoch)
			}
			step(t, fresh, SlotsRequest{Want: 1, Demand: 1}, 0, true)
			if _, err := l.Acquire(context.Background()); !sdk.IsRateLimited(err) {
				t.Errorf("Acquire while frozen = %v, want a refusal", err)
			}
		})
	}
}

// scriptsSent counts the scripts a client sends: a go-redis hook.
type scriptsSent struct{ atomic.Int64 }

func (*scriptsSent) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *scriptsSent) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if name := cmd.Name(); name == "evalsha" || name == "eval" {
			h.Add(1)
		}
		return next(ctx, cmd)
	}
}

func (*scriptsSent) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// awaitExpiry waits until Redis has let every key of key's budget that has
// an expiry go, as it does once every holder's lease has run out. The
// epoch, which has none, stays.
func awaitExpiry(t *testing.T, s *redistest.Server, key string) {
	t.Helper()
	keys := slices.DeleteFunc(budgetKeys(key), func(k string) bool { return k == epochKey(key) })
	c := s.Client(t)
	clocktest.Eventually(t, "the budget's keys to expire", func() bool {
		n, err := c.Exists(context.Background(), keys...).Result()
		return err == nil && n == 0
	})
}

// evictBudget makes Redis evict key's budget under memory pressure: with
// maxmemory just above what it uses and volatile-ttl, keys written with a
// long expiry push out those nearest theirs, the budget's, until its set is
// gone. The epoch, without an expiry, stays.
func evictBudget(t *testing.T, s *redistest.Server, key string) {
	t.Helper()
	for _, kv := range [][2]string{{"maxmemory-policy", "volatile-ttl"}, {"maxmemory-samples", "64"}} {
		if _, err := s.Do("CONFIG", "SET", kv[0], kv[1]); err != nil {
			t.Fatal(err)
		}
	}
	info, err := s.Do("INFO", "memory")
	if err != nil {
		t.Fatal(err)
	}
	var used int64
	for _, line := range strings.Split(info.(string), "\r\n") {
		if v, ok := strings.CutPrefix(line, "used_memory:"); ok {
			fmt.Sscan(v, &used)
		}
	}
	if _, err := s.Do("CONFIG", "SET", "maxmemory", used+256<<10); err != nil {
		t.Fatal(err)
	}
	filler := strings.Repeat("x", 4<<10)
	for i := 0; ; i++ {
		if n, err := s.Do("EXISTS", key); err != nil || n == int64(0) {
			break
		}
		if i == 10000 {
			t.Fatal("the budget's set was not evicted after 40 MB of other keys")
		}
		if _, err := s.Do("SET", fmt.Sprintf("filler:%d", i), filler, "EX", 3600); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := s.Do("CONFIG", "SET", "maxmemory", 0); err != nil {
		t.Fatal(err)
	}
	if n, err := s.Do("EXISTS", epochKey(key)); err != nil || n != int64(1) {
		t.Fatalf("the epoch was evicted too (EXISTS %v, %v): the test shows nothing", n, err)
	}
}
