package shared

import (
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/egressd/egressd/pkg/shared/redisurl"
)

func TestOpenRedisKinds(t *testing.T) {
	for url, want := range map[string]string{
		"redis://127.0.0.1:1":                          "*redis.Client",
		"redis+sentinel://127.0.0.1:1?master_name=m":   "*redis.Client",
		"redis+cluster://127.0.0.1:1?addr=127.0.0.1:2": "*redis.ClusterClient",
	} {
		c, err := OpenRedis(url, RedisTimeouts{})
		if err != nil {
			t.Fatalf("OpenRedis(%q): %v", url, err)
		}
		var got string
		switch c.(type) {
		case *redis.Client:
			got = "*redis.Client"
		case *redis.ClusterClient:
			got = "*redis.ClusterClient"
		}
		if got != want {
			t.Errorf("OpenRedis(%q) is a %T, want %s", url, c, want)
		}
		c.Close()
	}
}

// OpenRedis refuses a URL in the words redisurl.Check, which the policy
// uses, says it would.
func TestOpenRedisRefusesAsCheck(t *testing.T) {
	for _, url := range []string{"redis://h:1/x", "redis+sentinel://h:1?addr=bad", "redis+cluster://h:1?bogus=1", "http://h:1",
		"redis+sentinel://h:1?master_name=m&route_by_latency=true", "redis+sentinel://h:1?master_name=m&route_randomly=1", "redis+sentinel://h:1"} {
		_, want := redisurl.Check(url)
		if _, err := OpenRedis(url, RedisTimeouts{}); err == nil || want == nil || err.Error() != want.Error() {
			t.Errorf("OpenRedis(%q): %v; Check: %v", url, err, want)
		}
	}
}
