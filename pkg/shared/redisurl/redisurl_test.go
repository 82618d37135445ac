package redisurl

import (
	"errors"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"
)

func TestCheck(t *testing.T) {
	tests := []struct {
		url  string
		kind Kind
		err  string // a substring; "" for none
	}{
		{"redis://10.0.0.9:6379/2", Server, ""},
		{"rediss://:secret@cache.example.com:6380", Server, ""},
		{"unix:///run/redis.sock?db=1", Server, ""},
		{"redis+sentinel://10.0.0.1:26379?master_name=budgets&addr=10.0.0.2:26379", Sentinel, ""},
		{"rediss+sentinel://s.example.com:26379/3?master_name=m", Sentinel, ""},
		{"redis+cluster://10.0.0.1:7000?addr=10.0.0.2:7000", Cluster, ""},
		{"redis://", Server, "has no host"},
		{"redis+sentinel://10.0.0.1:26379", Sentinel, "names no primary"},
		{"redis+sentinel://10.0.0.1:26379?master_name=m&route_by_latency=true", Sentinel, "route_by_latency and route_randomly"},
		{"redis+sentinel://10.0.0.1:26379?master_name=m&route_randomly=1", Sentinel, "route_by_latency and route_randomly"},
		{"redis+sentinel://10.0.0.1:26379?master_name=m&route_randomly=false", Sentinel, ""},
		{"redis://h:1/x", Server, "invalid database number"},
		{"redis://h:1?bogus=1", Server, "unexpected option: bogus"},
		{"http://h:1", Server, "is not a redis://"},
		{"redis+cache://h:1", Server, "is not a redis://"},
		{"%zz", Server, "is not a URL"},
	}
	for _, tt := range tests {
		kind, err := Check(tt.url)
		if tt.err == "" && err != nil || tt.err != "" && (err == nil || !strings.Contains(err.Error(), tt.err)) || err == nil && kind != tt.kind {
			t.Errorf("Check(%q) = %v, %v; want kind %v and an error containing %q", tt.url, kind, err, tt.kind, tt.err)
		}
	}
}

func TestRedact(t *testing.T) {
	tests := []struct{ url, want string }{
		{"redis://user:s3cret@10.0.0.1:6379/0", "redis://user:xxxxx@10.0.0.1:6379/0"},
		{"rediss://:s3cret@h:6379", "rediss://:xxxxx@h:6379"},
		{"unix://u:s3cret@/run/redis.sock?db=1", "unix://u:xxxxx@/run/redis.sock?db=1"},
		{"redis+sentinel://s:s3cret@h:26379?master_name=m&password=s3cret2", "redis+sentinel://s:xxxxx@h:26379?master_name=m&password=xxxxx"},
		{"redis://user@h:6379", "redis://user@h:6379"},
		{"redis+cluster://h:7000?addr=h2:7000", "redis+cluster://h:7000?addr=h2:7000"},
		{"%zz:s3cret", "xxxxx"},
	}
	for _, tt := range tests {
		if got := Redact(tt.url); got != tt.want {
			t.Errorf("Redact(%q) = %q, want %q", tt.url, got, tt.want)
		}
	}
}

// goRedisCheck is what Check must say: go-redis's parsers' verdict on the
// URL, their "redis: " prefix dropped, and a Sentinel URL's primary.
func goRedisCheck(s string) (Kind, error) {
	k, plain, err := Split(s)
	if err != nil {
		return k, err
	}
	var master string
	var routed bool
	switch k {
	case Sentinel:
		var o *redis.FailoverOptions
		if o, err = redis.ParseFailoverURL(plain); err == nil {
			master, routed = o.MasterName, o.RouteByLatency || o.RouteRandomly
		}
	case Cluster:
		_, err = redis.ParseClusterURL(plain)
	default:
		_, err = redis.ParseURL(plain)
	}
	switch {
	case err != nil:
		return k, errors.New(strings.TrimPrefix(err.Error(), "redis: "))
	case k == Sentinel && master == "":
		return k, errors.New("names no primary: add ?master_name=NAME")
	case routed: // redis.NewFailoverClient panics on it
		return k, errRouted
	}
	return k, nil
}

// asGoRedis are URLs for every branch of go-redis's three parsers: each
// kind's parameters of each type, well and badly formed, several at once
// (go-redis names the first it reads), repeated (it reads the last), the
// older names, the database in the path and the query, extra addresses.
var asGoRedis = []string{
	"redis://h:6379", "rediss://:secret@h:6380", "redis://h", "REDIS://h:1", "redis://:6379",
	"redis://[::1]:6379/3", "redis://h:1/2/3", "redis://h:1/x", "redis://h:1//2//", "redis://h:1/-1",
	"redis://h:1?db=3", "redis://h:1?db=x", "redis://h:1?db=", "redis://h:1?db=1&db=x", "redis://h:1/2?db=x",
	"redis://h:1?protocol=3", "redis://h:1?protocol=x", "redis://h:1?client_name=a&client_name=",
	"redis://h:1?dial_timeout=3", "redis://h:1?dial_timeout=3s", "redis://h:1?dial_timeout=-1",
	"redis://h:1?dial_timeout=soon", "redis://h:1?read_timeout=1.5", "redis://h:1?write_timeout=0",
	"redis://h:1?pool_fifo=true", "redis://h:1?pool_fifo=yes", "redis://h:1?pool_fifo=", "redis://h:1?pool_fifo=0",
	"redis://h:1?pool_size=1&pool_size=x", "redis://h:1?pool_size=x&dial_timeout=y", "redis://h:1?db=x&pool_size=y",
	"redis://h:1?min_idle_conns=1&max_idle_conns=2&max_active_conns=3&max_concurrent_dials=4",
	"redis://h:1?pipeline_pool_size=-1&pipeline_read_buffer_size=1&pipeline_write_buffer_size=x",
	"redis://h:1?max_retries=-1&min_retry_backoff=8ms&max_retry_backoff=x&pool_timeout=1",
	"redis://h:1?idle_timeout=1s", "redis://h:1?idle_timeout=x", "redis://h:1?conn_max_idle_time=1s&idle_timeout=1s",
	"redis://h:1?max_conn_age=5", "redis://h:1?conn_max_lifetime=1m&max_conn_age=1", "redis://h:1?conn_max_lifetime_jitter=x",
	"redis://h:1?skip_verify=true", "rediss://h:1?skip_verify=true", "rediss://h:1?skip_verify=maybe",
	"rediss://h:1?skip_verify=maybe&pool_size=x", "redis://h:1?bogus=1", "redis://h:1?bogus=1&alpha=2",
	"redis://h:1?addr=h:2", "redis://h:1?master_name=m", "redis://h:1?password=x", "redis://h:1?a",
	"redis://h:1?route_by_latency=true", "redis://h:1?failing_timeout_seconds=1", "redis://h:1?x=%zz&db=2",
	"unix:///run/redis.sock", "unix:///run/redis.sock?db=1", "unix:///run/redis.sock?db=x", "unix://",
	"unix://u:p@/run/redis.sock", "unix:///r.sock?skip_verify=1", "unix:///r.sock?dial_timeout=x",
	"unix:///%20", "unix:foo", "unix:///r.sock/2",
	"redis+sentinel://h:26379?master_name=m", "redis+sentinel://h:26379?master_name=m&addr=h2:26379&addr=h3:26379",
	"redis+sentinel://h:1?master_name=m&addr=bad", "redis+sentinel://h:1?master_name=m&addr=:1",
	"redis+sentinel://h:1?master_name=m&addr=h:", "redis+sentinel://h:1", "redis+sentinel://h:1?master_name=",
	"redis+sentinel://h:1?master_name=a&master_name=", "redis+sentinel://h:1?master_name=&master_name=a",
	"rediss+sentinel://h:1?master_name=m&skip_verify=true", "rediss+sentinel://h:1?master_name=m&skip_verify=x",
	"redis+sentinel://h:1?master_name=m&skip_verify=true", "redis+sentinel://h:1/3?master_name=m",
	"redis+sentinel://h:1/x?master_name=m", "redis+sentinel://h:1/1/2?master_name=m",
	"redis+sentinel://h:1?db=x&master_name=m", "redis+sentinel://h:1?db=x&pool_size=y&master_name=m",
	"redis+sentinel://h:1?db=x&addr=bad&master_name=m", "redis+sentinel://h:1?addr=bad&bogus=1&master_name=m",
	"redis+sentinel://u:p@h:1?username=u&password=p&master_name=m", "redis+sentinel://h:1?master_name=m&route_by_latency=true",
	"redis+sentinel://h:1?master_name=m&route_randomly=x&replica_only=1&use_disconnected_replicas=0",
	"redis+sentinel://h:1?master_name=m&disableIdentity=true&identitySuffix=s&unstable_resp3=x",
	"redis+sentinel://h:1?master_name=m&dialer_retries=x&dialer_retry_timeout=y&context_timeout_enabled=1",
	"redis+sentinel://h:1?master_name=m&route_by_latency_tolerance=5ms&conn_max_lifetime_jitter=x",
	"redis+sentinel://h:1?bogus=1", "redis+sentinel://h:1?master_name=m&idle_timeout=1",
	"redis+sentinel://h:1?master_name=m&failing_timeout_seconds=1", "redis+sentinel://h:1?master_name=m&max_redirects=1",
	"redis+cluster://h:7000", "redis+cluster://h:7000?addr=h2:7000&addr=h3:7000", "redis+cluster://h:7000?addr=bad",
	"redis+cluster://h:7000/5", "redis+cluster://h:7000/x/y", "redis+cluster://h:7000?db=1", "redis+cluster://h:7000?read_only=true",
	"redis+cluster://h:7000?read_only=x", "redis+cluster://h:7000?max_redirects=x", "redis+cluster://h:7000?failing_timeout_seconds=3",
	"rediss+cluster://h:7000?skip_verify=true", "redis+cluster://h:7000?master_name=m", "redis+cluster://h:7000?pool_size=x&addr=bad",
	"redis+cluster://h:7000?addr=bad&bogus=1", "redis+cluster://h:7000?idle_timeout=1&route_randomly=true&dialer_retries=2",
	"redis+cluster://u:p@[::1]:7000?addr=[::2]:7000", "redis+cluster://h:7000?conn_max_idle_time=x&conn_max_lifetime=y",
	"redis://", "http://h:1", "redis+cache://h:1", "unix+sentinel://h", "%zz", "", "redis://h:abc", "redis+sentinel://",
	"redis+://h:1", "rediss+://h:1/x", "unix+:///r.sock",
}

// Check says what go-redis's parsers say, for every URL above and for the
// fuzzer's.
func FuzzCheck(f *testing.F) {
	for _, s := range asGoRedis {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		kind, err := Check(s)
		wantKind, want := goRedisCheck(s)
		if kind != wantKind || errText(err) != errText(want) {
			t.Errorf("Check(%q) = %v, %q; go-redis: %v, %q", s, kind, errText(err), wantKind, errText(want))
		}
	})
}

func errText(err error) string {
	if err == nil {
		return "<nil>"
	}
	return err.Error()
}
