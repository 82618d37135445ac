package shared_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/egressd/egressd/internal/redistest"
	"github.com/egressd/egressd/pkg/sdk"
	"github.com/egressd/egressd/pkg/shared"
	"github.com/egressd/egressd/pkg/shared/sharedtest"
)

// TestModelAgreesWithScript runs random Resizes, Limiter leases and
// losses of Redis's state against a real Redis and against sharedtest's
// model, and wants the same answer from both every time: the simulations
// that use the model are then simulations of the script. The lease is long
// enough that nothing expires meanwhile (the model's clock stands still).
func TestModelAgreesWithScript(t *testing.T) {
	s := redistest.Start(t)
	c := s.Client(t)
	const lease = time.Minute
	for round := range 8 {
		rng := rand.New(rand.NewPCG(uint64(round), 7))
		key := fmt.Sprintf("%s:%d", t.Name(), round)
		permits := 3 + rng.IntN(8)
		persistent := round%2 == 0
		durability := shared.Ephemeral
		if persistent {
			durability = shared.Persistent
		}
		model := sharedtest.NewBudget(permits, lease, persistent)
		holders := make([]*shared.Slots, 4)
		for i := range holders {
			var err error
			holders[i], err = shared.NewSlots(c, shared.SlotsOptions{Key: key, Permits: permits, Holder: fmt.Sprintf("h%d", i), LeaseDuration: lease, Durability: durability})
			if err != nil {
				t.Fatal(err)
			}
		}
		lim, err := shared.New(c, shared.Options{Key: key, Concurrency: &shared.ConcurrencyOptions{Permits: permits, LeaseDuration: lease, Holders: true, Durability: durability}})
		if err != nil {
			t.Fatal(err)
		}
		now := time.Now()
		leases := 0
		for op := range 150 {
			switch r := rng.IntN(20); {
			case r == 0:
				if _, err := s.Do("FLUSHALL"); err != nil {
					t.Fatal(err)
				}
				model.Lose()
			case r <= 2:
				ls, err := lim.Acquire(context.Background())
				got := err == nil
				if err != nil && !sdk.IsRateLimited(err) {
					t.Fatal(err)
				}
				leases++
				if want := model.Acquire(now, fmt.Sprintf("lease-%d", leases)); got != want {
					t.Fatalf("round %d op %d: Limiter acquired %v, the model %v", round, op, got, want)
				}
				_ = ls // held until the key is flushed; never released
			default:
				i := rng.IntN(len(holders))
				req := shared.SlotsRequest{Want: rng.IntN(permits + 1), Demand: rng.IntN(permits + 1), Prior: rng.IntN(permits + 1), HadState: rng.IntN(2) == 0}
				got, err := holders[i].Resize(context.Background(), req)
				if err != nil {
					t.Fatal(err)
				}
				want := model.Resize(now, fmt.Sprintf("h%d", i), req)
				if got.Held != want.Held || got.Fair != want.Fair || (got.Frozen > 0) != (want.Frozen > 0) {
					t.Fatalf("round %d op %d: h%d Resize(%+v) = %+v from Redis, %+v from the model", round, op, i, req, got, want)
				}
			}
		}
	}
}

// TestBucketModelAgreesWithScript does for a token bucket's Claim and
// Return what TestModelAgreesWithScript does for slots. The period is long
// enough that nothing refills meanwhile.
func TestBucketModelAgreesWithScript(t *testing.T) {
	s := redistest.Start(t)
	c := s.Client(t)
	rng := rand.New(rand.NewPCG(3, 5))
	limit := 20
	g, err := shared.NewGrants(c, shared.GrantsOptions{Key: t.Name(), TokenBucket: &shared.TokenBucketOptions{TokenLimit: limit, TokensPerPeriod: 5, ReplenishmentPeriod: time.Hour}})
	if err != nil {
		t.Fatal(err)
	}
	model := &sharedtest.Bucket{Limit: limit, Per: 5, Period: time.Hour}
	now := time.Now()
	for op := range 300 {
		n := 1 + rng.IntN(8)
		switch r := rng.IntN(10); {
		case r == 0:
			if _, err := s.Do("DEL", t.Name()); err != nil {
				t.Fatal(err)
			}
			model.Lose()
		case r <= 3:
			if err := g.Return(context.Background(), n, 0); err != nil {
				t.Fatal(err)
			}
			model.Return(now, n)
		default:
			got, err := g.Claim(context.Background(), n)
			if err != nil {
				t.Fatal(err)
			}
			if want := model.Claim(now, n); got.Got != want {
				t.Fatalf("op %d: Claim(%d) = %d from Redis, %d from the model", op, n, got.Got, want)
			}
		}
	}
}
