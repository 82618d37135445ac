// Package redisurl turns the Redis URLs a policy may name into clients:
// one server, a Sentinel-watched primary, or a Cluster.
//
//	redis://[user:password@]host:port[/db]    one server (rediss:// for TLS)
//	unix://[user:password@]/path/to/socket[?db=N]
//	redis+sentinel://[user:password@]host:port[/db]?master_name=NAME[&addr=host:port...]
//	                                          the primary Sentinel names (rediss+sentinel:// for TLS);
//	                                          user and password are the sentinels'
//	redis+cluster://[user:password@]host:port[?addr=host:port...]
//	                                          a Cluster (rediss+cluster:// for TLS)
//
// Query parameters set client options as go-redis's URL parsers read them
// (dial_timeout=1s, …); an unknown one is an error.
package redisurl

import (
	"errors"
	"fmt"
	"net/url"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// Kind is what a URL names.
type Kind uint8

const (
	Server Kind = iota
	Sentinel
	Cluster
)

// Timeouts bound a client's calls. Clients are opened with MaxRetries -1,
// so that a call is not sent again after a lost reply, which may have been
// applied. A ClusterClient sends it again all the same (after EOF or a
// timeout, up to MaxRedirects times, which bound MOVED and ASK too), unless
// the command says NoRetry, as package shared's Grants and Slots scripts
// do.
type Timeouts struct {
	Dial, Read, Write time.Duration
	PoolSize          int
}

// Check says what is wrong with a URL, or returns nil, and what it names.
func Check(s string) (Kind, error) {
	k, plain, err := split(s)
	if err != nil {
		return k, err
	}
	switch k {
	case Sentinel:
		o, err := redis.ParseFailoverURL(plain)
		if err != nil {
			return k, clean(err)
		}
		if o.MasterName == "" {
			return k, errors.New("names no primary: add ?master_name=NAME")
		}
	case Cluster:
		if _, err := redis.ParseClusterURL(plain); err != nil {
			return k, clean(err)
		}
	default:
		if _, err := redis.ParseURL(plain); err != nil {
			return k, clean(err)
		}
	}
	return k, nil
}

// Open returns a client for s: a *redis.Client (a Sentinel failover client
// for Sentinel URLs) or a *redis.ClusterClient.
func Open(s string, t Timeouts) (redis.UniversalClient, error) {
	k, plain, err := split(s)
	if err != nil {
		return nil, err
	}
	switch k {
	case Sentinel:
		o, err := redis.ParseFailoverURL(plain)
		if err != nil {
			return nil, clean(err)
		}
		o.DialTimeout, o.ReadTimeout, o.WriteTimeout, o.MaxRetries, o.PoolSize = t.Dial, t.Read, t.Write, -1, t.PoolSize
		return redis.NewFailoverClient(o), nil
	case Cluster:
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

// Redact returns s with its passwords shown as "xxxxx": the user's and a
// password query parameter's (a Sentinel URL's, for the primary). A string
// that is not a URL is hidden whole.
func Redact(s string) string {
	u, err := url.Parse(s)
	if err != nil {
		return "xxxxx"
	}
	if q := u.Query(); q.Has("password") {
		q.Set("password", "xxxxx")
		u.RawQuery = q.Encode()
	}
	return u.Redacted()
}

// split tells the kind from the scheme and returns the URL in the form
// go-redis's parser for that kind reads.
func split(s string) (Kind, string, error) {
	u, err := url.Parse(s)
	if err != nil {
		return Server, "", errors.New("is not a URL")
	}
	base, kind, _ := strings.Cut(u.Scheme, "+")
	if base != "unix" && u.Host == "" {
		return Server, "", errors.New("has no host")
	}
	switch {
	case kind == "" && (base == "redis" || base == "rediss" || base == "unix"):
		return Server, s, nil
	case kind == "sentinel" && (base == "redis" || base == "rediss"):
		u.Scheme = base
		return Sentinel, u.String(), nil
	case kind == "cluster" && (base == "redis" || base == "rediss"):
		u.Scheme = base
		return Cluster, u.String(), nil
	}
	return Server, "", fmt.Errorf("is not a redis://, rediss://, unix://, redis+sentinel:// or redis+cluster:// URL")
}

// clean drops go-redis's "redis: " prefix from a parse error.
func clean(err error) error {
	return errors.New(strings.TrimPrefix(err.Error(), "redis: "))
}
