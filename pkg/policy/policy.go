package policy

import (
	"fmt"
	"net"
	"net/netip"
	"strings"
	"time"

	"github.com/egressd/egressd/pkg/adaptive"
	"github.com/egressd/egressd/pkg/kernelrule"
)

// Policy is a set of rules, in the order the file gives them. The zero
// Policy is valid and limits nothing.
type Policy struct {
	Rules []Rule
	// MaxRules is how many rules the kernel's tables hold, up to
	// kernelrule.MaxRules; 0 lets the daemon size them from the policy. Rules
	// set at run time take slots too.
	MaxRules int
	// MetricsRules are the names of the rules whose series of their own
	// the metrics keep first, when the daemon has more rules than it
	// serves such series for: names, or patterns as path.Match reads
	// them (a * matches any run of characters but /).
	MetricsRules []string
}

// KubePrefix begins the name of every rule the daemon makes for a
// Kubernetes EgressLimit, and no other: a policy file or the CLI cannot
// take or change such a rule.
const KubePrefix = "k8s:"

// Rule is one limit on the connections a scope opens to a destination.
// Rules are comparable with ==, which is how a reload tells a changed rule
// from an unchanged one whose counts it must keep.
type Rule struct {
	// Name identifies the rule in the CLI, metrics and refusal events,
	// and names its kernel rule ([Rule.LoaderRule]): at most 63 bytes of
	// UTF-8, no whitespace or unprintable characters.
	Name        string
	Destination Destination
	// Port is the destination port; 0 means any port.
	Port  uint16
	Scope Scope
	// Limit is the rule's one shape: [Concurrency], [PerSecond],
	// [PerWindow] or [Adaptive].
	Limit Limit
	// Shadow counts what would be refused and refuses nothing, so that a
	// limit can be tried against real traffic before it bites.
	Shadow bool
	// Errno is what a refused connect() returns, by name ("ECONNREFUSED");
	// empty means EPERM.
	Errno string
	// Shared makes the limit one budget for every host that names the
	// same Redis key; the zero Shared keeps it this host's own.
	Shared Shared
	// Protocols are what the rule counts, from one budget: TCP
	// connections, UDP flows (a socket and one destination), or both.
	// The zero value is TCP alone (see docs/policy.md for why).
	Protocols kernelrule.Protocols
	// UDPIdle ends a UDP flow sent to an address that saw no datagram for
	// that long; 0 means kernelrule.DefaultFlowIdle.
	UDPIdle time.Duration
}

// Shared is a budget kept in Redis and spent by several hosts, each of
// which enforces its share in its own kernel. Every host sharing Key must
// give the rule the same limit. Concurrency, PerSecond and PerWindow rules
// can be shared.
type Shared struct {
	// Redis is the server's URL: redis://[user:password@]host:port[/db],
	// rediss:// for TLS, unix:///path/to/socket, a primary watched by
	// Sentinel (redis+sentinel://host:port?master_name=NAME&addr=…) or a
	// Cluster (redis+cluster://host:port?addr=…); see package redisurl.
	Redis string
	// Key is the budget's key in Redis.
	Key string
	// FailureMode is what the host enforces while Redis cannot be
	// reached: FailureThrow (the default) keeps the share it last held,
	// FailureAllow enforces the whole limit as if the host were alone,
	// FailureDeny admits no new connections.
	FailureMode string
	// Durability says whether Redis may lose the budget's state:
	// DurabilityEphemeral (the default) or DurabilityPersistent. An
	// ephemeral budget Redis has no record of (its first use, or a state
	// Redis lost) admits, for one Lease, only what the hosts' kernels
	// already hold; a persistent one grows at once on first use.
	Durability string
	// Lease is how long a host's slots of a shared concurrency budget
	// outlive its daemon's last renewal; 0 means DefaultLease. A daemon
	// restarted, paused or cut off from Redis for less keeps its slots.
	Lease time.Duration
	// Replicas is how many Redis replicas must confirm a grant (Redis's
	// WAIT) before the kernel uses it, so that a failover cannot lose
	// it: at least 1 with Sentinel, 0 (none) by default otherwise.
	Replicas int
}

// Durability values.
const (
	DurabilityEphemeral  = "ephemeral"
	DurabilityPersistent = "persistent"
)

// Lease bounds: the shortest must outlast a few renewals, which come
// every 50 ms and fail after 500 ms.
const (
	DefaultLease = 10 * time.Second
	MinLease     = 2 * time.Second
	MaxLease     = 10 * time.Minute
	MaxReplicas  = 16
)

// FailureMode values: the names the distributed rate-limiting reference
// uses, read for a host enforcing its share in the kernel.
const (
	FailureThrow = "throw"
	FailureAllow = "allow"
	FailureDeny  = "deny"
)

// IsShared reports whether the rule's limit is a shared budget.
func (r Rule) IsShared() bool { return r.Shared != Shared{} }

// Scope says whose connections a rule limits. The zero Scope is the whole
// host. A systemd unit is the usual way to name a service; a cgroup path
// reaches what systemd does not manage (containers, hand-made cgroups).
type Scope struct {
	// Unit is a systemd unit that owns a cgroup: a .service, .socket,
	// .scope, .slice, .mount or .swap.
	Unit string
	// Cgroup is a path inside the cgroup2 hierarchy, such as
	// "/system.slice/payments.service".
	Cgroup string
}

// HostWide reports whether the scope is the whole host.
func (s Scope) HostWide() bool { return s == Scope{} }

// Limit is a rule's shape. Exactly one per rule; the set is closed because
// the kernel enforces exactly these.
type Limit interface {
	// kernel returns a kernel rule with the shape's fields set.
	kernel() kernelrule.Rule
}

// Concurrency bounds the connections open at once.
type Concurrency int

// PerSecond is a token bucket of new connections: Permits per second, up to
// Burst at once. Burst 0 means one second's worth (Permits).
type PerSecond struct {
	Permits int
	Burst   int
}

// PerWindow bounds new connections in any sliding Window, tracked in
// Segments parts (0 means 8): more segments slide more smoothly and cost
// more kernel memory.
type PerWindow struct {
	Permits  int
	Window   time.Duration
	Segments int
}

// Adaptive is a concurrency limit the daemon moves by watching latency (see
// package adaptive). Zero fields take adaptive's defaults.
type Adaptive struct {
	Minimum        int
	Maximum        int
	Initial        int
	Multiple       float64
	DecreaseFactor float64
	// ProbeEvery is the period of drain probes in rounds (0: adaptive's
	// default, 100), or adaptive.NoProbes for none, which a policy file
	// writes as probeEvery: 0: the reference loop, whose baseline learns
	// a standing queue under sustained overload.
	ProbeEvery  int
	ProbeFactor float64
	// MaxHealthy, if set, decreases the limit after any round whose
	// fastest connection took longer; Baseline, if set, is a fixed
	// baseline instead of a measured one.
	MaxHealthy time.Duration
	Baseline   time.Duration
	// Samples is the latency the daemon judges by.
	Samples Samples
}

// Samples is the latency an adaptive rule is judged by. The zero Samples is
// the default, SamplesRequest.
type Samples string

const (
	// SamplesConnect is the handshake: the first SYN connect() sends to
	// ESTABLISHED. It is
	// all a protocol that is not request and response offers, but the
	// dependency's kernel completes the handshake whether or not the
	// application behind it queues.
	SamplesConnect Samples = "connect"
	// SamplesRequest is request latency: a request's first outbound
	// payload to the next inbound payload. It sees the dependency queue,
	// at the cost of programs that run for every packet while any rule
	// uses it.
	SamplesRequest Samples = "request"
)

// kind is the kernel's sample kind for s.
func (s Samples) kind() kernelrule.SampleKind {
	if s == SamplesConnect {
		return kernelrule.SampleConnect
	}
	return kernelrule.SampleRequest
}

// Options returns the controller options for a, with zero fields left for
// package adaptive to default.
func (a Adaptive) Options() adaptive.Options {
	return adaptive.Options{
		Minimum:        a.Minimum,
		Maximum:        a.Maximum,
		Initial:        a.Initial,
		Multiple:       a.Multiple,
		DecreaseFactor: a.DecreaseFactor,
		ProbeEvery:     a.ProbeEvery,
		ProbeFactor:    a.ProbeFactor,
		MaxHealthy:     a.MaxHealthy,
		Baseline:       a.Baseline,
	}
}

// Destination is where a rule's connections go: a prefix (a single address
// is a /32 or /128) or a host name the daemon resolves and re-resolves, whose
// addresses share the rule's one limit. The zero Destination is no
// destination.
type Destination struct {
	prefix netip.Prefix
	host   string
}

// ParseDestination reads an IP address, a CIDR prefix or a host name. A
// prefix with bits set past its length (10.20.1.0/16) is refused rather than
// masked: it is more often a typo for a narrower prefix than a way of
// writing a wider one.
func ParseDestination(s string) (Destination, error) {
	if strings.Contains(s, "/") {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return Destination{}, fmt.Errorf("destination %q is not a valid CIDR: %s", s, netipDetail(err))
		}
		if m := p.Masked(); m != p {
			return Destination{}, fmt.Errorf("destination %s has bits set past /%d; write %s", s, p.Bits(), m)
		}
		return Destination{prefix: p}, nil
	}
	if host, port, err := net.SplitHostPort(s); err == nil && allDigits(port) {
		return Destination{}, fmt.Errorf("destination %q has a port; write destination: %s and port: %s", s, host, port)
	}
	if strings.Contains(s, ":") || numericLastLabel(s) {
		a, err := netip.ParseAddr(s)
		if err != nil {
			return Destination{}, fmt.Errorf("destination %q is not a valid IP address: %s", s, netipDetail(err))
		}
		if a.Zone() != "" {
			return Destination{}, fmt.Errorf("destination %s has a zone; rules match addresses without one", s)
		}
		return Destination{prefix: netip.PrefixFrom(a, a.BitLen())}, nil
	}
	if !validHost(s) {
		return Destination{}, fmt.Errorf("destination %q is not an IP address, CIDR or host name", s)
	}
	return Destination{host: s}, nil
}

// Prefix returns the destination prefix, if the destination is one.
func (d Destination) Prefix() (netip.Prefix, bool) { return d.prefix, d.prefix.IsValid() }

// Host returns the host name, if the destination is one.
func (d Destination) Host() (string, bool) { return d.host, d.host != "" }

// String returns the destination as [ParseDestination] reads it; a single
// address is written without its prefix length.
func (d Destination) String() string {
	switch {
	case d.host != "":
		return d.host
	case d.prefix.IsSingleIP():
		return d.prefix.Addr().String()
	case d.prefix.IsValid():
		return d.prefix.String()
	}
	return ""
}

// netipDetail drops the `netip.ParseAddr("…"): ` that net/netip puts before
// its reason, since the caller has already quoted the input.
func netipDetail(err error) string {
	msg := err.Error()
	if _, reason, ok := strings.Cut(msg, "): "); ok {
		return reason
	}
	return msg
}

// numericLastLabel reports whether s ends in an all-digit label. No top-level
// domain is all digits, so such a string is a mistyped IPv4 address and
// deserves that error rather than "bad host name".
func numericLastLabel(s string) bool {
	s = strings.TrimSuffix(s, ".")
	return allDigits(s[strings.LastIndexByte(s, '.')+1:])
}

func allDigits(s string) bool { return s != "" && strings.Trim(s, "0123456789") == "" }

// validHost reports whether s is a DNS name a resolver will take: labels of
// 1 to 63 letters, digits, hyphens (not at either end) and underscores (which
// container runtimes put in service names), 253 bytes in all, an optional
// final dot.
func validHost(s string) bool {
	s = strings.TrimSuffix(s, ".")
	if s == "" || len(s) > 253 {
		return false
	}
	for label := range strings.SplitSeq(s, ".") {
		if label == "" || len(label) > 63 || label[0] == '-' || label[len(label)-1] == '-' {
			return false
		}
		for _, c := range []byte(label) {
			if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '-' || c == '_') {
				return false
			}
		}
	}
	return true
}
