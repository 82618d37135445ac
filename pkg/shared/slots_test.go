package shared

import (
	"context"
	"errors"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/egressd/egressd/pkg/sdk"
	"github.com/redis/go-redis/v9"
)

func TestSlotsValidate(t *testing.T) {
	tests := []struct {
		name string
		opts SlotsOptions
		want []string // substrings, one per problem, in order
	}{
		{"zero", SlotsOptions{}, []string{"Key is required", "Permits 0", "Holder is required"}},
		{"whitespace", SlotsOptions{Key: "k", Permits: -1, Holder: "host a", LeaseDuration: 29 * time.Millisecond},
			[]string{"Permits -1", `Holder "host a" must not contain whitespace`, "LeaseDuration 29ms"}},
		{"control", SlotsOptions{Key: "k", Permits: 1, Holder: "host\x00"}, []string{`Holder "host\x00"`}},
		{"negative lease", SlotsOptions{Key: "k", Permits: 1, Holder: "h", LeaseDuration: -time.Second}, []string{"LeaseDuration -1s"}},
		{"valid", SlotsOptions{Key: "k", Permits: 1, Holder: "host-a/rule:1"}, nil},
		{"valid lease", SlotsOptions{Key: "k", Permits: 1, Holder: "h", LeaseDuration: MinLeaseDuration}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := NewSlots(nil, tt.opts)
			checkProblems(t, err, tt.want)
		})
	}
}

// checkProblems checks err is an *OptionsError with one problem containing
// each of want, in order, or nil when want is.
func checkProblems(t *testing.T, err error, want []string) {
	t.Helper()
	oe, _ := AsOptionsError(err)
	var got []string
	if oe != nil {
		got = oe.Problems
	}
	if len(got) != len(want) || (err != nil) != errors.Is(err, ErrInvalidOptions) {
		t.Fatalf("error = %v, want problems %q", err, want)
	}
	for i, w := range want {
		if !strings.Contains(got[i], w) {
			t.Errorf("problem %d = %q, want it to contain %q", i, got[i], w)
		}
	}
}

// newSlots makes Slots, Persistent unless opts say otherwise: these
// tests are of the mechanics, not of a budget's first use (see
// TestSlotsEpoch).
func newSlots(t testing.TB, c redis.Scripter, opts SlotsOptions) *Slots {
	t.Helper()
	if opts.Key == "" {
		opts.Key = t.Name()
	}
	if opts.Durability == Ephemeral {
		opts.Durability = Persistent
	}
	s, err := NewSlots(c, opts)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// resize calls s.Resize and fails the test unless it holds want after.
func resize(t *testing.T, s *Slots, want, wantHeld int) {
	t.Helper()
	r, err := s.Resize(context.Background(), SlotsRequest{Want: want, Demand: want})
	if err != nil {
		t.Fatalf("Resize(%d): %v", want, err)
	}
	if r.Held != wantHeld || !r.Confirmed {
		t.Fatalf("Resize(%d) holds %d (confirmed %v), want %d", want, r.Held, r.Confirmed, wantHeld)
	}
}

// members returns the sorted set's size and its members by holder (the
// member up to its last ":").
func members(t *testing.T, c *redis.Client, key string) (int, map[string]int) {
	t.Helper()
	ms, err := c.ZRange(context.Background(), key, 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	by := map[string]int{}
	for _, m := range ms {
		by[m[:strings.LastIndexByte(m, ':')]]++
	}
	return len(ms), by
}

func TestSlotsHoldersShareBudget(t *testing.T) {
	s := startRedis(t)
	c := s.Client(t)
	opts := func(h string) SlotsOptions {
		return SlotsOptions{Permits: 5, Holder: h, LeaseDuration: 5 * time.Second}
	}
	a, b, d := newSlots(t, c, opts("a")), newSlots(t, c, opts("b")), newSlots(t, c, opts("c"))

	resize(t, a, 3, 3)
	resize(t, b, 3, 2) // partial: the budget is full
	resize(t, d, 2, 0)
	resize(t, a, 3, 3) // renewal
	resize(t, a, 1, 1) // down
	resize(t, d, 2, 2)
	resize(t, b, 3, 2) // what a gave up went to c first
	resize(t, a, 9, 1) // up, as far as there is room
	if n, by := members(t, c, t.Name()); n != 5 || by["a"] != 1 || by["b"] != 2 || by["c"] != 2 {
		t.Errorf("set has %d members, %v; want 5: a 1, b 2, c 2", n, by)
	}
	resize(t, b, 0, 0) // release
	resize(t, a, 9, 3)
	resize(t, d, 0, 0)
	resize(t, a, 0, 0)
	if n, _ := members(t, c, t.Name()); n != 0 {
		t.Errorf("set has %d members after every holder released", n)
	}
}

func TestSlotsRestartedHolderKeepsItsSlots(t *testing.T) {
	s := startRedis(t)
	c := s.Client(t)
	opts := func(h string) SlotsOptions {
		return SlotsOptions{Permits: 4, Holder: h, LeaseDuration: 5 * time.Second}
	}
	a := newSlots(t, c, opts("host-a/rule"))
	resize(t, a, 3, 3)
	b := newSlots(t, c, opts("host-b/rule"))
	resize(t, b, 4, 1)

	// host-a restarts: its new Slots finds the 3 it held, and counts them
	// once, not once more against the budget.
	again := newSlots(t, c, opts("host-a/rule"))
	resize(t, again, 3, 3)
	resize(t, again, 4, 3)
	if n, by := members(t, c, t.Name()); n != 4 || by["host-a/rule"] != 3 {
		t.Errorf("set has %d members, %v; want 4, host-a's 3", n, by)
	}

	// A Holder that extends another's prefix is another holder: "a" does
	// not count "a:1"'s "a:1:1".
	resize(t, again, 0, 0)
	resize(t, b, 0, 0)
	short, long := newSlots(t, c, opts("a")), newSlots(t, c, opts("a:1"))
	resize(t, short, 2, 2)
	resize(t, long, 2, 2)
	resize(t, short, 1, 1)
	resize(t, long, 2, 2)
	if n, by := members(t, c, t.Name()); n != 3 || by["a"] != 1 || by["a:1"] != 2 {
		t.Errorf("set has %d members, %v; want 3: a 1, a:1 2", n, by)
	}
}

func TestSlotsExpireUnlessRenewed(t *testing.T) {
	s := startRedis(t)
	c := s.Client(t)
	const lease = time.Second
	opts := func(h string) SlotsOptions { return SlotsOptions{Permits: 2, Holder: h, LeaseDuration: lease} }
	a, b := newSlots(t, c, opts("a")), newSlots(t, c, opts("b"))
	resize(t, a, 2, 2)
	// Renewed every sixth of the lease on Redis's clock, for two leases:
	// still a's.
	at := redisTime(t, c)
	for range 12 {
		at = at.Add(lease / 6)
		awaitRedisTime(t, c, at)
		resize(t, a, 2, 2)
		resize(t, b, 1, 0)
	}
	// Not renewed: gone once its lease has run out on Redis's clock, and
	// a's next Resize says so.
	due, err := c.ZScore(context.Background(), companion(t.Name(), ":demand-expiry"), "a").Result()
	if err != nil {
		t.Fatal(err)
	}
	awaitRedisTime(t, c, time.UnixMicro(int64(due)))
	resize(t, b, 2, 2)
	resize(t, a, 2, 0)
	if ttl := c.PTTL(context.Background(), t.Name()).Val(); ttl <= 0 || ttl > lease+time.Millisecond {
		t.Errorf("key expires in %v, want within the lease, %v", ttl, lease)
	}
}

func TestSlotsShareBudgetWithConcurrencyLimiter(t *testing.T) {
	s := startRedis(t)
	c := s.Client(t)
	const lease = 5 * time.Second
	l := newLimiter(t, s, Options{Concurrency: &ConcurrencyOptions{Permits: 3, LeaseDuration: lease}})
	slots := newSlots(t, c, SlotsOptions{Permits: 3, Holder: "host-a", LeaseDuration: lease})
	acquire := func(ok bool) Lease {
		t.Helper()
		ls, err := l.Acquire(context.Background())
		if ok && err != nil {
			t.Fatalf("Acquire: %v", err)
		}
		if !ok && !sdk.IsRateLimited(err) {
			t.Fatalf("Acquire = %v, want a refusal", err)
		}
		return ls
	}

	first, second := acquire(true), acquire(true)
	resize(t, slots, 3, 1) // the Limiter's leases count against the slots
	acquire(false)         // and the slots against the Limiter
	first.Release()
	resize(t, slots, 3, 2)
	acquire(false)
	resize(t, slots, 1, 1)
	third := acquire(true)
	resize(t, slots, 3, 1)
	second.Release()
	third.Release()
	resize(t, slots, 3, 3)
	acquire(false)
	resize(t, slots, 0, 0)
	for range 3 {
		ls := acquire(true)
		t.Cleanup(ls.Release)
	}
}

func TestSlotsConcurrentResizeNeverExceeds(t *testing.T) {
	s := startRedis(t)
	c := s.Client(t)
	const permits, holders = 10, 8
	key := t.Name()
	var wg sync.WaitGroup
	var most, short atomic.Int64
	stop := make(chan struct{})
	// The set, sampled while the holders resize: never over the budget.
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
			}
			n, err := c.ZCard(context.Background(), key).Result()
			if err != nil {
				t.Error(err)
				return
			}
			if n > permits {
				t.Errorf("%d slots held at once, more than %d", n, permits)
			}
			for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
			}
		}
	})
	final := make([]int, holders)
	var hw sync.WaitGroup
	end := time.Now().Add(300 * time.Millisecond)
	for i := range holders {
		slots := newSlots(t, c, SlotsOptions{Key: key, Permits: permits, Holder: "h" + string(rune('0'+i)), LeaseDuration: 5 * time.Second})
		hw.Go(func() {
			for time.Now().Before(end) {
				want := rand.N(7)
				r, err := slots.Resize(context.Background(), SlotsRequest{Want: want, Demand: want})
				held := r.Held
				if err != nil {
					t.Errorf("Resize(%d): %v", want, err)
					return
				}
				if held > want || held > permits {
					t.Errorf("Resize(%d) holds %d", want, held)
				}
				if held < want {
					short.Add(1)
				}
				final[i] = held
			}
		})
	}
	hw.Wait()
	close(stop)
	wg.Wait()
	n, by := members(t, c, key)
	sum := 0
	for i, h := range final {
		sum += h
		if name := "h" + string(rune('0'+i)); by[name] != h {
			t.Errorf("holder %s's last Resize held %d, the set has %d", name, h, by[name])
		}
	}
	if sum != n || n > permits {
		t.Errorf("holders hold %d, the set has %d members; budget %d", sum, n, permits)
	}
	if most.Load() != permits || short.Load() == 0 {
		t.Errorf("at most %d slots seen held, %d Resizes short: want the budget, %d, reached under contention", most.Load(), short.Load(), permits)
	}
}

func TestSlotsResizeErrors(t *testing.T) {
	s := startRedis(t)
	slots := newSlots(t, s.Client(t), SlotsOptions{Permits: 1, Holder: "h"})
	for _, r := range []SlotsRequest{{Want: -1}, {Demand: -1}, {Prior: -1}} {
		if _, err := slots.Resize(context.Background(), r); err == nil || errors.Is(err, ErrStore) {
			t.Errorf("Resize(%+v) = %v, want an argument error", r, err)
		}
	}
	resize(t, slots, 1, 1)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := slots.Resize(ctx, SlotsRequest{Want: 1}); !errors.Is(err, context.Canceled) {
		t.Errorf("Resize with a cancelled context = %v, want context.Canceled", err)
	}
	s.Stop()
	_, err := slots.Resize(context.Background(), SlotsRequest{Want: 1})
	if se, ok := AsStoreError(err); !ok || se.Op != "resize" || se.Limiter != t.Name() {
		t.Errorf("Resize with Redis down = %v, want a *StoreError", err)
	}
}

// TestSlotsFairShare: busy holders split the budget max-min by their
// demands; one above its share is told and gives back as it drains, and
// the others then grow into what it gave.
func TestSlotsFairShare(t *testing.T) {
	s := startRedis(t)
	c := s.Client(t)
	opts := func(h string) SlotsOptions { return SlotsOptions{Key: t.Name(), Permits: 10, Holder: h} }
	a, b, cc := newSlots(t, c, opts("a")), newSlots(t, c, opts("b")), newSlots(t, c, opts("c"))
	step := func(s *Slots, want, demand, wantHeld, wantFair int) {
		t.Helper()
		r, err := s.Resize(context.Background(), SlotsRequest{Want: want, Demand: demand})
		if err != nil || r.Held != wantHeld || r.Fair != wantFair {
			t.Fatalf("Resize(%d, %d) = %+v, %v; want %d held, fair share %d", want, demand, r, err, wantHeld, wantFair)
		}
	}
	step(a, 10, 10, 10, 10) // alone: all of it
	step(b, 6, 6, 0, 5)     // no room yet; b's share is half
	step(a, 10, 10, 10, 5)  // a is told it is above its share
	step(a, 5, 10, 5, 5)    // and drains down to it
	step(b, 6, 6, 5, 5)     // b grows into what a gave, up to its share
	step(cc, 1, 1, 0, 1)    // a small demand gets all it asks...
	step(a, 4, 10, 4, 5)    // ...once a gives a slot back: shares 1, 4, 5
	step(cc, 1, 1, 1, 1)
	step(b, 6, 6, 5, 4)
	step(b, 4, 6, 4, 4)
	step(a, 5, 10, 5, 5)
	if n, by := members(t, c, t.Name()); n != 10 || by["a"] != 5 || by["b"] != 4 || by["c"] != 1 {
		t.Errorf("the set holds %d: %v; want a 5, b 4, c 1", n, by)
	}
	step(b, 0, 0, 0, 0) // b leaves: its demand goes with its slots
	step(a, 9, 10, 9, 9)
}
