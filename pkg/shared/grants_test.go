package shared

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/egressd/egressd/internal/redistest"
	"github.com/egressd/egressd/pkg/sdk"
	"github.com/redis/go-redis/v9"
)

func TestGrantsValidate(t *testing.T) {
	tests := []struct {
		name string
		opts GrantsOptions
		want []string // substrings, one per problem, in order
	}{
		{"zero", GrantsOptions{}, []string{"Key is required", noGrantsShape}},
		{"two shapes", GrantsOptions{Key: "k", SlidingWindow: &SlidingWindowOptions{1, time.Second, 1}, TokenBucket: &TokenBucketOptions{1, 1, time.Second}},
			[]string{"SlidingWindow and TokenBucket are set"}},
		{"bucket", GrantsOptions{TokenBucket: &TokenBucketOptions{0, -1, time.Microsecond}},
			[]string{"Key is required", "TokenLimit 0", "TokensPerPeriod -1", "ReplenishmentPeriod 1µs"}},
		{"sliding", GrantsOptions{Key: "k", SlidingWindow: &SlidingWindowOptions{0, 0, 0}},
			[]string{"SlidingWindow.Permits 0", "SlidingWindow.Segments 0", "SlidingWindow.Window 0s"}},
		{"valid bucket", GrantsOptions{Key: "k", TokenBucket: &TokenBucketOptions{1, 1, time.Millisecond}}, nil},
		{"valid sliding", GrantsOptions{Key: "k", SlidingWindow: &SlidingWindowOptions{1, time.Second, 1000}}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := NewGrants(nil, tt.opts)
			checkProblems(t, err, tt.want)
		})
	}
}

func newGrants(t testing.TB, c redis.Scripter, opts GrantsOptions) *Grants {
	t.Helper()
	if opts.Key == "" {
		opts.Key = t.Name()
	}
	g, err := NewGrants(c, opts)
	if err != nil {
		t.Fatal(err)
	}
	return g
}

// claim calls g.Claim and fails the test unless it got want, with a
// RetryAfter in (0, most] when it got none and 0 otherwise. It returns the
// claim.
func claim(t *testing.T, g *Grants, n, want int, most time.Duration) Claimed {
	t.Helper()
	c, err := g.Claim(context.Background(), n)
	got, retry := c.Got, c.RetryAfter
	if err != nil || !c.Confirmed {
		t.Fatalf("Claim(%d): %v", n, err)
	}
	if got != want || (got == 0) != (retry > 0) || retry > most {
		t.Fatalf("Claim(%d) = %d, retry after %v; want %d, and a retry in (0, %v] only with none", n, got, retry, want, most)
	}
	return c
}

func giveBack(t *testing.T, g *Grants, n int, since int64) {
	t.Helper()
	if err := g.Return(context.Background(), n, since); err != nil {
		t.Fatalf("Return(%d): %v", n, err)
	}
}

func TestGrantsTokenBucketClaimReturn(t *testing.T) {
	s := startRedis(t)
	c := s.Client(t)
	const period = time.Hour // no refill during the test
	g := newGrants(t, c, GrantsOptions{TokenBucket: &TokenBucketOptions{TokenLimit: 10, TokensPerPeriod: 1, ReplenishmentPeriod: period}})
	giveBack(t, g, 5, 0) // to a full (missing) bucket: nothing, and no key
	if n := c.Exists(context.Background(), t.Name()).Val(); n != 0 {
		t.Errorf("Return to a missing bucket created it")
	}
	claim(t, g, 4, 4, 0)
	claim(t, g, 10, 6, 0) // partial
	claim(t, g, 1, 0, period)
	giveBack(t, g, 3, 0)
	claim(t, g, 5, 3, 0)
	giveBack(t, g, 100, 0) // capped at the limit
	// A full bucket expires at once (a missing bucket is full), so the key
	// may be gone already.
	if tokens, err := c.HGet(context.Background(), t.Name(), "t").Result(); err != redis.Nil && tokens != "10" {
		t.Errorf("bucket has %s tokens (%v) after returning 100 to an empty one, want the limit, 10", tokens, err)
	}
	claim(t, g, 100, 10, 0)
}

func TestGrantsTokenBucketSpendsAtMostLimitPlusRefill(t *testing.T) {
	s := startRedis(t)
	c := s.Client(t)
	g := newGrants(t, c, GrantsOptions{TokenBucket: &TokenBucketOptions{TokenLimit: bucketLimit, TokensPerPeriod: bucketPer, ReplenishmentPeriod: bucketPeriod}})
	// As TestTokenBucketSpendsAtMostLimitPlusRefill's, with claims of
	// several at once.
	drain := func() int {
		n := 0
		for {
			cl, err := g.Claim(context.Background(), 5)
			if err != nil {
				t.Fatal(err)
			}
			if cl.Got == 0 {
				return n
			}
			n += cl.Got
		}
	}
	t0 := redisTime(t, c)
	all := drain()
	t1 := redisTime(t, c)
	var mu sync.Mutex
	spent := 0
	var wg sync.WaitGroup
	end := time.Now().Add(400 * time.Millisecond)
	for range 4 {
		wg.Go(func() {
			for time.Now().Before(end) {
				c, err := g.Claim(context.Background(), 1+rand.N(5))
				got := c.Got
				if err != nil {
					t.Errorf("Claim: %v", err)
					return
				}
				mu.Lock()
				spent += got
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	t2 := redisTime(t, c)
	spent += drain()
	t3 := redisTime(t, c)
	checkRefill(t, all+spent, spent, t0, t1, t2, t3)
}

func TestGrantsSlidingWindowClaimReturn(t *testing.T) {
	s := startRedis(t)
	c := s.Client(t)
	const window = 600 * time.Millisecond
	g := newGrants(t, c, GrantsOptions{SlidingWindow: &SlidingWindowOptions{Permits: 10, Window: window, Segments: 3}})
	giveBack(t, g, 5, 0) // nothing counted: nothing to subtract
	claim(t, g, 4, 4, 0)
	claim(t, g, 10, 6, 0) // partial
	last := claim(t, g, 1, 0, window)
	giveBack(t, g, 3, last.Segment)
	claim(t, g, 5, 3, 0)
	retry := claim(t, g, 1, 0, window).RetryAfter
	// RetryAfter is until the oldest counted segment leaves the window, on
	// Redis's clock, from when the claim ran: before this.
	awaitRedisTime(t, c, redisTime(t, c).Add(retry))
	if c, err := g.Claim(context.Background(), 10); err != nil || c.Got == 0 {
		t.Errorf("Claim after its RetryAfter = %d, %v; want some", c.Got, err)
	}
}

// slowWindow returns claims on a sliding window of permits whose segments
// are ten days long: the current one does not change during a test.
func slowWindow(t *testing.T, permits int) (*redis.Client, *Grants) {
	t.Helper()
	c := startRedis(t).Client(t)
	return c, newGrants(t, c, GrantsOptions{SlidingWindow: &SlidingWindowOptions{Permits: permits, Window: 100 * 24 * time.Hour, Segments: 10}})
}

func TestGrantsSlidingWindowReturnsNewestFirst(t *testing.T) {
	c, g := slowWindow(t, 10)
	ctx := context.Background()
	key := t.Name()
	since := claim(t, g, 1, 1, 0).Segment
	fields := c.HKeys(ctx, key).Val()
	if len(fields) != 1 {
		t.Fatalf("window has segments %q after one claim", fields)
	}
	cur, err := strconv.ParseInt(fields[0], 10, 64)
	if err != nil || cur != since {
		t.Fatalf("window counts in segment %q; the claim said %d", fields[0], since)
	}
	seg := func(d int64) string { return strconv.FormatInt(cur-d, 10) }
	// Older claims, made by others.
	c.HSet(ctx, key, seg(2), 3, seg(1), 2)

	giveBack(t, g, 2, since)
	want := map[string]string{seg(2): "3", seg(1): "1"} // cur's 1, then one of cur-1's
	if got := c.HGetAll(ctx, key).Val(); !equalMaps(got, want) {
		t.Errorf("window %v after returning 2, want %v", got, want)
	}
	claim(t, g, 10, 6, 0)
	giveBack(t, g, 100, since) // never below zero
	if n := c.Exists(ctx, key).Val(); n != 0 {
		t.Errorf("window left with %v after returning more than was counted", c.HGetAll(ctx, key).Val())
	}
}

// A returned permit is uncounted in its own segment or an older one,
// never in a newer one: that one counts others' permits, claimed later,
// which would then leave the window early.
func TestGrantsSlidingWindowReturnSparesNewerSegments(t *testing.T) {
	c, g := slowWindow(t, 20)
	ctx := context.Background()
	key := t.Name()
	since := claim(t, g, 2, 2, 0).Segment
	seg := func(d int64) string { return strconv.FormatInt(since+d, 10) }
	// Another host's permits, counted in the next segment and in an older
	// one.
	c.HSet(ctx, key, seg(1), 5, seg(-1), 1)

	giveBack(t, g, 4, since) // its own 2, then the older segment's 1
	want := map[string]string{seg(1): "5"}
	if got := c.HGetAll(ctx, key).Val(); !equalMaps(got, want) {
		t.Errorf("window %v after returning 4 claimed in %d, want %v", got, since, want)
	}
	giveBack(t, g, 4, 0) // no segment is that old
	if got := c.HGetAll(ctx, key).Val(); !equalMaps(got, want) {
		t.Errorf("window %v after returning 4 claimed in segment 0, want %v", got, want)
	}
}

// TestGrantsSlidingWindowReturnKeepsWindow plays the sequence that
// over-admitted when a Return uncounted the newest segments: A claims 5
// and does not spend them, B claims and spends 5 half a window later, A
// returns its 5; once A's segment has left the window, B may claim only
// what B's own 5 leave. The waits are for Redis's clock to reach the
// segments; a machine that stalls for half a window after the last one
// makes the last claim count once B's segment has left too, which its
// segment tells: that claim must then get everything, and the sequence is
// played again, on another key.
func TestGrantsSlidingWindowReturnKeepsWindow(t *testing.T) {
	s := startRedis(t)
	c := s.Client(t)
	const window, segments = time.Second, 10
	// start is when segment id begins, on Redis's clock.
	start := func(id int64) time.Time { return time.UnixMicro(id * (window / segments).Microseconds()) }
	for try := range 3 {
		opts := GrantsOptions{Key: fmt.Sprint(t.Name(), try), SlidingWindow: &SlidingWindowOptions{Permits: 10, Window: window, Segments: segments}}
		a := newGrants(t, c, opts)
		b := newGrants(t, c, opts)
		ca := claim(t, a, 5, 5, 0)
		awaitRedisTime(t, c, start(ca.Segment+segments/2))
		cb := claim(t, b, 5, 5, 0)
		giveBack(t, a, 5, ca.Segment)
		// Once A's segment has left the window, within B's.
		awaitRedisTime(t, c, start(ca.Segment+segments))
		last, err := b.Claim(context.Background(), 10)
		if err != nil {
			t.Fatal(err)
		}
		if last.Segment >= cb.Segment+segments {
			// Nothing claimed is left in the window: all of it is there.
			if last.Got != 10 {
				t.Errorf("B's claim of 10 once every claimed segment left the window got %d; want 10", last.Got)
			}
			t.Logf("try %d: the last claim ran in segment %d, once B's (%d) had left the window too: again", try, last.Segment, cb.Segment)
			continue
		}
		if last.Got != 5 {
			t.Errorf("B's claim of 10 once A's returned segment left the window got %d; want 5, what B's own 5 leave", last.Got)
		}
		return
	}
	t.Fatal("the machine stalled for half a window in every try")
}

func equalMaps(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if bv, ok := b[k]; !ok || bv != v {
			return false
		}
	}
	return true
}

func TestGrantsShareBudgetWithLimiter(t *testing.T) {
	s := startRedis(t)
	c := s.Client(t)
	bucket := &TokenBucketOptions{TokenLimit: 5, TokensPerPeriod: 1, ReplenishmentPeriod: time.Hour}
	sliding := &SlidingWindowOptions{Permits: 5, Window: 100 * 24 * time.Hour, Segments: 10}
	tests := []struct {
		name string
		opts Options
	}{
		{"bucket", Options{TokenBucket: bucket}},
		{"sliding", Options{SlidingWindow: sliding}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			l := newLimiter(t, s, tt.opts)
			g := newGrants(t, c, GrantsOptions{Key: t.Name(), TokenBucket: tt.opts.TokenBucket, SlidingWindow: tt.opts.SlidingWindow})
			acquire := func(ok bool) {
				t.Helper()
				_, err := l.Acquire(context.Background())
				if ok && err != nil {
					t.Fatalf("Acquire: %v", err)
				}
				if rl, refused := sdk.AsRateLimited(err); !ok && (!refused || rl.RetryAfter <= 0) {
					t.Fatalf("Acquire = %v, want a refusal with a RetryAfter", err)
				}
			}
			first := claim(t, g, 3, 3, 0)
			acquire(true) // the Limiter sees the claimed permits spent
			acquire(true)
			acquire(false)
			claim(t, g, 1, 0, 100*24*time.Hour) // and the claims the Limiter's
			giveBack(t, g, 2, first.Segment)
			acquire(true) // returned permits are the Limiter's to spend
			claim(t, g, 3, 1, 0)
			acquire(false)
		})
	}
}

func TestGrantsErrors(t *testing.T) {
	s := startRedis(t)
	g := newGrants(t, s.Client(t), GrantsOptions{TokenBucket: &TokenBucketOptions{TokenLimit: 5, TokensPerPeriod: 1, ReplenishmentPeriod: time.Second}})
	ctx := context.Background()
	for _, n := range []int{0, -1} {
		if _, err := g.Claim(ctx, n); err == nil || errors.Is(err, ErrStore) {
			t.Errorf("Claim(%d) = %v, want an argument error", n, err)
		}
		if err := g.Return(ctx, n, 0); err == nil || errors.Is(err, ErrStore) {
			t.Errorf("Return(%d) = %v, want an argument error", n, err)
		}
	}
	claim(t, g, 1, 1, 0)
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := g.Claim(cancelled, 1); !errors.Is(err, context.Canceled) {
		t.Errorf("Claim with a cancelled context = %v, want context.Canceled", err)
	}
	if err := g.Return(cancelled, 1, 0); !errors.Is(err, context.Canceled) {
		t.Errorf("Return with a cancelled context = %v, want context.Canceled", err)
	}
	s.Stop()
	if _, err := g.Claim(ctx, 1); !isStoreOp(err, "claim", t.Name()) {
		t.Errorf("Claim with Redis down = %v, want a *StoreError", err)
	}
	if err := g.Return(ctx, 1, 0); !isStoreOp(err, "return", t.Name()) {
		t.Errorf("Return with Redis down = %v, want a *StoreError", err)
	}
}

func isStoreOp(err error, op, name string) bool {
	se, ok := AsStoreError(err)
	return ok && se.Op == op && se.Limiter == name
}

// loseReply makes a node's replies to scripts that ran look lost
// (io.EOF), while lose is set.
type loseReply struct{ lose *atomic.Bool }

func (loseReply) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h loseReply) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if err == nil && cmd.Name() == "evalsha" && h.lose.Load() {
			return io.EOF
		}
		return err
	}
}

func (loseReply) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// A Return whose reply is lost is not sent again: a ClusterClient would,
// whatever its MaxRetries, and the budget would get the permits back twice.
func TestGrantsReturnNotResentInCluster(t *testing.T) {
	nodes := redistest.StartCluster(t, 3)
	u, err := OpenRedis("redis+cluster://"+nodes[0].Addr(), RedisTimeouts{Dial: time.Second, Read: time.Second, Write: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	c := u.(*redis.ClusterClient)
	t.Cleanup(func() { _ = c.Close() })
	var lose atomic.Bool
	c.OnNewNode(func(n *redis.Client) { n.AddHook(loseReply{&lose}) })
	g := newGrants(t, c, GrantsOptions{TokenBucket: &TokenBucketOptions{TokenLimit: 10, TokensPerPeriod: 1, ReplenishmentPeriod: time.Hour}})
	claim(t, g, 10, 10, 0)
	lose.Store(true)
	if err := g.Return(context.Background(), 3, 0); err == nil {
		t.Fatal("Return with its reply lost succeeded")
	}
	lose.Store(false)
	claim(t, g, 10, 3, 0) // returned once
}
