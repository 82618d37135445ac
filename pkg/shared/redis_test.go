package shared

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/internal/redistest"
)

// startRedis starts a real redis-server for the test (see redistest).
func startRedis(t testing.TB) *redistest.Server { return redistest.Start(t) }

// These tests run on the real clock: leases, windows and freezes are kept
// on Redis's, which no synctest bubble moves. A test waits for what it
// expects of them - Redis's clock reaching an instant, a freeze ending, a
// cooldown ending - rather than sleeping for what it guesses that takes.

// awaitRedisTime waits until Redis's clock reads at or past at.
func awaitRedisTime(t *testing.T, c *redis.Client, at time.Time) {
	t.Helper()
	clocktest.Eventually(t, "Redis's clock to reach "+at.String(), func() bool { return !redisTime(t, c).Before(at) })
}

// frozenFor returns how much longer the growth of the concurrency budget
// at key is frozen, on Redis's clock; zero or less once it is not.
func frozenFor(t *testing.T, c *redis.Client, key string) time.Duration {
	t.Helper()
	frozen, err := c.HGet(context.Background(), epochKey(key), "frozen").Int64()
	if err != nil {
		t.Fatalf("the freeze of %s: %v", key, err)
	}
	return time.UnixMicro(frozen).Sub(redisTime(t, c))
}

// awaitThaw waits until the growth of the concurrency budget at key is no
// longer frozen.
func awaitThaw(t *testing.T, c *redis.Client, key string) {
	t.Helper()
	clocktest.Eventually(t, "the freeze of "+key+" to end", func() bool { return frozenFor(t, c, key) <= 0 })
}

// coolingDown reports whether l's cooldown keeps it from asking Redis now.
func coolingDown(l *Limiter) bool {
	l.store.mu.Lock()
	defer l.store.mu.Unlock()
	return time.Now().Before(l.store.until)
}

// awaitCooled waits until no cooldown keeps any of ls from asking Redis.
func awaitCooled(t *testing.T, ls ...*Limiter) {
	t.Helper()
	clocktest.Eventually(t, "the limiters' cooldowns to end", func() bool {
		for _, l := range ls {
			if coolingDown(l) {
				return false
			}
		}
		return true
	})
}
