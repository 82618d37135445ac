package shared

import (
	"errors"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/egressd/egressd/pkg/shared/redisurl"
)

// RedisTimeouts bound a client's calls. Clients are opened with MaxRetries
// -1, so that a call is not sent again after a lost reply, which may have
// been applied. A ClusterClient sends it again all the same (after EOF or
// a timeout, up to MaxRedirects times, which bound MOVED and ASK too),
// unless the command says NoRetry, as the Grants and Slots scripts do.
type RedisTimeouts struct {
	Dial, Read, Write time.Duration
	PoolSize          int
}

// OpenRedis returns a client for a URL of package redisurl's forms: a
// *redis.Client (a Sentinel failover client for Sentinel URLs) or a
// *redis.ClusterClient. redisurl.Check says what is wrong with the URL, in
// the words OpenRedis would.
func OpenRedis(s string, t RedisTimeouts) (redis.UniversalClient, error) {
	// Check refuses what go-redis would, and what it would open and then
	// panic on (a Sentinel URL that routes to replicas).
	k, err := redisurl.Check(s)
	if err != nil {
		return nil, err
	}
	_, plain, _ := redisurl.Split(s)
	switch k {
	case redisurl.Sentinel:
		o, err := redis.ParseFailoverURL(plain)
		if err != nil {
			return nil, clean(err)
		}
		o.DialTimeout, o.ReadTimeout, o.WriteTimeout, o.MaxRetries, o.PoolSize = t.Dial, t.Read, t.Write, -1, t.PoolSize
		return redis.NewFailoverClient(o), nil
	case redisurl.Cluster:
		o, err := redis.ParseClusterURL(plain)
		if err != nil {
			return nil, clean(err)
		}
		o.DialTimeout, o.ReadTimeout, o.WriteTimeout, o.MaxRetries, o.PoolSize = t.Dial, t.Read, t.Write, -1, t.PoolSize
		return redis.NewClusterClient(o), nil
	default:
		o, err := redis.ParseURL(plain)
		if err != nil {
			return nil, clean(err)
		}
		o.DialTimeout, o.ReadTimeout, o.WriteTimeout, o.MaxRetries, o.PoolSize = t.Dial, t.Read, t.Write, -1, t.PoolSize
		return redis.NewClient(o), nil
	}
}

// clean drops go-redis's "redis: " prefix from a parse error.
func clean(err error) error {
	return errors.New(strings.TrimPrefix(err.Error(), "redis: "))
}
