package shared

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/internal/redistest"
	"github.com/egressd/egressd/pkg/limit"
	"github.com/egressd/egressd/pkg/sdk"
	"github.com/redis/go-redis/v9"
)

func TestValidate(t *testing.T) {
	tests := []struct {
		name string
		opts Options
		want []string // substrings, one per problem, in order
	}{
		{"zero", Options{}, []string{"Key is required", "no shape"}},
		{"two shapes", Options{Key: "k", FixedWindow: &FixedWindowOptions{1, time.Second}, TokenBucket: &TokenBucketOptions{1, 1, time.Second}},
			[]string{"FixedWindow and TokenBucket are set"}},
		{"fixed", Options{Key: "k", FixedWindow: &FixedWindowOptions{0, time.Microsecond}},
			[]string{"FixedWindow.Permits 0", "FixedWindow.Window 1µs"}},
		{"sliding segments", Options{Key: "k", SlidingWindow: &SlidingWindowOptions{1, time.Second, 1001}},
			[]string{"SlidingWindow.Segments 1001"}},
		{"sliding short", Options{Key: "k", SlidingWindow: &SlidingWindowOptions{0, 999 * time.Millisecond, 1000}},
			[]string{"SlidingWindow.Permits 0", "segments shorter than 1ms"}},
		{"bucket", Options{Key: "k", TokenBucket: &TokenBucketOptions{0, 0, 0}},
			[]string{"TokenLimit 0", "TokensPerPeriod 0", "ReplenishmentPeriod 0s"}},
		{"concurrency", Options{Key: "k", Concurrency: &ConcurrencyOptions{0, 29 * time.Millisecond, true, 2}},
			[]string{"Concurrency.Permits 0", "LeaseDuration 29ms", "Concurrency.Durability 2"}},
		{"common", Options{Key: "k", Concurrency: &ConcurrencyOptions{Permits: 1}, QueueLimit: -1, QueueOrder: 7,
			QueuePollInterval: time.Microsecond, FailureMode: 3, MaxRetries: -2},
			[]string{"QueueLimit -1", "QueueOrder 7", "QueuePollInterval 1µs", "FailureMode 3", "MaxRetries -2"}},
		{"valid", Options{Key: "k", SlidingWindow: &SlidingWindowOptions{1, time.Second, 1000}, MaxRetries: NoRetries}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.opts.Validate()
			oe, _ := AsOptionsError(err)
			var got []string
			if oe != nil {
				got = oe.Problems
			}
			if len(got) != len(tt.want) || (err != nil) != errors.Is(err, ErrInvalidOptions) {
				t.Fatalf("Validate = %v, want problems %q", err, tt.want)
			}
			for i, w := range tt.want {
				if !strings.Contains(got[i], w) {
					t.Errorf("problem %d = %q, want it to contain %q", i, got[i], w)
				}
			}
		})
	}
}

func TestKeyFor(t *testing.T) {
	tests := []struct{ prefix, partition, want string }{
		{"tenant-api", "", "tenant-api"},
		{"tenant-api", "acme", "tenant-api/acme"},
		{"tenant-api", "a/b", "tenant-api/a%2Fb"},
		{"tenant-api", "a%2Fb", "tenant-api/a%252Fb"},
	}
	for _, tt := range tests {
		if got := KeyFor(tt.prefix, tt.partition); got != tt.want {
			t.Errorf("KeyFor(%q, %q) = %q, want %q", tt.prefix, tt.partition, got, tt.want)
		}
	}
}

// The names are the policy's values for a shared rule (pkg/policy's
// FailureThrow…, DurabilityEphemeral…).
func TestNames(t *testing.T) {
	tests := []struct {
		v    interface{ String() string }
		want string
	}{
		{Throw, "throw"},
		{Allow, "allow"},
		{Deny, "deny"},
		{FailureMode(failureModeLen), "FailureMode(3)"},
		{Ephemeral, "ephemeral"},
		{Persistent, "persistent"},
		{Durability(durabilityLen), "Durability(2)"},
	}
	for _, tt := range tests {
		if got := tt.v.String(); got != tt.want {
			t.Errorf("String() = %q, want %q", got, tt.want)
		}
	}
}

func newLimiter(t testing.TB, s *redistest.Server, opts Options) *Limiter {
	t.Helper()
	if opts.Key == "" {
		opts.Key = t.Name()
	}
	l, err := New(s.Client(t), opts)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// hammer runs 16 goroutines calling acquire on l for d, and calls admitted
// with every lease's result, under a lock.
func hammer(t *testing.T, l *Limiter, d time.Duration, admitted func(result)) {
	t.Helper()
	hammerAll(t, l, d, func(r result, ok bool) {
		if ok {
			admitted(r)
		}
	})
}

// hammerAll is hammer telling refusals too (ok false), with the window
// or segment each was decided in.
func hammerAll(t *testing.T, l *Limiter, d time.Duration, decided func(r result, ok bool)) {
	t.Helper()
	var mu sync.Mutex
	var wg sync.WaitGroup
	end := time.Now().Add(d)
	for range 16 {
		wg.Go(func() {
			for time.Now().Before(end) {
				lease, res, err := l.acquire(context.Background())
				if err != nil && !sdk.IsRateLimited(err) {
					t.Errorf("acquire: %v", err)
					return
				}
				lease.Release()
				mu.Lock()
				decided(res, err == nil)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
}

func TestFixedWindowExactPerWindow(t *testing.T) {
	s := startRedis(t)
	const permits = 20
	l := newLimiter(t, s, Options{FixedWindow: &FixedWindowOptions{Permits: permits, Window: 50 * time.Millisecond}})
	counts, refused := map[int64]int{}, map[int64]bool{}
	hammerAll(t, l, 500*time.Millisecond, func(r result, ok bool) {
		if ok {
			counts[r.id]++
		} else {
			refused[r.id] = true
		}
	})
	lo, hi := int64(1<<62), int64(0)
	for id := range counts {
		lo, hi = min(lo, id), max(hi, id)
	}
	if hi-lo < 5 || len(refused) == 0 {
		t.Fatalf("only windows %d..%d seen, %d with refusals", lo, hi, len(refused))
	}
	// A window that refused one was full: it admitted exactly the
	// permits. (One the loaded clients did not fill refused none.)
	for id := lo; id <= hi; id++ {
		c := counts[id]
		if c > permits || (refused[id] && c != permits) {
			t.Errorf("window %d admitted %d (refused some: %v), want at most %d, and %d if it refused any", id, c, refused[id], permits, permits)
		}
	}
}

func TestSlidingWindowNeverExceeds(t *testing.T) {
	s := startRedis(t)
	const permits, n = 20, 5
	l := newLimiter(t, s, Options{SlidingWindow: &SlidingWindowOptions{Permits: permits, Window: 100 * time.Millisecond, Segments: n}})
	counts := map[int64]int{}
	hammer(t, l, 500*time.Millisecond, func(r result) { counts[r.id]++ })
	lo, hi := int64(1<<62), int64(0)
	for id := range counts {
		lo, hi = min(lo, id), max(hi, id)
	}
	full := 0
	for cur := lo; cur <= hi; cur++ {
		sum := 0
		for id := cur - n + 1; id <= cur; id++ {
			sum += counts[id]
		}
		if sum > permits {
			t.Errorf("segments %d..%d admitted %d, over %d", cur-n+1, cur, sum, permits)
		}
		if sum == permits {
			full++
		}
	}
	if full == 0 {
		t.Errorf("no window was ever full: %v", counts)
	}
}

// bucketLimit, bucketPer and bucketPeriod make a bucket that takes 10 s to
// fill: once emptied, it loses no refill to a stall of the machine shorter
// than that, so that what is spent after it was emptied can be held to
// every refill, whatever the load. (A small bucket fills within a stall
// and drops the refills meanwhile: a bound of half of them failed on a
// loaded machine, 44 spent of 50.)
const bucketLimit, bucketPer, bucketPeriod = 2000, 1, 5 * time.Millisecond

// checkRefill checks a bucket's spending, timed around the calls (on the
// server's clock, or the wall clock of the machine it runs on): all tokens spent from t0, before the bucket was made (full), to t3, after
// the last refusal, are at most the bucket and its refills; those spent
// after t1, once a refusal had emptied it, until a refusal that came after
// t2 emptied it again, are at least every refill from t1 to t2.
func checkRefill(t *testing.T, all, after int, t0, t1, t2, t3 time.Time) {
	t.Helper()
	if most := bucketLimit + int(t3.Sub(t0)/bucketPeriod)*bucketPer; all > most {
		t.Errorf("spent %d tokens in %v, more than %d", all, t3.Sub(t0), most)
	}
	if least := int(t2.Sub(t1)/bucketPeriod) * bucketPer; after < least {
		t.Errorf("spent %d tokens in %v after the bucket was emptied, fewer than its %d refills", after, t2.Sub(t1), least)
	}
	t.Logf("spent %d tokens in %v, %d after the bucket was emptied", all, t3.Sub(t0), after)
}

func redisTime(t *testing.T, c *redis.Client) time.Time {
	t.Helper()
	now, err := c.Time(context.Background()).Result()
	if err != nil {
		t.Fatal(err)
	}
	return now
}

// drainBucket acquires from l until it refuses, and returns how many it
// got.
func drainBucket(t *testing.T, l *Limiter) int {
	t.Helper()
	for n := 0; ; n++ {
		lease, err := l.Acquire(context.Background())
		if sdk.IsRateLimited(err) {
			return n
		}
		if err != nil {
			t.Fatal(err)
		}
		lease.Release()
	}
}

func TestTokenBucketSpendsAtMostLimitPlusRefill(t *testing.T) {
	s := startRedis(t)
	l := newLimiter(t, s, Options{TokenBucket: &TokenBucketOptions{TokenLimit: bucketLimit, TokensPerPeriod: bucketPer, ReplenishmentPeriod: bucketPeriod}})
	c := s.Client(t)
	t0 := redisTime(t, c)
	all := drainBucket(t, l)
	t1 := redisTime(t, c)
	after := 0
	hammer(t, l, 400*time.Millisecond, func(result) { after++ })
	t2 := redisTime(t, c)
	after += drainBucket(t, l)
	t3 := redisTime(t, c)
	checkRefill(t, all+after, after, t0, t1, t2, t3)
}

func TestConcurrencyNeverExceeds(t *testing.T) {
	s := startRedis(t)
	const permits, rounds = 4, 100
	l := newLimiter(t, s, Options{Concurrency: &ConcurrencyOptions{Permits: permits, LeaseDuration: time.Second}})
	var held, most atomic.Int64
	// A lease is held until the limiter refuses someone while every permit
	// is held on this side too: proof that the budget is reached, so that
	// it is seen reached in every round, and a limiter that admits one
	// too many is seen to. (A refusal as such can come before the last
	// lease's holder has counted it, which a loaded machine made common.)
	var mu sync.Mutex
	refusal := make(chan struct{}) // closed at the next refusal, a round's end
	var ended atomic.Int64         // rounds
	refused := func() {
		mu.Lock()
		defer mu.Unlock()
		if held.Load() >= permits {
			close(refusal)
			refusal = make(chan struct{})
			ended.Add(1)
		}
	}
	over := make(chan struct{})
	var wg sync.WaitGroup
	stop := sync.OnceFunc(func() { close(over); wg.Wait() })
	t.Cleanup(stop)
	for range 16 {
		wg.Go(func() {
			for {
				select {
				case <-over:
					return
				default:
				}
				lease, err := l.Acquire(context.Background())
				if err != nil {
					if rl, ok := sdk.AsRateLimited(err); !ok || rl.RetryAfter != 0 {
						t.Errorf("acquire: %v", err)
						return
					}
					refused()
					continue
				}
				mu.Lock()
				next := refusal
				mu.Unlock()
				n := held.Add(1)
				for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
				}
				select {
				case <-next:
				case <-over:
				}
				held.Add(-1)
				lease.Release()
			}
		})
	}
	// Rounds, not a time: a loaded machine plays as many.
	clocktest.Eventually(t, fmt.Sprint(rounds, " rounds of the budget held and a refusal"), func() bool { return ended.Load() >= rounds })
	stop()
	if m := most.Load(); m != permits {
		t.Errorf("at most %d leases held at once, want %d", m, permits)
	}
	st := l.Statistics()
	if st.SuccessfulLeases == 0 || st.FailedLeases == 0 || st.QueuedPermits != 0 {
		t.Errorf("statistics %+v", st)
	}
}

func TestConcurrencyLeaseExpiryFreesCapacity(t *testing.T) {
	s := startRedis(t)
	lease := 60 * time.Millisecond
	l := newLimiter(t, s, Options{Concurrency: &ConcurrencyOptions{Permits: 1, LeaseDuration: lease}})
	// A holder in another process that died without releasing.
	c := s.Client(t)
	if err := concurrencyLua.Run(context.Background(), l.client, l.keys, append(slices.Clip(l.args), "dead")...).Err(); err != nil {
		t.Fatal(err)
	}
	died := redisTime(t, c)
	if _, err := l.Acquire(context.Background()); !sdk.IsRateLimited(err) {
		t.Fatalf("Acquire with the dead holder's lease live = %v, want a refusal", err)
	}
	// Its lease ran from no later than died, on Redis's clock.
	awaitRedisTime(t, c, died.Add(lease))
	ls, err := l.Acquire(context.Background())
	if err != nil {
		t.Fatalf("Acquire after the dead holder's lease expired: %v", err)
	}
	ls.Release()
}

func TestConcurrencyRenewalKeepsLease(t *testing.T) {
	s := startRedis(t)
	// Renewed every third of the lease: a loaded machine (load averages of
	// 20 on two cores were seen here) must stall the renewal for over a
	// second to lose it.
	l := newLimiter(t, s, Options{Concurrency: &ConcurrencyOptions{Permits: 1, LeaseDuration: 2 * time.Second}})
	c := s.Client(t)
	held, err := l.Acquire(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	awaitRedisTime(t, c, redisTime(t, c).Add(5*time.Second)) // two and a half lease durations
	if _, err := l.Acquire(context.Background()); !sdk.IsRateLimited(err) {
		t.Fatalf("Acquire while a renewed lease is held = %v, want a refusal", err)
	}
	held.Release()
	held.Release() // a second call does nothing
	again, err := l.Acquire(context.Background())
	if err != nil {
		t.Fatalf("Acquire after Release: %v", err)
	}
	again.Release()
}

func TestFailureModes(t *testing.T) {
	s := startRedis(t)
	const cooldown = 50 * time.Millisecond
	opts := func(m FailureMode) Options {
		return Options{Key: "modes", FailureMode: m, StoreCooldown: cooldown, TokenBucket: &TokenBucketOptions{TokenLimit: 100, TokensPerPeriod: 1, ReplenishmentPeriod: time.Second}}
	}
	throw := newLimiter(t, s, opts(Throw))
	allow := newLimiter(t, s, opts(Allow))
	deny := newLimiter(t, s, opts(Deny))
	for _, l := range []*Limiter{throw, allow, deny} {
		if _, err := l.Acquire(context.Background()); err != nil {
			t.Fatalf("%v with Redis up: %v", l.mode, err)
		}
	}

	s.Stop()
	if _, err := throw.Acquire(context.Background()); !errors.Is(err, ErrStore) || sdk.IsRateLimited(err) {
		t.Errorf("Throw with Redis down = %v, want a *StoreError", err)
	}
	if _, err := allow.Acquire(context.Background()); err != nil {
		t.Errorf("Allow with Redis down = %v, want a lease", err)
	}
	_, err := deny.Acquire(context.Background())
	if rl, ok := sdk.AsRateLimited(err); !ok || !errors.Is(err, ErrStore) || rl.RetryAfter != 0 {
		t.Errorf("Deny with Redis down = %v, want a refusal wrapping a *StoreError", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	for _, l := range []*Limiter{throw, allow, deny} {
		if _, err := l.Acquire(ctx); !errors.Is(err, context.Canceled) || errors.Is(err, ErrStore) {
			t.Errorf("%v, cancelled, with Redis down = %v, want context.Canceled", l.mode, err)
		}
	}
	// Deny with a queue keeps a caller waiting through the outage, until
	// its context ends.
	q := newLimiter(t, s, Options{Key: "modes-q", FailureMode: Deny, QueueLimit: 1, QueuePollInterval: 5 * time.Millisecond,
		Concurrency: &ConcurrencyOptions{Permits: 1}})
	ctx, cancel = context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if _, err := q.Acquire(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("queued Deny with Redis down = %v, want its deadline", err)
	}

	s.Restart()
	awaitCooled(t, throw, allow, deny) // until the limiters ask again
	for _, l := range []*Limiter{throw, allow, deny} {
		if _, err := l.Acquire(context.Background()); err != nil {
			t.Errorf("%v after Redis came back: %v", l.mode, err)
		}
	}
	if st := throw.Statistics(); st.SuccessfulLeases != 2 || st.FailedLeases != 2 {
		t.Errorf("Throw statistics %+v, want 2 and 2", st)
	}
}

func TestConcurrencyQueue(t *testing.T) {
	s := startRedis(t)
	l := newLimiter(t, s, Options{Concurrency: &ConcurrencyOptions{Permits: 1, LeaseDuration: time.Second}, QueueLimit: 2, QueuePollInterval: time.Second})
	first, err := l.Acquire(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan int, 2)
	cancelled, cancel := context.WithCancel(context.Background())
	errs := make(chan error, 1)
	go func() {
		_, err := l.Acquire(cancelled)
		errs <- err
	}()
	waitQueued(t, l, 1)
	go func() {
		ls, err := l.Acquire(context.Background())
		if err != nil {
			t.Error(err)
		}
		got <- 2
		ls.Release()
	}()
	waitQueued(t, l, 2)
	if _, err := l.Acquire(context.Background()); !errors.Is(err, limit.ErrQueueFull) || !sdk.IsRateLimited(err) {
		t.Errorf("Acquire with the queue full = %v, want ErrQueueFull", err)
	}
	cancel()
	if err := <-errs; !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled waiter = %v", err)
	}
	waitQueued(t, l, 1)
	start := time.Now()
	first.Release() // wakes the waiter at once, not after the poll interval
	<-got
	if d := time.Since(start); d > 500*time.Millisecond {
		t.Errorf("waiter took %v after a local Release", d)
	}
	waitQueued(t, l, 0)
}

func waitQueued(t *testing.T, l *Limiter, n int) {
	t.Helper()
	clocktest.Eventually(t, fmt.Sprint(n, " queued"), func() bool { return l.Statistics().QueuedPermits == n })
}

func TestWindowQueueWaitsRetryAfter(t *testing.T) {
	s := startRedis(t)
	l := newLimiter(t, s, Options{FixedWindow: &FixedWindowOptions{Permits: 2, Window: 50 * time.Millisecond}, QueueLimit: 8})
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			if _, err := l.Acquire(ctx); err != nil {
				t.Errorf("queued Acquire: %v", err)
			}
		})
	}
	wg.Wait()
	if st := l.Statistics(); st.SuccessfulLeases != 8 || st.QueuedPermits != 0 {
		t.Errorf("statistics %+v", st)
	}
}

func TestRefusalRetryAfter(t *testing.T) {
	s := startRedis(t)
	tests := []struct {
		name string
		opts Options
		max  time.Duration
	}{
		{"fixed", Options{FixedWindow: &FixedWindowOptions{1, time.Second}}, time.Second},
		{"sliding", Options{SlidingWindow: &SlidingWindowOptions{1, time.Second, 10}}, time.Second},
		{"bucket", Options{TokenBucket: &TokenBucketOptions{1, 1, time.Second}}, time.Second},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for attempt := 1; ; attempt++ {
				opts := tt.opts
				opts.Key = fmt.Sprint(t.Name(), "/", attempt)
				l := newLimiter(t, s, opts)
				start := time.Now()
				if _, err := l.Acquire(context.Background()); err != nil {
					t.Fatal(err)
				}
				_, err := l.Acquire(context.Background())
				// Fixed windows are whole seconds of Redis's clock, this
				// host's: two calls either side of a second's end are two
				// windows' first permits, and are made again.
				if tt.opts.FixedWindow != nil && err == nil && start.Unix() != time.Now().Unix() && attempt < 5 {
					continue
				}
				rl, ok := sdk.AsRateLimited(err)
				if !ok || rl.RetryAfter <= 0 || rl.RetryAfter > tt.max || rl.Limiter != opts.Key {
					t.Errorf("second Acquire = %v, want a refusal by %s with 0 < RetryAfter ≤ %v", err, opts.Key, tt.max)
				}
				return
			}
		})
	}
}
