// Package redisurl reads the Redis URLs a policy may name: one server, a
// Sentinel-watched primary, or a Cluster.
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
//
// The package does not link go-redis, so that a program that only checks a
// policy does not either: Check reads a URL as go-redis's parsers would,
// and says what they would say; package shared's OpenRedis opens it with
// them. A test holds the two to the same answers.
package redisurl

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Kind is what a URL names.
type Kind uint8

const (
	Server Kind = iota
	Sentinel
	Cluster
)

// Check says what is wrong with a URL, or returns nil, and what it names.
// Its messages are go-redis's, without their "redis: " prefix.
func Check(s string) (Kind, error) {
	k, plain, err := Split(s)
	if err != nil {
		return k, err
	}
	u, err := url.Parse(plain)
	if err != nil {
		return k, err
	}
	switch k {
	case Sentinel:
		return k, checkSentinel(u)
	case Cluster:
		return k, checkCluster(u)
	}
	return k, checkServer(u)
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

// Split tells the kind from the scheme and returns the URL in the form
// go-redis's parser for that kind reads: redis.ParseURL for Server,
// ParseFailoverURL for Sentinel, ParseClusterURL for Cluster.
func Split(s string) (Kind, string, error) {
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

// The query parameters go-redis (v9.23) reads for each kind, in the order
// it reads them: of several malformed ones, it names the first.
var (
	serverParams = []param{
		{"protocol", number, ""}, {"client_name", text, ""}, {"max_retries", number, ""},
		{"min_retry_backoff", duration, ""}, {"max_retry_backoff", duration, ""},
		{"dial_timeout", duration, ""}, {"read_timeout", duration, ""}, {"write_timeout", duration, ""},
		{"pool_fifo", boolean, ""}, {"pool_size", number, ""}, {"pool_timeout", duration, ""},
		{"min_idle_conns", number, ""}, {"max_idle_conns", number, ""}, {"max_active_conns", number, ""},
		{"max_concurrent_dials", number, ""}, {"pipeline_pool_size", number, ""},
		{"pipeline_read_buffer_size", number, ""}, {"pipeline_write_buffer_size", number, ""},
		{"conn_max_idle_time", duration, "idle_timeout"}, {"conn_max_lifetime", duration, "max_conn_age"},
		{"conn_max_lifetime_jitter", duration, ""},
	}
	sentinelParams = []param{
		{"master_name", text, ""}, {"client_name", text, ""}, {"route_by_latency", boolean, ""},
		{"route_by_latency_tolerance", duration, ""}, {"route_randomly", boolean, ""},
		{"replica_only", boolean, ""}, {"use_disconnected_replicas", boolean, ""},
		{"protocol", number, ""}, {"username", text, ""}, {"password", text, ""}, {"max_retries", number, ""},
		{"min_retry_backoff", duration, ""}, {"max_retry_backoff", duration, ""},
		{"dial_timeout", duration, ""}, {"dialer_retries", number, ""}, {"dialer_retry_timeout", duration, ""},
		{"read_timeout", duration, ""}, {"write_timeout", duration, ""}, {"context_timeout_enabled", boolean, ""},
		{"pool_fifo", boolean, ""}, {"pool_size", number, ""}, {"max_concurrent_dials", number, ""},
		{"min_idle_conns", number, ""}, {"max_idle_conns", number, ""}, {"max_active_conns", number, ""},
		{"pipeline_pool_size", number, ""}, {"pipeline_read_buffer_size", number, ""},
		{"pipeline_write_buffer_size", number, ""}, {"conn_max_lifetime", duration, ""},
		{"conn_max_lifetime_jitter", duration, ""}, {"conn_max_idle_time", duration, ""},
		{"pool_timeout", duration, ""}, {"disableIdentity", boolean, ""}, {"identitySuffix", text, ""},
		{"unstable_resp3", boolean, ""},
	}
	clusterParams = []param{
		{"protocol", number, ""}, {"client_name", text, ""}, {"max_redirects", number, ""},
		{"read_only", boolean, ""}, {"route_by_latency", boolean, ""},
		{"route_by_latency_tolerance", duration, ""}, {"route_randomly", boolean, ""},
		{"max_retries", number, ""}, {"min_retry_backoff", duration, ""}, {"max_retry_backoff", duration, ""},
		{"dial_timeout", duration, ""}, {"dialer_retries", number, ""}, {"dialer_retry_timeout", duration, ""},
		{"read_timeout", duration, ""}, {"write_timeout", duration, ""}, {"pool_fifo", boolean, ""},
		{"pool_size", number, ""}, {"max_concurrent_dials", number, ""}, {"min_idle_conns", number, ""},
		{"max_idle_conns", number, ""}, {"max_active_conns", number, ""}, {"pipeline_pool_size", number, ""},
		{"pipeline_read_buffer_size", number, ""}, {"pipeline_write_buffer_size", number, ""},
		{"pool_timeout", duration, ""}, {"conn_max_lifetime", duration, ""},
		{"conn_max_lifetime_jitter", duration, ""}, {"conn_max_idle_time", duration, ""},
		{"failing_timeout_seconds", number, ""},
	}
)

// checkServer is redis.ParseURL's checks.
func checkServer(u *url.URL) error {
	switch u.Scheme {
	case "redis", "rediss":
		if err := checkPathDB(u); err != nil {
			return err
		}
	case "unix":
		if strings.TrimSpace(u.Path) == "" {
			return errors.New("empty unix socket path")
		}
	default: // "redis+", which Split takes for a Server URL
		return fmt.Errorf("invalid URL scheme: %s", u.Scheme)
	}
	q := query{values: u.Query()}
	if err := q.db(); err != nil {
		return err
	}
	q.read(serverParams)
	if u.Scheme == "rediss" && q.has("skip_verify") {
		q.read([]param{{"skip_verify", boolean, ""}})
	}
	return q.end()
}

// checkSentinel is redis.ParseFailoverURL's checks, and that the URL names
// a primary.
func checkSentinel(u *url.URL) error {
	if err := checkPathDB(u); err != nil {
		return err
	}
	q := query{values: u.Query()}
	last := func(name string) string {
		if vs := q.values[name]; len(vs) > 0 {
			return vs[len(vs)-1]
		}
		return ""
	}
	primary := last("master_name")
	routed := slices.ContainsFunc([]string{"route_by_latency", "route_randomly"}, func(p string) bool {
		v := last(p)
		return v == "true" || v == "1"
	})
	q.read(sentinelParams)
	if q.err != nil {
		return q.err
	}
	if err := q.db(); err != nil {
		return err
	}
	if err := q.addrs(); err != nil {
		return err
	}
	if u.Scheme == "rediss" && q.has("skip_verify") {
		q.read([]param{{"skip_verify", boolean, ""}})
	}
	if err := q.end(); err != nil {
		return err
	}
	if primary == "" {
		return errors.New("names no primary: add ?master_name=NAME")
	}
	if routed {
		return errRouted
	}
	return nil
}

// errRouted refuses a Sentinel URL that routes commands to replicas:
// go-redis's failover client panics on it, and a budget's counts must be
// read and written on the primary.
var errRouted = errors.New("route_by_latency and route_randomly send commands to replicas, which a shared budget cannot use: leave them out")

// checkCluster is redis.ParseClusterURL's checks: it reads no path.
func checkCluster(u *url.URL) error {
	q := query{values: u.Query()}
	q.read(clusterParams)
	if q.err != nil {
		return q.err
	}
	if err := q.addrs(); err != nil {
		return err
	}
	return q.end()
}

// checkPathDB reads a database number from the path, as go-redis does for
// a server and a Sentinel URL.
func checkPathDB(u *url.URL) error {
	f := strings.FieldsFunc(u.Path, func(r rune) bool { return r == '/' })
	switch len(f) {
	case 0:
		return nil
	case 1:
		if _, err := strconv.Atoi(f[0]); err != nil {
			return fmt.Errorf("invalid database number: %q", f[0])
		}
		return nil
	}
	return fmt.Errorf("invalid URL path: %s", u.Path)
}

// A param is a query parameter go-redis reads, as what; or, when set, is
// read instead when the parameter is absent (an older name).
type param struct {
	name string
	as   valueKind
	or   string
}

type valueKind uint8

const (
	text valueKind = iota
	number
	duration
	boolean
)

// query reads parameters as go-redis's queryOptions does: the last value
// of each, each removed once read so that those left are unknown, and the
// first malformed one's error kept.
type query struct {
	values url.Values
	err    error
}

func (q *query) has(name string) bool { return len(q.values[name]) > 0 }

// take returns name's last value and removes it.
func (q *query) take(name string) string {
	vs := q.values[name]
	if len(vs) == 0 {
		return ""
	}
	delete(q.values, name)
	return vs[len(vs)-1]
}

func (q *query) read(params []param) {
	for _, p := range params {
		name := p.name
		if p.or != "" && !q.has(name) {
			name = p.or
		}
		s := q.take(name)
		if s == "" || q.err != nil {
			continue
		}
		switch p.as {
		case number:
			if _, err := strconv.Atoi(s); err != nil {
				q.err = fmt.Errorf("invalid %s number: %s", name, err)
			}
		case duration:
			if _, err := strconv.Atoi(s); err == nil {
				continue
			}
			if _, err := time.ParseDuration(s); err != nil {
				q.err = fmt.Errorf("invalid %s duration: %w", name, err)
			}
		case boolean:
			if s != "true" && s != "1" && s != "false" && s != "0" {
				q.err = fmt.Errorf("invalid %s boolean: expected true/false/1/0 or an empty string, got %q", name, s)
			}
		}
	}
}

// db reads the db parameter, whose error go-redis returns at once.
func (q *query) db() error {
	if s := q.take("db"); s != "" {
		if _, err := strconv.Atoi(s); err != nil {
			return fmt.Errorf("invalid database number: %w", err)
		}
	}
	return nil
}

// addrs reads the addr parameters: more sentinels or cluster nodes.
func (q *query) addrs() error {
	vs := q.values["addr"]
	delete(q.values, "addr")
	for _, addr := range vs {
		h, p, err := net.SplitHostPort(addr)
		if err != nil || h == "" || p == "" {
			return fmt.Errorf("unable to parse addr param: %s", addr)
		}
	}
	return nil
}

// end returns the first malformed parameter's error, else names those no
// one read.
func (q *query) end() error {
	if q.err != nil {
		return q.err
	}
	if len(q.values) == 0 {
		return nil
	}
	left := make([]string, 0, len(q.values))
	for name := range q.values {
		left = append(left, name)
	}
	slices.Sort(left)
	return fmt.Errorf("unexpected option: %s", strings.Join(left, ", "))
}
