package policy

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/egressd/egressd/pkg/kernelrule"
)

func mustDest(t testing.TB, s string) Destination {
	t.Helper()
	d, err := ParseDestination(s)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// example is the policy of the issue that specified the file format.
const example = `rules:
  - name: payments
    destination: 10.20.0.0/16
    port: 443
    unit: payments.service        # or cgroup: /system.slice/payments.service; absent = whole host
    concurrency: 50
  - name: email
    destination: smtp.example.com
    port: 25
    perSecond: {permits: 10, burst: 20}
  - name: search
    destination: 127.0.0.1
    port: 9200
    perWindow: {permits: 1000, window: 1m, segments: 8}
  - name: api
    destination: 2001:db8::/32
    adaptive: {minimum: 4, maximum: 200}
    shadow: true
`

func TestParseGood(t *testing.T) {
	tests := []struct {
		name string
		in   string
		want []Rule
	}{
		{name: "empty file", in: ""},
		{name: "comments only", in: "# nothing limited yet\n"},
		{name: "null document", in: "~\n"},
		{name: "rules null", in: "rules:\n"},
		{name: "rules empty", in: "rules: []\n"},
		{
			name: "issue example",
			in:   example,
			want: []Rule{
				{Name: "payments", Destination: mustDest(t, "10.20.0.0/16"), Port: 443, Scope: Scope{Unit: "payments.service"}, Limit: Concurrency(50)},
				{Name: "email", Destination: mustDest(t, "smtp.example.com"), Port: 25, Limit: PerSecond{Permits: 10, Burst: 20}},
				{Name: "search", Destination: mustDest(t, "127.0.0.1"), Port: 9200, Limit: PerWindow{Permits: 1000, Window: time.Minute, Segments: 8}},
				{Name: "api", Destination: mustDest(t, "2001:db8::/32"), Limit: Adaptive{Minimum: 4, Maximum: 200}, Shadow: true},
			},
		},
		{
			name: "protocols",
			in: `rules:
  - {name: a, destination: 10.0.0.1, concurrency: 5, protocols: [tcp]}
  - {name: b, destination: 10.0.0.2, concurrency: 5, protocols: [udp], udpIdle: 30s}
  - {name: c, destination: 10.0.0.3, port: 443, perSecond: {permits: 5}, protocols: [udp, tcp]}
`,
			want: []Rule{
				{Name: "a", Destination: mustDest(t, "10.0.0.1"), Limit: Concurrency(5), Protocols: kernelrule.ProtoTCP},
				{Name: "b", Destination: mustDest(t, "10.0.0.2"), Limit: Concurrency(5), Protocols: kernelrule.ProtoUDP, UDPIdle: 30 * time.Second},
				{Name: "c", Destination: mustDest(t, "10.0.0.3"), Port: 443, Limit: PerSecond{Permits: 5}, Protocols: kernelrule.ProtoTCP | kernelrule.ProtoUDP},
			},
		},
		{
			name: "defaults left zero",
			in: `rules:
  - name: a
    destination: 10.0.0.1
    perSecond: {permits: 5}
  - name: b
    destination: 10.0.0.2
    perWindow: {permits: 5, window: 10s}
  - name: c
    destination: 10.0.0.3
    adaptive: {}
`,
			want: []Rule{
				{Name: "a", Destination: mustDest(t, "10.0.0.1"), Limit: PerSecond{Permits: 5}},
				{Name: "b", Destination: mustDest(t, "10.0.0.2"), Limit: PerWindow{Permits: 5, Window: 10 * time.Second}},
				{Name: "c", Destination: mustDest(t, "10.0.0.3"), Limit: Adaptive{}},
			},
		},
		{
			name: "every field",
			in: `rules:
  - name: api-eu_1.prod
    destination: api.example.com.
    port: 8443
    cgroup: /system.slice/docker-abc.scope
    adaptive:
      minimum: 2
      maximum: 64
      initial: 8
      multiple: 1.5
      decreaseFactor: 0.75
      samples: request
    shadow: false
    errno: ECONNREFUSED
`,
			want: []Rule{{
				Name:        "api-eu_1.prod",
				Destination: mustDest(t, "api.example.com."),
				Port:        8443,
				Scope:       Scope{Cgroup: "/system.slice/docker-abc.scope"},
				Limit:       Adaptive{Minimum: 2, Maximum: 64, Initial: 8, Multiple: 1.5, DecreaseFactor: 0.75, Samples: SamplesRequest},
				Errno:       "ECONNREFUSED",
			}},
		},
		{
			name: "shared budgets",
			in: `rules:
  - name: quota
    destination: api.example.com
    perSecond: {permits: 100}
    shared: {redis: "redis://:secret@10.0.0.9:6379/2", key: "egressd:api"}
  - name: pool
    destination: 10.0.0.5
    concurrency: 10
    shared: {redis: unix:///run/redis.sock, key: pool, failureMode: deny}
  - name: ha
    destination: 10.0.0.6
    concurrency: 20
    shared:
      redis: "redis+sentinel://10.0.0.7:26379?master_name=budgets&addr=10.0.0.8:26379"
      key: "{ha}:pool"
      durability: persistent
      lease: 30s
      replicas: 1
`,
			want: []Rule{
				{Name: "quota", Destination: mustDest(t, "api.example.com"), Limit: PerSecond{Permits: 100}, Shared: Shared{Redis: "redis://:secret@10.0.0.9:6379/2", Key: "egressd:api"}},
				{Name: "pool", Destination: mustDest(t, "10.0.0.5"), Limit: Concurrency(10), Shared: Shared{Redis: "unix:///run/redis.sock", Key: "pool", FailureMode: FailureDeny}},
				{Name: "ha", Destination: mustDest(t, "10.0.0.6"), Limit: Concurrency(20), Shared: Shared{Redis: "redis+sentinel://10.0.0.7:26379?master_name=budgets&addr=10.0.0.8:26379", Key: "{ha}:pool",
					Durability: DurabilityPersistent, Lease: 30 * time.Second, Replicas: 1}},
			},
		},
		{
			// Same destination, told apart by port or by scope: no conflict.
			name: "distinct matches",
			in: `rules:
  - {name: a, destination: 10.0.0.0/8, concurrency: 1}
  - {name: b, destination: 10.0.0.0/8, port: 80, concurrency: 1}
  - {name: c, destination: 10.0.0.0/8, unit: a.service, concurrency: 1}
  - {name: d, destination: 10.0.0.0/8, cgroup: /a.slice, concurrency: 1}
  - {name: e, destination: 10.0.0.0/16, concurrency: 1}
`,
			want: []Rule{
				{Name: "a", Destination: mustDest(t, "10.0.0.0/8"), Limit: Concurrency(1)},
				{Name: "b", Destination: mustDest(t, "10.0.0.0/8"), Port: 80, Limit: Concurrency(1)},
				{Name: "c", Destination: mustDest(t, "10.0.0.0/8"), Scope: Scope{Unit: "a.service"}, Limit: Concurrency(1)},
				{Name: "d", Destination: mustDest(t, "10.0.0.0/8"), Scope: Scope{Cgroup: "/a.slice"}, Limit: Concurrency(1)},
				{Name: "e", Destination: mustDest(t, "10.0.0.0/16"), Limit: Concurrency(1)},
			},
		},
		{
			name: "limits at the kernel's largest",
			in: `rules:
  - {name: a, destination: 10.0.0.1, perSecond: {permits: 1000000, burst: 1000000}}
  - {name: b, destination: 10.0.0.2, perWindow: {permits: 4294967295, window: 32ms, segments: 32}}
  - {name: c, destination: 10.0.0.3, concurrency: 4294967295}
  - {name: d, destination: 10.0.0.4, adaptive: {maximum: 4294967295}}
  - {name: e, destination: 10.0.0.5, port: 65535, perWindow: {permits: 1, window: 1ms, segments: 1}}
`,
			want: []Rule{
				{Name: "a", Destination: mustDest(t, "10.0.0.1"), Limit: PerSecond{Permits: 1000000, Burst: 1000000}},
				{Name: "b", Destination: mustDest(t, "10.0.0.2"), Limit: PerWindow{Permits: 4294967295, Window: 32 * time.Millisecond, Segments: 32}},
				{Name: "c", Destination: mustDest(t, "10.0.0.3"), Limit: Concurrency(4294967295)},
				{Name: "d", Destination: mustDest(t, "10.0.0.4"), Limit: Adaptive{Maximum: 4294967295}},
				{Name: "e", Destination: mustDest(t, "10.0.0.5"), Port: 65535, Limit: PerWindow{Permits: 1, Window: time.Millisecond, Segments: 1}},
			},
		},
		{
			name: "name of 63 bytes, host name rule of 40",
			in: `rules:
  - {name: ` + strings.Repeat("n", 63) + `, destination: 10.0.0.1, concurrency: 1}
  - {name: ` + strings.Repeat("h", 40) + `, destination: db.internal, concurrency: 1}
`,
			want: []Rule{
				{Name: strings.Repeat("n", 63), Destination: mustDest(t, "10.0.0.1"), Limit: Concurrency(1)},
				{Name: strings.Repeat("h", 40), Destination: mustDest(t, "db.internal"), Limit: Concurrency(1)},
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Parse([]byte(tt.in))
			if err != nil {
				t.Fatalf("Parse: %v", err)
			}
			if !reflect.DeepEqual(got.Rules, tt.want) {
				t.Errorf("Parse rules\n got %+v\nwant %+v", got.Rules, tt.want)
			}
		})
	}
}

func TestParseBad(t *testing.T) {
	tests := []struct {
		name string
		in   string
		want []Problem
	}{
		{
			name: "more rules than maxRules",
			in:   "maxRules: 1\nrules:\n  - {name: a, destination: 10.0.0.1, concurrency: 1}\n  - {name: b, destination: 10.0.0.2, concurrency: 1}\n",
			want: []Problem{{Line: 1, Column: 11, Msg: "2 rules do not fit maxRules 1"}},
		},
		{
			name: "maxRules beyond a datapath",
			in:   "maxRules: 2000000\n",
			want: []Problem{{Line: 1, Column: 11, Msg: "maxRules 2000000 is outside 1..1048576"}},
		},
		{
			name: "shared with nothing set",
			in: `rules:
  - {name: a, destination: 10.0.0.1, concurrency: 1, shared: {}}
  - {name: b, destination: 10.0.0.2, concurrency: 1, shared: {replicas: 0}}
  - {name: c, destination: 10.0.0.3, concurrency: 1, shared: {redis: ""}}
`,
			want: []Problem{
				{Line: 2, Column: 62, Rule: "a", Msg: "shared.redis is missing: the URL of the Redis server that keeps the budget"},
				{Line: 2, Column: 62, Rule: "a", Msg: "shared.key is missing: the Redis key every host sharing the budget names"},
				{Line: 3, Column: 62, Rule: "b", Msg: "shared.redis is missing: the URL of the Redis server that keeps the budget"},
				{Line: 3, Column: 62, Rule: "b", Msg: "shared.key is missing: the Redis key every host sharing the budget names"},
				{Line: 4, Column: 62, Rule: "c", Msg: "shared.key is missing: the Redis key every host sharing the budget names"},
				{Line: 4, Column: 70, Rule: "c", Msg: "shared.redis is empty: give the URL of the Redis server that keeps the budget"},
			},
		},
		{
			name: "protocols not known, empty, twice or not a list",
			in: `rules:
  - {name: a, destination: 10.0.0.1, concurrency: 1, protocols: [sctp]}
  - {name: b, destination: 10.0.0.2, concurrency: 1, protocols: []}
  - {name: c, destination: 10.0.0.3, concurrency: 1, protocols: [udp, udp]}
  - {name: d, destination: 10.0.0.4, concurrency: 1, protocols: udp}
`,
			want: []Problem{
				{Line: 2, Column: 66, Rule: "a", Msg: `protocols: "sctp" is not tcp or udp`},
				{Line: 3, Column: 65, Rule: "b", Msg: "protocols is empty; name tcp, udp or both, or leave it out for [tcp]"},
				{Line: 4, Column: 71, Rule: "c", Msg: "protocols names udp twice"},
				{Line: 5, Column: 65, Rule: "d", Msg: "protocols is a list, such as [tcp, udp]"},
			},
		},
		{
			name: "udp where it does not fit",
			in: `rules:
  - {name: a, destination: 10.0.0.1, adaptive: {}, protocols: [tcp, udp]}
  - {name: b, destination: 10.0.0.2, concurrency: 1, udpIdle: 10s}
  - {name: c, destination: 10.0.0.3, concurrency: 1, protocols: [udp], udpIdle: 1500ms}
`,
			want: []Problem{
				{Line: 2, Column: 63, Rule: "a", Msg: "an adaptive rule cannot count UDP: its loop judges latency the kernel measures on TCP connections (their handshake or their requests), and a UDP flow shows none it can trust; use protocols: [tcp], or a fixed limit"},
				{Line: 3, Column: 63, Rule: "b", Msg: "udpIdle is for UDP flows, and protocols has no udp"},
				{Line: 4, Column: 81, Rule: "c", Msg: "udpIdle 1.5s is not a whole number of seconds between 1s and 18h12m15s"},
			},
		},
		{
			name: "shared lease 0",
			in:   "rules:\n  - {name: a, destination: 10.0.0.1, concurrency: 1, shared: {redis: 'redis://r:6379', key: k, lease: 0s}}\n",
			want: []Problem{{Line: 2, Column: 103, Rule: "a", Msg: "shared.lease 0 is not allowed; leave it out for the default"}},
		},
		{
			name: "metrics.rules",
			in:   "metrics: {rules: [a, '', 'b[', 5]}\n",
			want: []Problem{
				{Line: 1, Column: 22, Msg: "metrics.rules has an empty name"},
				{Line: 1, Column: 26, Msg: `metrics.rules "b[" is not a pattern: syntax error in pattern`},
				{Line: 1, Column: 32, Msg: "metrics.rules must be a string"},
			},
		},
		{
			name: "metrics.rules not a list",
			in:   "metrics: {rules: a}\n",
			want: []Problem{{Line: 1, Column: 18, Msg: "metrics.rules must be a list of rule names or patterns"}},
		},
		{
			name: "maxRules 0",
			in:   "maxRules: 0\n",
			want: []Problem{{Line: 1, Column: 11, Msg: "maxRules 0 is not allowed; leave it out for the default"}},
		},
		{
			name: "unknown top-level field",
			in:   "Rules: []\nversion: 2\n",
			want: []Problem{
				{Line: 1, Column: 1, Msg: `unknown field "Rules" (did you mean rules?)`},
				{Line: 2, Column: 1, Msg: `unknown field "version"`},
			},
		},
		{
			name: "unknown fields in a rule and in a limit",
			in: `rules:
  - name: a
    destination: 10.0.0.1
    per_second: {permits: 1}
    perWindow: {permits: 1, window: 1s, segment: 4}
    adaptive_samples: request
`,
			want: []Problem{
				{Line: 4, Column: 5, Rule: "a", Msg: `unknown field "per_second" (did you mean perSecond?)`},
				{Line: 5, Column: 41, Rule: "a", Msg: `unknown field "perWindow.segment" (did you mean segments?)`},
				{Line: 6, Column: 5, Rule: "a", Msg: `unknown field "adaptive_samples"`},
			},
		},
		{
			name: "duplicate names",
			in: `rules:
  - {name: a, destination: 10.0.0.1, concurrency: 1}
  - {name: b, destination: 10.0.0.2, concurrency: 1}
  - {name: a, destination: 10.0.0.3, concurrency: 1}
`,
			want: []Problem{
				{Line: 4, Column: 12, Rule: "a", Msg: "name a is already used by the rule at line 2"},
			},
		},
		{
			name: "bad destinations",
			in: `rules:
  - {name: a, destination: 10.0.0.0/33, concurrency: 1}
  - {name: b, destination: 10.20.1.0/16, concurrency: 1}
  - {name: c, destination: 10.0.0.256, concurrency: 1}
  - {name: d, destination: bad_host-.example, concurrency: 1}
  - {name: e, destination: "fe80::1%eth0", concurrency: 1}
  - {name: f, destination: "", concurrency: 1}
  - {name: g, destination: 80, concurrency: 1}
  - {name: h, concurrency: 1}
`,
			want: []Problem{
				{Line: 2, Column: 28, Rule: "a", Msg: `destination "10.0.0.0/33" is not a valid CIDR: prefix length out of range`},
				{Line: 3, Column: 28, Rule: "b", Msg: "destination 10.20.1.0/16 has bits set past /16; write 10.20.0.0/16"},
				{Line: 4, Column: 28, Rule: "c", Msg: `destination "10.0.0.256" is not a valid IP address: IPv4 field has value >255`},
				{Line: 5, Column: 28, Rule: "d", Msg: `destination "bad_host-.example" is not an IP address, CIDR or host name`},
				{Line: 6, Column: 28, Rule: "e", Msg: "destination fe80::1%eth0 has a zone; rules match addresses without one"},
				{Line: 7, Column: 28, Rule: "f", Msg: `destination "" is not an IP address, CIDR or host name`},
				{Line: 8, Column: 28, Rule: "g", Msg: "destination must be a string"},
				{Line: 9, Column: 5, Rule: "h", Msg: "destination is missing"},
			},
		},
		{
			name: "zero and negative limits",
			in: `rules:
  - {name: a, destination: 10.0.0.1, concurrency: 0}
  - {name: b, destination: 10.0.0.2, concurrency: -3}
  - {name: c, destination: 10.0.0.3, perSecond: {permits: 0, burst: 0}}
  - {name: d, destination: 10.0.0.4, perSecond: {burst: -1}}
  - {name: e, destination: 10.0.0.5, perWindow: {permits: -1, window: 1s}}
  - {name: f, destination: 10.0.0.6, adaptive: {minimum: 0, multiple: 0}}
`,
			want: []Problem{
				{Line: 2, Column: 51, Rule: "a", Msg: "concurrency must be at least 1"},
				{Line: 3, Column: 51, Rule: "b", Msg: "concurrency must be at least 1"},
				{Line: 4, Column: 59, Rule: "c", Msg: "perSecond.permits must be at least 1"},
				{Line: 4, Column: 69, Rule: "c", Msg: "perSecond.burst 0 is not allowed; leave it out for the default"},
				{Line: 5, Column: 49, Rule: "d", Msg: "perSecond.permits must be at least 1"},
				{Line: 5, Column: 57, Rule: "d", Msg: "perSecond.burst must be at least 1"},
				{Line: 6, Column: 59, Rule: "e", Msg: "perWindow.permits must be at least 1"},
				{Line: 7, Column: 58, Rule: "f", Msg: "adaptive.minimum 0 is not allowed; leave it out for the default"},
				{Line: 7, Column: 71, Rule: "f", Msg: "adaptive.multiple 0 is not allowed; leave it out for the default"},
			},
		},
		{
			name: "limits above the kernel's",
			in: `rules:
  - {name: a, destination: 10.0.0.1, perSecond: {permits: 1000001, burst: 2000000}}
  - {name: b, destination: 10.0.0.2, concurrency: 4294967296}
  - {name: c, destination: 10.0.0.3, adaptive: {maximum: 4294967296}}
  - {name: d, destination: 10.0.0.4, concurrency: 99999999999999999999}
  - {name: e, destination: 10.0.0.5, concurrency: 18446744073709551615}
  - {name: f, destination: 10.0.0.6, port: -99999999999999999999, perSecond: {permits: 0x1FFFFFFFFFFFFFFFFF, burst: 1_000_000_000_000_000_000_000}}
  - {name: g, destination: 10.0.0.7, concurrency: "99999999999999999999"}
  - {name: h, destination: 10.0.0.8, concurrency: 1e30}
`,
			want: []Problem{
				{Line: 2, Column: 59, Rule: "a", Msg: "perSecond.permits 1000001 is above 1000000, the kernel's largest"},
				{Line: 2, Column: 75, Rule: "a", Msg: "perSecond.burst 2000000 is above 1000000, the kernel's largest"},
				{Line: 3, Column: 51, Rule: "b", Msg: "concurrency 4294967296 is above 4294967295, the kernel's largest"},
				{Line: 4, Column: 58, Rule: "c", Msg: "adaptive.maximum 4294967296 is above 4294967295, the kernel's largest"},
				{Line: 5, Column: 51, Rule: "d", Msg: "concurrency 99999999999999999999 is outside 1..4294967295"},
				{Line: 6, Column: 51, Rule: "e", Msg: "concurrency 18446744073709551615 is outside 1..4294967295"},
				{Line: 7, Column: 44, Rule: "f", Msg: "port -99999999999999999999 is outside 1..65535"},
				{Line: 7, Column: 88, Rule: "f", Msg: "perSecond.permits 0x1FFFFFFFFFFFFFFFFF is outside 1..1000000"},
				{Line: 7, Column: 117, Rule: "f", Msg: "perSecond.burst 1_000_000_000_000_000_000_000 is outside 1..1000000"},
				{Line: 8, Column: 51, Rule: "g", Msg: "concurrency must be a whole number"},
				{Line: 9, Column: 51, Rule: "h", Msg: "concurrency must be a whole number"},
			},
		},
		{
			name: "no limit and two limits",
			in: `rules:
  - name: a
    destination: 10.0.0.1
  - name: b
    destination: 10.0.0.2
    concurrency: 5
    perSecond: {permits: 5}
    adaptive: {}
`,
			want: []Problem{
				{Line: 2, Column: 5, Rule: "a", Msg: "no limit: give one of concurrency, perSecond, perWindow or adaptive"},
				{Line: 7, Column: 5, Rule: "b", Msg: "concurrency and perSecond are both given; a rule has one limit"},
				{Line: 8, Column: 5, Rule: "b", Msg: "concurrency and adaptive are both given; a rule has one limit"},
			},
		},
		{
			name: "ports",
			in: `rules:
  - {name: a, destination: 10.0.0.1, port: 0, concurrency: 1}
  - {name: b, destination: 10.0.0.2, port: 65536, concurrency: 1}
  - {name: c, destination: 10.0.0.3, port: https, concurrency: 1}
  - {name: d, destination: 10.0.0.4, port: -1, concurrency: 1}
`,
			want: []Problem{
				{Line: 2, Column: 44, Rule: "a", Msg: "port 0 is outside 1..65535; leave it out for any port"},
				{Line: 3, Column: 44, Rule: "b", Msg: "port 65536 is outside 1..65535; leave it out for any port"},
				{Line: 4, Column: 44, Rule: "c", Msg: "port must be a whole number"},
				{Line: 5, Column: 44, Rule: "d", Msg: "port -1 is outside 1..65535; leave it out for any port"},
			},
		},
		{
			name: "scopes",
			in: `rules:
  - {name: a, destination: 10.0.0.1, unit: a.service, cgroup: /a, concurrency: 1}
  - {name: b, destination: 10.0.0.1, unit: payments, concurrency: 1}
  - {name: c, destination: 10.0.0.1, unit: getty@.service, concurrency: 1}
  - {name: d, destination: 10.0.0.1, unit: "a b.service", concurrency: 1}
  - {name: e, destination: 10.0.0.1, unit: a.timer, concurrency: 1}
  - {name: f, destination: 10.0.0.1, unit: -.slice, concurrency: 1}
  - {name: g, destination: 10.0.0.1, cgroup: system.slice, concurrency: 1}
  - {name: h, destination: 10.0.0.1, cgroup: /, concurrency: 1}
  - {name: i, destination: 10.0.0.1, cgroup: /a//b/, concurrency: 1}
  - {name: j, destination: 10.0.0.1, cgroup: /1/2/3/4/5/6/7/8/9/10/11/12/13/14/15/16, concurrency: 1}
  - {name: k, destination: 10.0.0.1, unit: "", concurrency: 1}
  - {name: l, destination: 10.0.0.1, unit: .service, concurrency: 1}
  - {name: m, destination: 10.0.0.1, unit: xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx.service, concurrency: 1}
  - {name: n, destination: 10.0.0.1, cgroup: "/a\u0007b", concurrency: 1}
`,
			want: []Problem{
				{Line: 2, Column: 63, Rule: "a", Msg: "unit and cgroup are both given; a rule has one scope"},
				{Line: 3, Column: 44, Rule: "b", Msg: `unit "payments" does not end in a unit type that owns a cgroup (.service, .socket, .scope, .slice, .mount, .swap)`},
				{Line: 4, Column: 44, Rule: "c", Msg: `unit "getty@.service" is a template; name an instance of it`},
				{Line: 5, Column: 44, Rule: "d", Msg: `unit "a b.service" has characters systemd does not allow in unit names`},
				{Line: 6, Column: 44, Rule: "e", Msg: `unit "a.timer" does not end in a unit type that owns a cgroup (.service, .socket, .scope, .slice, .mount, .swap)`},
				{Line: 7, Column: 44, Rule: "f", Msg: `unit "-.slice" is the root slice; leave the scope out for the whole host`},
				{Line: 8, Column: 46, Rule: "g", Msg: `cgroup "system.slice" must start with / (a path inside the cgroup2 hierarchy)`},
				{Line: 9, Column: 46, Rule: "h", Msg: `cgroup "/" is the whole host; leave the scope out instead`},
				{Line: 10, Column: 46, Rule: "i", Msg: `cgroup "/a//b/" is not a clean path; write /a/b`},
				{Line: 11, Column: 46, Rule: "j", Msg: `cgroup "/1/2/3/4/5/6/7/8/9/10/11/12/13/14/15/16" is deeper than 15 levels, the most the kernel follows`},
				{Line: 12, Column: 44, Rule: "k", Msg: "unit is empty; leave it out for the whole host"},
				{Line: 13, Column: 44, Rule: "l", Msg: `unit ".service" has no name before its type`},
				{Line: 14, Column: 44, Rule: "m", Msg: `unit "` + strings.Repeat("x", 248) + `.service" is longer than 255 bytes`},
				{Line: 15, Column: 46, Rule: "n", Msg: `cgroup "/a\ab" has control characters or invalid UTF-8`},
			},
		},
		{
			name: "windows and segments",
			in: `rules:
  - {name: a, destination: 10.0.0.1, perWindow: {permits: 1, window: 0s}}
  - {name: b, destination: 10.0.0.2, perWindow: {permits: 1, window: -1m}}
  - {name: c, destination: 10.0.0.3, perWindow: {permits: 1}}
  - {name: d, destination: 10.0.0.4, perWindow: {permits: 1, window: 60}}
  - {name: e, destination: 10.0.0.5, perWindow: {permits: 1, window: 1s, segments: 0}}
  - {name: f, destination: 10.0.0.6, perWindow: {permits: 1, window: 1s, segments: 33}}
  - {name: g, destination: 10.0.0.7, perWindow: {permits: 1, window: 7ms}}
  - {name: h, destination: 10.0.0.8, perWindow: {permits: 1, window: 1 minute}}
`,
			want: []Problem{
				{Line: 2, Column: 70, Rule: "a", Msg: "perWindow.window must be positive"},
				{Line: 3, Column: 70, Rule: "b", Msg: "perWindow.window must be positive"},
				{Line: 4, Column: 49, Rule: "c", Msg: "perWindow.window must be positive"},
				{Line: 5, Column: 70, Rule: "d", Msg: "perWindow.window must be a duration such as 30s or 1m"},
				{Line: 6, Column: 84, Rule: "e", Msg: "perWindow.segments 0 is not allowed; leave it out for the default"},
				{Line: 7, Column: 84, Rule: "f", Msg: "perWindow.segments 33 is outside 1..32"},
				{Line: 8, Column: 70, Rule: "g", Msg: "perWindow.window 7ms in 8 segments makes segments shorter than 1ms"},
				{Line: 9, Column: 70, Rule: "h", Msg: "perWindow.window must be a duration such as 30s or 1m"},
			},
		},
		{
			name: "errno",
			in: `rules:
  - {name: a, destination: 10.0.0.1, concurrency: 1, errno: EINVAL}
  - {name: b, destination: 10.0.0.2, concurrency: 1, errno: eperm}
  - {name: c, destination: 10.0.0.3, concurrency: 1, errno: 1}
`,
			want: []Problem{
				{Line: 2, Column: 61, Rule: "a", Msg: `errno "EINVAL" is not one a refusal may use: EACCES, EAGAIN, ECONNREFUSED, EHOSTUNREACH, ENETUNREACH, ENOBUFS, EPERM, ETIMEDOUT`},
				{Line: 3, Column: 61, Rule: "b", Msg: `errno "eperm" is not one a refusal may use: EACCES, EAGAIN, ECONNREFUSED, EHOSTUNREACH, ENETUNREACH, ENOBUFS, EPERM, ETIMEDOUT`},
				{Line: 4, Column: 61, Rule: "c", Msg: "errno must be a string"},
			},
		},
		{
			name: "shared budgets",
			in: `rules:
  - {name: a, destination: 10.0.0.1, concurrency: 1, shared: {key: k}}
  - {name: b, destination: 10.0.0.2, concurrency: 1, shared: {redis: "http://x", key: "a b", failureMode: open}}
  - {name: c, destination: 10.0.0.3, adaptive: {}, shared: {redis: "redis://", key: k}, shadow: true}
  - {name: d, destination: 10.0.0.4, concurrency: 1, shared: {redis: "redis://h/x", key: "", ttl: 1}}
  - {name: e, destination: 10.0.0.5, concurrency: 1, shared: redis}
  - {name: f, destination: 10.0.0.6, concurrency: 1, shared: {redis: "redis+sentinel://s:26379?master_name=m", key: k, durability: lasting, lease: 1s, replicas: 0}}
  - {name: g, destination: 10.0.0.7, concurrency: 1, shared: {redis: "redis+cluster://c:7000", key: k, lease: 1h, replicas: -1}}
  - {name: h, destination: 10.0.0.8, concurrency: 1, shared: {redis: "redis+sentinel://s:26379", key: k, lease: soon, replicas: 1}}
`,
			want: []Problem{
				{Line: 2, Column: 62, Rule: "a", Msg: "shared.redis is missing: the URL of the Redis server that keeps the budget"},
				{Line: 3, Column: 70, Rule: "b", Msg: `shared.redis "http://x" is not a redis://, rediss://, unix://, redis+sentinel:// or redis+cluster:// URL`},
				{Line: 3, Column: 87, Rule: "b", Msg: "shared.key has whitespace or unprintable characters"},
				{Line: 3, Column: 107, Rule: "b", Msg: `shared.failureMode "open" is not throw, allow or deny`},
				{Line: 4, Column: 60, Rule: "c", Msg: "an adaptive limit cannot be shared: each host's loop sizes its own"},
				{Line: 4, Column: 60, Rule: "c", Msg: "a shadow rule cannot be shared: it would spend the budget it only watches"},
				{Line: 4, Column: 68, Rule: "c", Msg: `shared.redis "redis://" has no host`},
				{Line: 5, Column: 70, Rule: "d", Msg: `shared.redis "redis://h/x" invalid database number: "x"`},
				{Line: 5, Column: 90, Rule: "d", Msg: "shared.key is empty"},
				{Line: 5, Column: 94, Rule: "d", Msg: `unknown field "shared.ttl"`},
				{Line: 6, Column: 62, Rule: "e", Msg: "shared must be a mapping of redis, key, failureMode, durability, lease, replicas"},
				{Line: 7, Column: 132, Rule: "f", Msg: `shared.durability "lasting" is not ephemeral or persistent`},
				{Line: 7, Column: 148, Rule: "f", Msg: "shared.lease 1s is not between 2s and 10m0s (leave it out for 10s)"},
				{Line: 7, Column: 162, Rule: "f", Msg: "shared.replicas must be at least 1 with Sentinel: a failover to a replica that lacked the latest grants would let the hosts exceed the budget"},
				{Line: 8, Column: 111, Rule: "g", Msg: "shared.lease 1h0m0s is not between 2s and 10m0s (leave it out for 10s)"},
				{Line: 8, Column: 125, Rule: "g", Msg: "shared.replicas -1 is not between 0 and 16"},
				{Line: 9, Column: 70, Rule: "h", Msg: `shared.redis "redis+sentinel://s:26379" names no primary: add ?master_name=NAME`},
				{Line: 9, Column: 113, Rule: "h", Msg: "shared.lease must be a duration such as 30s or 1m"},
			},
		},
		{
			name: "adaptive options",
			in: `rules:
  - {name: a, destination: 10.0.0.1, adaptive: {minimum: 10, maximum: 5}}
  - {name: b, destination: 10.0.0.2, adaptive: {multiple: 1, decreaseFactor: 1.5}}
  - {name: c, destination: 10.0.0.3, adaptive: {maximum: 10}}
  - {name: d, destination: 10.0.0.4, adaptive: {maximum: ten, initial: 300}}
  - {name: e, destination: 10.0.0.5, adaptive: {samples: packets}}
  - {name: f, destination: 10.0.0.6, adaptive: 5}
  - {name: g, destination: 10.0.0.7, adaptive: {multiple: fast, decreaseFactor: !!float x, samples: 1}}
  - {name: h, destination: 10.0.0.8, adaptive: {samples: ""}}
`,
			want: []Problem{
				{Line: 2, Column: 48, Rule: "a", Msg: "adaptive: Maximum 5 must be at least Minimum 10"},
				{Line: 2, Column: 48, Rule: "a", Msg: "adaptive: Initial 20 (default) must lie between Minimum 10 and Maximum 5"},
				{Line: 3, Column: 48, Rule: "b", Msg: "adaptive: Multiple 1 must be a finite number above 1"},
				{Line: 3, Column: 48, Rule: "b", Msg: "adaptive: DecreaseFactor 1.5 must lie strictly between 0 and 1"},
				{Line: 4, Column: 48, Rule: "c", Msg: "adaptive: Initial 20 (default) must lie between Minimum 4 (default) and Maximum 10"},
				// A refused option is not judged again, nor its neighbours
				// against its default.
				{Line: 5, Column: 58, Rule: "d", Msg: "adaptive.maximum must be a whole number"},
				// As the CLI's --samples packets is.
				{Line: 6, Column: 58, Rule: "e", Msg: `adaptive.samples "packets" is not connect or request`},
				{Line: 7, Column: 48, Rule: "f", Msg: "adaptive must be a mapping of minimum, maximum, initial, multiple, decreaseFactor, probeEvery, probeFactor, maxHealthy, baseline, samples"},
				{Line: 8, Column: 59, Rule: "g", Msg: "adaptive.multiple must be a number"},
				{Line: 8, Column: 81, Rule: "g", Msg: "adaptive.decreaseFactor must be a number"},
				{Line: 8, Column: 101, Rule: "g", Msg: "adaptive.samples must be a string"},
				{Line: 9, Column: 58, Rule: "h", Msg: "adaptive.samples is empty; leave it out for request"},
			},
		},
		{
			name: "names",
			in: `rules:
  - {name: ` + strings.Repeat("n", 64) + `, destination: 10.0.0.1, concurrency: 1}
  - {name: "a b", destination: 10.0.0.2, concurrency: 1}
  - {name: "a#1", destination: 10.0.0.3, concurrency: 1}
  - {name: ` + strings.Repeat("h", 63) + `, destination: db.internal, concurrency: 1}
  - {name: 7, destination: 10.0.0.5, concurrency: 1}
  - {name: "tab\there", destination: 10.0.0.6, concurrency: 1}
  - {name: "", destination: 10.0.0.7, concurrency: 1}
  - {name: "k8s:shop/db", destination: 10.0.0.8, concurrency: 1}
  - {name: "k8s-shop", destination: 10.0.0.9, concurrency: 1}
`,
			want: []Problem{
				{Line: 2, Column: 12, Rule: strings.Repeat("n", 64), Msg: "name is longer than 63 bytes"},
				{Line: 3, Column: 12, Rule: "a b", Msg: "name has whitespace or unprintable characters"},
				// Lines 4 and 5 are fine: '#' is an ordinary character,
				// and a host name rule may use all 63 bytes.
				{Line: 6, Column: 12, Rule: "#5", Msg: "name must be a string"},
				{Line: 7, Column: 12, Rule: "tab\there", Msg: "name has whitespace or unprintable characters"},
				{Line: 8, Column: 12, Rule: "#7", Msg: "name is missing"},
				{Line: 9, Column: 12, Rule: "k8s:shop/db", Msg: "names beginning k8s: are the rules egressd makes for Kubernetes EgressLimits"},
			},
		},
		{
			name: "conflicts",
			in: `rules:
  - {name: a, destination: 10.0.0.0/8, port: 53, concurrency: 1}
  - {name: b, destination: "::ffff:10.0.0.0/104", port: 53, concurrency: 1}
  - {name: c, destination: db.internal, unit: x.service, concurrency: 1}
  - {name: d, destination: DB.Internal., unit: x.service, perSecond: {permits: 1}}
  - {name: e, destination: db.internal, cgroup: /system.slice/x.service, concurrency: 1}
  - {name: f, destination: 10.0.0.1, cgroup: /a/y.service, concurrency: 1}
  - {name: g, destination: 10.0.0.1, cgroup: /b/y.service, concurrency: 1}
  - {name: h, destination: 10.0.0.1, unit: y.service, concurrency: 1}
  - {name: i, destination: 10.0.0.1, cgroup: /1/2/3/4/5/6/z.service, concurrency: 1}
  - {name: j, destination: 10.0.0.1, unit: z.service, concurrency: 1}
`,
			want: []Problem{
				{Line: 3, Column: 28, Rule: "b", Msg: "same scope, destination and port as rule a; the kernel takes one rule for the same traffic"},
				{Line: 5, Column: 28, Rule: "d", Msg: "same scope, destination and port as rule c; the kernel takes one rule for the same traffic"},
				{Line: 6, Column: 28, Rule: "e", Msg: "same scope, destination and port as rule c; the kernel takes one rule for the same traffic"},
				{Line: 9, Column: 28, Rule: "h", Msg: "same scope, destination and port as rule f; the kernel takes one rule for the same traffic"},
			},
		},
		{
			name: "shapes of the document",
			in: `rules:
  - {name: a, destination: 10.0.0.1, concurrency: 1, port: 80, port: 81}
  - just a string
  - {name: c, destination: 10.0.0.3, perSecond: 10}
  - {name: d, destination: 10.0.0.4, concurrency: 1, shadow: yes}
  - {name: e, destination: 10.0.0.5, concurrency: 1, [x]: 1}
`,
			want: []Problem{
				{Line: 2, Column: 64, Rule: "a", Msg: "port is given twice; the first is at line 2"},
				{Line: 3, Column: 5, Rule: "#2", Msg: "a rule must be a mapping of name, destination, port, protocols, udpIdle, unit, cgroup, concurrency, perSecond, perWindow, adaptive, shadow, errno, shared"},
				{Line: 4, Column: 49, Rule: "c", Msg: "perSecond must be a mapping of permits, burst"},
				{Line: 5, Column: 62, Rule: "d", Msg: "shadow must be true or false"},
				{Line: 6, Column: 54, Rule: "e", Msg: "field names must be strings"},
			},
		},
		{
			name: "aliases",
			in: `rules:
  - &r {name: a, destination: 10.0.0.1, concurrency: 1}
  - *r
  - name: c
    destination: 10.0.0.3
    perSecond: &slow {permits: 1, burst: 2}
  - name: d
    destination: 10.0.0.4
    perSecond: *slow
    unit: *r
  - {&k name: e, *k : x}
`,
			want: []Problem{
				{Line: 3, Column: 5, Rule: "#2", Msg: "aliases (*r) are not supported; write the value out"},
				{Line: 9, Column: 16, Rule: "d", Msg: "aliases (*slow) are not supported; write the value out"},
				{Line: 10, Column: 11, Rule: "d", Msg: "aliases (*r) are not supported; write the value out"},
				// An alias as a key: the anchor is on the key "name".
				{Line: 11, Column: 5, Rule: "e", Msg: "destination is missing"},
				{Line: 11, Column: 5, Rule: "e", Msg: "no limit: give one of concurrency, perSecond, perWindow or adaptive"},
				{Line: 11, Column: 18, Rule: "e", Msg: "aliases (*k) are not supported; write the value out"},
			},
		},
		{
			name: "rules not a list",
			in:   "rules: {name: a}\n",
			want: []Problem{{Line: 1, Column: 8, Msg: "rules must be a list"}},
		},
		{
			name: "policy not a mapping",
			in:   "- name: a\n",
			want: []Problem{{Line: 1, Column: 1, Msg: "a policy must be a mapping of rules, maxRules, metrics"}},
		},
		{
			name: "second document",
			in:   "rules: []\n---\nrules: []\n",
			want: []Problem{{Line: 2, Column: 1, Msg: "a policy is one YAML document; this is a second"}},
		},
		{
			name: "syntax error in a second document",
			in:   "rules: []\n---\n{\n",
			want: []Problem{{Line: 3, Msg: "YAML: did not find expected node content"}},
		},
		{
			// The YAML parser gives a line and no column.
			name: "syntax error",
			in:   "\n\nrules: x: y\n",
			want: []Problem{{Line: 3, Msg: "YAML: mapping values are not allowed in this context"}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := Parse([]byte(tt.in))
			if p != nil {
				t.Errorf("Parse returned a policy with an error: %+v", p)
			}
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("Parse error %v is not ErrInvalid", err)
			}
			e, _ := errors.AsType[*Error](err)
			if !reflect.DeepEqual(e.Problems, tt.want) {
				t.Errorf("problems\n got %s\nwant %s", dump(e.Problems), dump(tt.want))
			}
		})
	}
}

func dump(ps []Problem) string {
	var b strings.Builder
	for _, p := range ps {
		b.WriteString("\n\t")
		b.WriteString((&Error{Problems: []Problem{p}}).Error())
	}
	return b.String()
}

// TestAllProblemsAtOnce is the promise operators rely on: one run of
// `egressd policy check` shows everything to fix.
func TestAllProblemsAtOnce(t *testing.T) {
	const in = `rules:
  - name: payments
    destination: 10.20.0.0/33
    port: 443
    concurrency: 0
  - name: payments
    destination: smtp.example.com
    perSecond: {permits: 10, burts: 20}
    errno: EWHATEVER
`
	_, err := Parse([]byte(in))
	e, ok := errors.AsType[*Error](err)
	if !ok {
		t.Fatalf("Parse error %v is not an *Error", err)
	}
	want := []Problem{
		{Line: 3, Column: 18, Rule: "payments", Msg: `destination "10.20.0.0/33" is not a valid CIDR: prefix length out of range`},
		{Line: 5, Column: 18, Rule: "payments", Msg: "concurrency must be at least 1"},
		{Line: 6, Column: 11, Rule: "payments", Msg: "name payments is already used by the rule at line 2"},
		{Line: 8, Column: 30, Rule: "payments", Msg: `unknown field "perSecond.burts" (did you mean burst?)`},
		{Line: 9, Column: 12, Rule: "payments", Msg: `errno "EWHATEVER" is not one a refusal may use: EACCES, EAGAIN, ECONNREFUSED, EHOSTUNREACH, ENETUNREACH, ENOBUFS, EPERM, ETIMEDOUT`},
	}
	if !reflect.DeepEqual(e.Problems, want) {
		t.Errorf("problems\n got %s\nwant %s", dump(e.Problems), dump(want))
	}
}

func TestLoad(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "good.yaml")
	bad := filepath.Join(dir, "policy.yaml")
	if err := os.WriteFile(good, []byte(example), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bad, []byte("rules:\n  - {name: a, destination: 10.0.0.1, concurrency: 0}\n  - nope\n"), 0o600); err != nil {
		t.Fatal(err)
	}

	p, err := Load(good)
	if err != nil || len(p.Rules) != 4 {
		t.Errorf("Load(good) = %+v, %v; want 4 rules", p, err)
	}

	_, err = Load(bad)
	want := bad + ":2:51: rule a: concurrency must be at least 1\n" +
		bad + ":3:5: rule #2: a rule must be a mapping of name, destination, port, protocols, udpIdle, unit, cgroup, concurrency, perSecond, perWindow, adaptive, shadow, errno, shared"
	if err == nil || err.Error() != want || !errors.Is(err, ErrInvalid) {
		t.Errorf("Load(bad) error\n%v\nwant\n%s", err, want)
	}

	_, err = Load(filepath.Join(dir, "missing.yaml"))
	if !errors.Is(err, fs.ErrNotExist) || errors.Is(err, ErrInvalid) {
		t.Errorf("Load(missing) error %v; want fs.ErrNotExist and not ErrInvalid", err)
	}
}

func TestErrorFormat(t *testing.T) {
	tests := []struct {
		name string
		err  *Error
		want string
	}{
		{
			name: "file, line and column",
			err:  &Error{File: "p.yaml", Problems: []Problem{{Line: 12, Column: 5, Rule: "payments", Msg: "concurrency must be at least 1"}}},
			want: "p.yaml:12:5: rule payments: concurrency must be at least 1",
		},
		{
			name: "no file",
			err:  &Error{Problems: []Problem{{Line: 12, Column: 5, Rule: "payments", Msg: "m"}}},
			want: "line 12:5: rule payments: m",
		},
		{
			name: "line only, outside a rule",
			err:  &Error{File: "p.yaml", Problems: []Problem{{Line: 3, Msg: "YAML: m"}}},
			want: "p.yaml:3: YAML: m",
		},
		{
			name: "no position",
			err:  &Error{File: "p.yaml", Problems: []Problem{{Rule: "#1", Msg: "a"}, {Msg: "b"}}},
			want: "p.yaml: rule #1: a\np.yaml: b",
		},
		{
			name: "built in code",
			err:  &Error{Problems: []Problem{{Rule: "a", Msg: "m"}}},
			want: "rule a: m",
		},
		{name: "no problems", err: &Error{}, want: "invalid policy"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tt.err.Error(); got != tt.want {
				t.Errorf("Error() = %q, want %q", got, tt.want)
			}
		})
	}
}
