package redisurl

import (
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

func TestOpenKinds(t *testing.T) {
	for url, want := range map[string]string{
		"redis://127.0.0.1:1":                          "*redis.Client",
		"redis+sentinel://127.0.0.1:1?master_name=m":   "*redis.Client",
		"redis+cluster://127.0.0.1:1?addr=127.0.0.1:2": "*redis.ClusterClient",
	} {
		c, err := Open(url, Timeouts{})
		if err != nil {
			t.Fatalf("Open(%q): %v", url, err)
		}
		var got string
		switch c.(type) {
		case *redis.Client:
			got = "*redis.Client"
		case *redis.ClusterClient:
			got = "*redis.ClusterClient"
		}
		if got != want {
			t.Errorf("Open(%q) is a %T, want %s", url, c, want)
		}
		c.Close()
	}
}
