package partition_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/pkg/adaptive"
	"github.com/egressd/egressd/pkg/limit"
	"github.com/egressd/egressd/pkg/partition"
	"github.com/egressd/egressd/pkg/sdk"
	"github.com/egressd/egressd/pkg/shared"
	"github.com/redis/go-redis/v9"
)

func newPartitioned(t *testing.T, opts partition.Options) *partition.Partitioned {
	t.Helper()
	p, err := partition.New(opts)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func TestValidate(t *testing.T) {
	local := &limit.Options{Concurrency: 1}
	sharedOpts := &shared.Options{Key: "k", TokenBucket: &shared.TokenBucketOptions{TokenLimit: 1, TokensPerPeriod: 1, ReplenishmentPeriod: time.Second}}
	client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}) // never dialled
	t.Cleanup(func() { client.Close() })
	newFn := func(string) (partition.Limiter, error) { return partition.Adapt(limit.Concurrency(1)), nil }
	tests := []struct {
		name string
		opts partition.Options
		want []string // substrings, one per problem, in order
	}{
		{"zero", partition.Options{}, []string{"no limiter"}},
		{"local and new", partition.Options{Local: local, New: newFn}, []string{"Local and New are set"}},
		{"all three", partition.Options{Local: local, Shared: sharedOpts, Redis: client, New: newFn}, []string{"Local and Shared and New are set"}},
		{"bad local", partition.Options{Local: &limit.Options{PerSecond: &limit.PerSecondOptions{}, Concurrency: 2}},
			[]string{"Local.PerSecond and Concurrency are set", "Local.PerSecond.Permits 0"}},
		{"bad shared, no client", partition.Options{Shared: &shared.Options{FixedWindow: &shared.FixedWindowOptions{Permits: 0, Window: time.Second}}},
			[]string{"Shared.Key is required", "Shared.FixedWindow.Permits 0", "Redis is required with Shared"}},
		{"client without shared", partition.Options{Local: local, Redis: client}, []string{"Redis is set without Shared"}},
		{"bounds", partition.Options{New: newFn, IdleTimeout: -time.Second, MaxPartitions: -1},
			[]string{"IdleTimeout -1s must not be negative", "MaxPartitions -1 must not be negative"}},
		{"local", partition.Options{Local: local}, nil},
		{"shared", partition.Options{Shared: sharedOpts, Redis: client, IdleTimeout: time.Hour, MaxPartitions: 10}, nil},
		{"new", partition.Options{New: newFn}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.opts.Validate()
			oe, _ := partition.AsOptionsError(err)
			var got []string
			if oe != nil {
				got = oe.Problems
			}
			if len(got) != len(tt.want) || (err != nil) != errors.Is(err, partition.ErrInvalidOptions) {
				t.Fatalf("Validate = %v, want problems %q", err, tt.want)
			}
			for i, w := range tt.want {
				if !strings.Contains(got[i], w) {
					t.Errorf("problem %d = %q, want it to contain %q", i, got[i], w)
				}
			}
			if _, err := partition.New(tt.opts); (err != nil) != (len(tt.want) > 0) {
				t.Errorf("New = %v; want an error exactly when Validate finds problems", err)
			}
		})
	}
}

// One partition spending its budget leaves every other partition's whole.
func TestPartitionsAreIsolated(t *testing.T) {
	p := newPartitioned(t, partition.Options{
		Name:  "tenant-api",
		Local: &limit.Options{Name: "tenant-api", PerWindow: &limit.PerWindowOptions{Permits: 2, Window: time.Hour}},
	})
	ctx := context.Background()
	admitted := func(key string, n int) (got int) {
		for range n {
			lease, err := p.Acquire(ctx, key)
			if err == nil {
				got++
			} else if rl, ok := sdk.AsRateLimited(err); !ok || rl.Limiter != "tenant-api" {
				t.Fatalf("Acquire(%q) = %v; want a refusal by tenant-api", key, err)
			}
			lease.Release()
		}
		return got
	}
	if got := admitted("noisy", 10); got != 2 {
		t.Errorf("noisy got %d of 10; want its 2", got)
	}
	if got := admitted("quiet", 2); got != 2 {
		t.Errorf("quiet got %d of 2 after noisy spent its budget; want 2", got)
	}
	if got := admitted("", 3); got != 2 {
		t.Errorf("the empty partition got %d of 3; want 2: it is a partition like any other", got)
	}
	if p.Len() != 3 {
		t.Errorf("Len = %d, want 3", p.Len())
	}
}

// A partition is evicted once it has been idle for IdleTimeout - a local
// rate partition only once it would be back to a full budget - and never
// while a lease is out.
func TestEviction(t *testing.T) {
	const idle = time.Second
	tests := []struct {
		name     string
		local    *limit.Options
		acquired int           // leases taken from the partition
		released int           // of which released
		after    time.Duration // idle time then, before a Sweep
		want     int           // partitions left
	}{
		{"concurrency held", &limit.Options{Concurrency: 2}, 1, 0, time.Hour, 1},
		{"concurrency one of two held", &limit.Options{Concurrency: 2}, 2, 1, time.Hour, 1},
		{"concurrency released, not yet idle", &limit.Options{Concurrency: 2}, 2, 2, idle - time.Nanosecond, 1},
		{"concurrency released, idle", &limit.Options{Concurrency: 2}, 2, 2, idle, 0},
		{"adaptive released, idle", &limit.Options{Adaptive: &adaptive.Options{}}, 1, 1, idle, 0},
		{"per second, not yet full", &limit.Options{PerSecond: &limit.PerSecondOptions{Permits: 1, Burst: 10}}, 10, 10, 10*time.Second - time.Nanosecond, 1},
		{"per second, full again", &limit.Options{PerSecond: &limit.PerSecondOptions{Permits: 1, Burst: 10}}, 10, 10, 10 * time.Second, 0},
		{"per second, fills within idle", &limit.Options{PerSecond: &limit.PerSecondOptions{Permits: 100}}, 1, 1, idle, 0},
		{"per window, window not over", &limit.Options{PerWindow: &limit.PerWindowOptions{Permits: 5, Window: time.Minute}}, 5, 5, time.Minute - time.Nanosecond, 1},
		{"per window, window over", &limit.Options{PerWindow: &limit.PerWindowOptions{Permits: 5, Window: time.Minute}}, 5, 5, time.Minute, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				p := newPartitioned(t, partition.Options{Local: tt.local, IdleTimeout: idle})
				leases := make([]partition.Lease, tt.acquired)
				for i := range leases {
					var err error
					if leases[i], err = p.Acquire(context.Background(), "k"); err != nil {
						t.Fatalf("Acquire %d: %v", i, err)
					}
				}
				for i := range tt.released {
					leases[i].Release()
				}
				clocktest.Advance(tt.after)
				p.Sweep()
				if got := p.Len(); got != tt.want {
					t.Errorf("%d partitions after %v idle; want %d", got, tt.after, tt.want)
				}
				for i := tt.released; i < tt.acquired; i++ {
					leases[i].Release()
				}
			})
		})
	}
}

// A local rate partition kept past IdleTimeout still holds its spent
// budget: eviction never forgives what was spent.
func TestEvictionNeverForgivesBudget(t *testing.T) { synctest.Test(t, testEvictionNeverForgivesBudget) }

func testEvictionNeverForgivesBudget(t *testing.T) {
	p := newPartitioned(t, partition.Options{
		Local:       &limit.Options{PerWindow: &limit.PerWindowOptions{Permits: 1, Window: time.Minute}},
		IdleTimeout: time.Second,
	})
	ctx := context.Background()
	lease, err := p.Acquire(ctx, "k")
	if err != nil {
		t.Fatal(err)
	}
	lease.Release()
	for _, step := range []time.Duration{time.Second, 29 * time.Second, 29 * time.Second} {
		clocktest.Advance(step)
		p.Sweep()
		if _, err := p.Acquire(ctx, "k"); !sdk.IsRateLimited(err) {
			t.Fatalf("Acquire within the window = %v; want a refusal", err)
		}
	}
	clocktest.Advance(time.Minute)
	if n := p.Sweep(); n != 1 {
		t.Fatalf("Sweep after the window evicted %d; want 1", n)
	}
	if _, err := p.Acquire(ctx, "k"); err != nil {
		t.Fatalf("Acquire in a new window = %v", err)
	}
}

// Acquire sweeps by itself once IdleTimeout/2 has passed since the last
// sweep.
func TestAcquireSweepsLazily(t *testing.T) { synctest.Test(t, testAcquireSweepsLazily) }

func testAcquireSweepsLazily(t *testing.T) {
	var counts []int
	p := newPartitioned(t, partition.Options{
		Local:       &limit.Options{Concurrency: 1},
		IdleTimeout: time.Second,
		OnCount:     func(n int) { counts = append(counts, n) },
	})
	use := func(key string) {
		lease, err := p.Acquire(context.Background(), key)
		if err != nil {
			t.Fatal(err)
		}
		lease.Release()
	}
	use("a")
	clocktest.Advance(400 * time.Millisecond)
	use("b") // no sweep yet: 400ms < 500ms
	clocktest.Advance(700 * time.Millisecond)
	use("c") // sweeps at 1.1s: a idle 1.1s, b 0.7s
	if p.Len() != 2 {
		t.Errorf("Len = %d, want 2: a evicted, b and c kept", p.Len())
	}
	clocktest.Advance(900 * time.Millisecond)
	use("c") // sweeps at 2s: b idle 1.6s, c 0.9s
	if p.Len() != 1 {
		t.Errorf("Len = %d, want 1: b evicted, c kept", p.Len())
	}
	if want := []int{1, 2, 1, 2, 1}; !slices.Equal(counts, want) {
		t.Errorf("OnCount told %v, want %v", counts, want)
	}
}

// Beyond MaxPartitions a new key is refused; an idle partition makes room
// for it, a busy one does not.
func TestMaxPartitions(t *testing.T) { synctest.Test(t, testMaxPartitions) }

func testMaxPartitions(t *testing.T) {
	p := newPartitioned(t, partition.Options{
		Name:          "tenants",
		Local:         &limit.Options{Concurrency: 1},
		IdleTimeout:   time.Minute,
		MaxPartitions: 2,
	})
	ctx := context.Background()
	a, errA := p.Acquire(ctx, "a")
	b, errB := p.Acquire(ctx, "b")
	if errA != nil || errB != nil {
		t.Fatal(errA, errB)
	}
	_, err := p.Acquire(ctx, "c")
	rl, ok := sdk.AsRateLimited(err)
	if !ok || rl.Limiter != "tenants" || !errors.Is(err, partition.ErrTooManyPartitions) {
		t.Fatalf("third key = %v; want a refusal by tenants wrapping ErrTooManyPartitions", err)
	}
	clocktest.Advance(time.Hour) // idle enough, but both are held
	if _, err := p.Acquire(ctx, "c"); !errors.Is(err, partition.ErrTooManyPartitions) {
		t.Fatalf("third key with both partitions held = %v; want ErrTooManyPartitions", err)
	}
	a.Release()
	b.Release()
	clocktest.Advance(time.Minute)
	c, err := p.Acquire(ctx, "c")
	if err != nil {
		t.Fatalf("third key once the others are idle = %v", err)
	}
	c.Release()
	if p.Len() != 1 {
		t.Errorf("Len = %d, want 1", p.Len())
	}
}

// A partition whose limiter cannot be made is not kept, and says why.
func TestFactoryError(t *testing.T) {
	errNoTenant := errors.New("no such tenant")
	var made atomic.Int32
	p := newPartitioned(t, partition.Options{
		Name: "tenants",
		New: func(key string) (partition.Limiter, error) {
			made.Add(1)
			if key == "ghost" {
				return nil, errNoTenant
			}
			return partition.Adapt(limit.Concurrency(1)), nil
		},
	})
	for range 2 {
		_, err := p.Acquire(context.Background(), "ghost")
		if !errors.Is(err, errNoTenant) || sdk.IsRateLimited(err) || !strings.Contains(err.Error(), `partition "ghost" of tenants`) {
			t.Fatalf("Acquire(ghost) = %v; want the factory's error, named", err)
		}
	}
	if p.Len() != 0 || made.Load() != 2 {
		t.Errorf("Len = %d after %d attempts to make it; want 0 after 2", p.Len(), made.Load())
	}
}

// Adapt fits both lease types, and releases through the pointer: a shared
// Lease's Release is exercised against Redis in shared_test.go.
func TestAdaptReleases(t *testing.T) {
	l := limit.Concurrency(1)
	a := partition.Adapt(l)
	if a.Name() != "concurrency" {
		t.Errorf("Name = %q", a.Name())
	}
	r, err := a.Acquire(context.Background())
	if err != nil || l.InFlight() != 1 {
		t.Fatalf("Acquire = %v with %d in flight", err, l.InFlight())
	}
	if _, err := a.Acquire(context.Background()); !sdk.IsRateLimited(err) {
		t.Fatalf("second Acquire = %v; want a refusal", err)
	}
	r.Release()
	if l.InFlight() != 0 {
		t.Errorf("%d in flight after Release", l.InFlight())
	}
	var _ = partition.Adapt(&shared.Limiter{}) // compiles: the other lease type
}

// A rate permit is handed through Adapt and a partition without
// allocating; a lease that holds something is boxed once.
func TestAcquireAllocations(t *testing.T) {
	tests := []struct {
		name  string
		local *limit.Options
		want  float64
	}{
		{"per second", &limit.Options{PerSecond: &limit.PerSecondOptions{Permits: limit.MaxRate}}, 0},
		{"concurrency", &limit.Options{Concurrency: 1}, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := newPartitioned(t, partition.Options{Local: tt.local})
			ctx := context.Background()
			got := testing.AllocsPerRun(100, func() {
				lease, err := p.Acquire(ctx, "k")
				if err != nil {
					t.Fatal(err)
				}
				lease.Release()
			})
			if got != tt.want {
				t.Errorf("%v allocations per Acquire and Release; want %v", got, tt.want)
			}
		})
	}
}

// Eviction racing acquires and releases never evicts a partition that is
// in use: if it did, the partition would come back empty and admit a
// second holder past its bound of one. It runs on the real clock, which
// moves while the goroutines race, with an IdleTimeout so short that a
// partition looks idle the moment nothing is inside it; a bubble's clock
// would stand still while they spin. The workers run until the sweeper has
// evicted a hundred times: on a loaded machine they could otherwise end
// before it had run at all.
func TestNeverEvictsABusyPartition(t *testing.T) {
	p := newPartitioned(t, partition.Options{
		Local:       &limit.Options{Concurrency: 1},
		IdleTimeout: time.Nanosecond,
	})
	keys := []string{"a", "b", "c", "d"}
	var holders [4]atomic.Int32
	var over, evicted atomic.Int64
	ctx := context.Background()
	var workers, sweeper sync.WaitGroup
	stop := make(chan struct{})
	for range 8 {
		workers.Go(func() {
			// Each worker goes on past its 2,500 admissions until the
			// sweeper has evicted something, so that the race is run
			// however the goroutines were scheduled, up to a bound that
			// fails the test below if eviction never comes.
			for admitted := 0; admitted < 2500 || evicted.Load() < 100 && admitted < 1_000_000; {
				k := rand.IntN(len(keys))
				lease, err := p.Acquire(ctx, keys[k])
				if err != nil {
					continue
				}
				admitted++
				if holders[k].Add(1) > 1 {
					over.Add(1)
				}
				runtime.Gosched() // hold it while others run
				holders[k].Add(-1)
				lease.Release()
			}
		})
	}
	sweeper.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
				evicted.Add(int64(p.Sweep()))
			}
		}
	})
	workers.Wait()
	close(stop)
	sweeper.Wait()
	if over.Load() != 0 {
		t.Fatalf("%d admissions found their partition already held", over.Load())
	}
	if evicted.Load() == 0 {
		t.Fatal("nothing was evicted: the race the test is for never ran")
	}
}

func BenchmarkAcquire(b *testing.B) {
	for _, bm := range []struct {
		name  string
		local *limit.Options
	}{
		{"perSecond", &limit.Options{PerSecond: &limit.PerSecondOptions{Permits: limit.MaxRate}}},
		{"concurrency", &limit.Options{Concurrency: 1 << 20}},
	} {
		b.Run(bm.name, func(b *testing.B) {
			p, err := partition.New(partition.Options{Local: bm.local})
			if err != nil {
				b.Fatal(err)
			}
			ctx := context.Background()
			keys := []string{"a", "b", "c", "d", "e", "f", "g", "h"}
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				i := 0
				for pb.Next() {
					lease, _ := p.Acquire(ctx, keys[i%len(keys)])
					lease.Release()
					i++
				}
			})
		})
	}
}

// An OnCount that panics (a gauge's bug, which net/http would recover per
// request) reaches the caller that made the change, and leaves the limiter
// usable: before, the panic left its lock held and every later Acquire
// hung.
func TestOnCountPanicLeavesLimiterUsable(t *testing.T) {
	tests := []struct {
		name   string
		change func(p *partition.Partitioned)
	}{
		{"new partition", func(p *partition.Partitioned) {
			_, _ = p.Acquire(context.Background(), "b")
		}},
		{"lazy sweep", func(p *partition.Partitioned) {
			clocktest.Advance(time.Hour)
			_, _ = p.Acquire(context.Background(), "a") // sweeps "a" out, then makes it again
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				var armed atomic.Bool
				p := newPartitioned(t, partition.Options{
					Local:       &limit.Options{Concurrency: 1},
					IdleTimeout: time.Minute,
					OnCount: func(int) {
						if armed.Load() {
							panic("gauge bug")
						}
					},
				})
				lease, err := p.Acquire(context.Background(), "a")
				if err != nil {
					t.Fatal(err)
				}
				lease.Release()
				armed.Store(true)
				func() {
					defer func() {
						if recover() == nil {
							t.Error("OnCount's panic did not reach the caller")
						}
					}()
					tt.change(p)
				}()
				armed.Store(false)
				if partition.Locked(p) {
					t.Fatal("OnCount's panic left the lock held: every later Acquire would hang")
				}
				lease, err = p.Acquire(context.Background(), "c")
				if err != nil {
					t.Errorf("Acquire after the panic = %v", err)
				}
				lease.Release()
			})
		})
	}
}

// limitRecorder is a limit.Observer that counts leases and keeps the limits
// it is told.
type limitRecorder struct {
	mu     sync.Mutex
	leases int
	limits []int
}

func (r *limitRecorder) OnLease(limit.Outcome) { r.mu.Lock(); r.leases++; r.mu.Unlock() }
func (r *limitRecorder) OnWait(time.Duration)  {}
func (r *limitRecorder) OnLimit(n int)         { r.mu.Lock(); r.limits = append(r.limits, n); r.mu.Unlock() }

// Adaptive partitions sharing one observer (serving.md's advice: one set of
// limitmetrics series per policy) tell it their leases, not their limits:
// before, each new partition reported its Initial, and the one gauge showed
// whichever partition spoke last.
func TestAdaptivePartitionsReportNoLimit(t *testing.T) {
	obs := &limitRecorder{}
	p := newPartitioned(t, partition.Options{Local: &limit.Options{
		Adaptive: &adaptive.Options{Minimum: 1, Initial: 1, Maximum: 5, ProbeEvery: adaptive.NoProbes, Baseline: time.Hour},
		Observer: obs,
	}})
	ctx := context.Background()
	for _, key := range []string{"a", "a", "b"} {
		lease, err := p.Acquire(ctx, key) // a fast round at its limit: "a"'s grows to 2
		if err != nil {
			t.Fatal(err)
		}
		lease.Release()
	}
	if obs.leases != 3 || len(obs.limits) != 0 {
		t.Errorf("observer told %d leases and limits %v; want 3 leases and no limit", obs.leases, obs.limits)
	}
}

// A copy of a lease released as well as the lease does nothing: before, the
// partition counted both releases, thought itself idle with a lease still
// held, and was evicted; made again empty, it admitted past its bound.
func TestReleasingACopyKeepsThePartition(t *testing.T) {
	synctest.Test(t, testReleasingACopyKeepsThePartition)
}

func testReleasingACopyKeepsThePartition(t *testing.T) {
	p := newPartitioned(t, partition.Options{
		Local:       &limit.Options{Concurrency: 2},
		IdleTimeout: time.Second,
	})
	ctx := context.Background()
	held, err := p.Acquire(ctx, "k")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(held.Release)
	lease, err := p.Acquire(ctx, "k")
	if err != nil {
		t.Fatal(err)
	}
	leaseCopy := lease
	lease.Release()
	leaseCopy.Release()
	clocktest.Advance(time.Hour)
	if n := p.Sweep(); n != 0 {
		t.Fatalf("Sweep evicted %d partitions; want none while a lease is held", n)
	}
	var admitted int
	for range 2 {
		if _, err := p.Acquire(ctx, "k"); err == nil {
			admitted++
		}
	}
	if admitted != 1 {
		t.Errorf("%d more admitted beside the lease held; want 1, the bound being 2", admitted)
	}
}

// A key longer than MaxKeyLen - an untrusted header of up to a megabyte -
// is kept as MaxKeyLen+1 bytes that still tell it from every other key:
// before, each such partition held its whole key for at least IdleTimeout.
func TestLongKeysAreBounded(t *testing.T) {
	var made []string
	p := newPartitioned(t, partition.Options{New: func(key string) (partition.Limiter, error) {
		made = append(made, key)
		return partition.Adapt(limit.Concurrency(1)), nil
	}})
	ctx := context.Background()
	long := strings.Repeat("x", 1<<20)
	short := strings.Repeat("y", partition.MaxKeyLen)
	for _, key := range []string{long + "a", long + "b", short} {
		if _, err := p.Acquire(ctx, key); err != nil {
			t.Fatalf("Acquire of a new %d-byte key = %v", len(key), err)
		}
	}
	if _, err := p.Acquire(ctx, long+"a"); !sdk.IsRateLimited(err) {
		t.Errorf("second Acquire of the first long key = %v; want its partition's refusal", err)
	}
	lens := []int{len(made[0]), len(made[1]), len(made[2])}
	want := []int{partition.MaxKeyLen + 1, partition.MaxKeyLen + 1, partition.MaxKeyLen}
	if !slices.Equal(lens, want) || made[0] == made[1] || made[2] != short {
		t.Errorf("partitions made with keys of %v bytes (distinct: %v, short kept: %v); want %v, distinct, kept",
			lens, made[0] != made[1], made[2] == short, want)
	}
}
