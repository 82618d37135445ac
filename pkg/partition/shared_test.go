package partition_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/egressd/egressd/internal/redistest"
	"github.com/egressd/egressd/pkg/partition"
	"github.com/egressd/egressd/pkg/sdk"
	"github.com/egressd/egressd/pkg/shared"
)

// Each shared partition is a Redis budget under shared.KeyFor(prefix,
// partition), and evicting it leaves that budget as it was: the limiter
// made for the key afterwards carries on where the evicted one left off.
func TestSharedPartitionKeepsItsStateWhenEvicted(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	p := newPartitioned(t, partition.Options{
		Shared: &shared.Options{
			Key: "tenant-api",
			// Two tokens, one more an hour: nothing refills during the test.
			TokenBucket: &shared.TokenBucketOptions{TokenLimit: 2, TokensPerPeriod: 1, ReplenishmentPeriod: time.Hour},
		},
		Redis:       rdb,
		IdleTimeout: time.Minute,
	})
	ctx := context.Background()
	spend := func(key string, n int) (admitted int) {
		for range n {
			lease, err := p.Acquire(ctx, key)
			if err == nil {
				admitted++
			} else if rl, ok := sdk.AsRateLimited(err); !ok || rl.Limiter != "tenant-api" {
				t.Fatalf("Acquire(%q) = %v; want a refusal naming the prefix, not the partition", key, err)
			}
			lease.Release()
		}
		return admitted
	}
	if got := spend("a/b", 5); got != 2 {
		t.Fatalf("a/b got %d of 5; want 2", got)
	}
	if got := spend("c", 2); got != 2 {
		t.Fatalf("c got %d of 2 after a/b spent its budget; want 2", got)
	}
	keys, err := rdb.Keys(ctx, "tenant-api*").Result()
	if err != nil {
		t.Fatal(err)
	}
	if len(keys) != 2 || !slices.Contains(keys, "tenant-api/a%2Fb") || !slices.Contains(keys, "tenant-api/c") {
		t.Fatalf("Redis keys %q; want tenant-api/a%%2Fb and tenant-api/c (shared.KeyFor)", keys)
	}

	if n := p.SweepLater(time.Minute); n != 2 || p.Len() != 0 {
		t.Fatalf("Sweep evicted %d, left %d; want both evicted", n, p.Len())
	}
	if n, err := rdb.Exists(ctx, "tenant-api/a%2Fb", "tenant-api/c").Result(); err != nil || n != 2 {
		t.Fatalf("%d of the 2 budgets left in Redis after eviction (%v); want both", n, err)
	}
	if got := spend("a/b", 1); got != 0 {
		t.Errorf("a/b admitted again after eviction; its spent budget should still be spent")
	}
}

// A shared concurrency partition holding a lease is not evicted, and
// another replica with the same prefix shares its bound.
func TestSharedConcurrencyPartitionIsNotEvictedWhileHeld(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	opts := partition.Options{
		Shared:      &shared.Options{Key: "uploads", Concurrency: &shared.ConcurrencyOptions{Permits: 1, LeaseDuration: 3 * time.Second}},
		Redis:       rdb,
		IdleTimeout: time.Second,
	}
	here, there := newPartitioned(t, opts), newPartitioned(t, opts)
	ctx := context.Background()

	lease, err := here.Acquire(ctx, "alice")
	if err != nil {
		t.Fatal(err)
	}
	if n := here.SweepLater(time.Hour); n != 0 {
		t.Fatalf("Sweep evicted a partition holding a lease")
	}
	if _, err := there.Acquire(ctx, "alice"); !sdk.IsRateLimited(err) {
		t.Fatalf("the other replica's Acquire = %v; want a refusal: alice's one lease is held", err)
	}
	other, err := there.Acquire(ctx, "bob")
	if err != nil {
		t.Fatalf("bob on the other replica = %v; want a lease of his own", err)
	}
	other.Release()

	lease.Release()
	if n, err := rdb.ZCard(ctx, "uploads/alice").Result(); err != nil || n != 0 {
		t.Fatalf("%d leases in Redis after Release (%v); want 0", n, err)
	}
	if n := here.SweepLater(time.Second); n != 1 {
		t.Fatalf("Sweep evicted %d after the lease was released and the partition idle; want 1", n)
	}
	again, err := there.Acquire(ctx, "alice")
	if err != nil {
		t.Fatalf("alice on the other replica once released = %v", err)
	}
	again.Release()
}
