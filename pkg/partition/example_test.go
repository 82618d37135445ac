package partition_test

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/egressd/egressd/pkg/limit"
	"github.com/egressd/egressd/pkg/partition"
	"github.com/egressd/egressd/pkg/sdk"
	"github.com/egressd/egressd/pkg/shared"
)

// Each tenant gets a token bucket of its own, made on first use: one tenant
// spending its burst leaves every other tenant's whole.
func Example() {
	tenants, err := partition.New(partition.Options{
		Name:  "tenant-api",
		Local: &limit.Options{Name: "tenant-api", PerSecond: &limit.PerSecondOptions{Permits: 2}},
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	ctx := context.Background()
	for _, tenant := range []string{"acme", "acme", "acme", "globex"} {
		lease, err := tenants.Acquire(ctx, tenant)
		if rl, ok := sdk.AsRateLimited(err); ok {
			fmt.Println(tenant, "refused by", rl.Limiter, "for about", rl.RetryAfter.Round(100*time.Millisecond))
			continue
		}
		fmt.Println(tenant, "admitted")
		lease.Release()
	}
	fmt.Println(tenants.Len(), "partitions")
	// Output:
	// acme admitted
	// acme admitted
	// acme refused by tenant-api for about 500ms
	// globex admitted
	// 2 partitions
}

// A budget per tenant shared by every replica through Redis: the tenant
// "acme" is the key tenant-api/acme on every replica that uses the prefix
// tenant-api. Evicting an idle tenant leaves its key in Redis.
func ExampleOptions_shared() {
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379"})
	tenants, err := partition.New(partition.Options{
		Shared: &shared.Options{
			Key:         "tenant-api",
			FixedWindow: &shared.FixedWindowOptions{Permits: 1000, Window: time.Minute},
			FailureMode: shared.Allow, // keep serving if Redis is down
		},
		Redis: rdb,
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	lease, err := tenants.Acquire(context.Background(), "acme")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer lease.Release()
}

// Every problem with the options at once, the nested limiter's included.
func ExampleOptions_Validate() {
	err := (&partition.Options{
		Local:       &limit.Options{PerSecond: &limit.PerSecondOptions{Permits: 0}},
		IdleTimeout: -time.Second,
	}).Validate()
	fmt.Println(err)
	// Output:
	// invalid limiter options: Local.PerSecond.Permits 0 must lie between 1 and 1000000000; IdleTimeout -1s must not be negative (0 means 1m0s)
}
