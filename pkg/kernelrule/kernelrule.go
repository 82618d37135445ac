// Package kernelrule is a rule as egressd's datapath enforces it: its
// shape, limit, destinations and scope, with the bounds the BPF programs
// hold it to and the check of them. It is portable and has no eBPF in it,
// so that what parses or checks a policy (pkg/policy, the CLI) shares the
// datapath's rules without linking the loader; pkg/loader writes these
// rules to the kernel and re-exports the types under its own names.
package kernelrule

import (
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"syscall"
	"time"
)

// Shape is how a rule limits connections. A rule has exactly one.
type Shape uint8

const (
	// ShapeConcurrency bounds live connections. Adaptive rules are
	// concurrency rules whose limit the daemon moves.
	ShapeConcurrency Shape = iota
	// ShapePerSecond is a token bucket of new connections per second.
	ShapePerSecond
	// ShapePerWindow is a sliding window of new connections.
	ShapePerWindow
	// ShapeGranted admits new connections while fewer than Granted have
	// been admitted: user space hands out the permits, as a host's share
	// of a budget that other hosts spend too.
	ShapeGranted
	// ShapeLen is how many shapes there are: the kernel's SHAPE_LEN.
	ShapeLen
)

// shapeNames is indexed by Shape.
var shapeNames = [...]string{"concurrency", "per_second", "per_window", "granted"}

func (s Shape) String() string {
	if int(s) < len(shapeNames) {
		return shapeNames[s]
	}
	return fmt.Sprintf("shape(%d)", uint8(s))
}

// Limits the kernel enforces; user space validates against them so a rule
// the kernel would mishandle is refused up front.
const (
	MaxNameLen  = 63
	MaxSegments = 32
	// MaxRate keeps the token arithmetic (elapsed ns × rate) inside 64 bits.
	MaxRate = 1_000_000
	// MaxRules is the most rules a datapath can be sized for.
	MaxRules = 1 << 20
	// MaxScopeLevel is the deepest cgroup a scope may name.
	MaxScopeLevel   = 15
	DefaultSegments = 8
	minSegment      = time.Millisecond
)

// Errnos a rule may refuse with instead of EPERM. Each is one a connect()
// caller already handles as "not now".
var allowedErrnos = map[syscall.Errno]bool{
	syscall.EPERM:        true,
	syscall.EACCES:       true,
	syscall.ECONNREFUSED: true,
	syscall.EAGAIN:       true,
	syscall.ENOBUFS:      true,
	syscall.ETIMEDOUT:    true,
	syscall.EHOSTUNREACH: true,
	syscall.ENETUNREACH:  true,
}

// Protocols are the transports a rule counts: TCP connections, UDP flows
// (a socket and one destination), or both, from one budget. The zero value
// is TCP alone, which every rule counted before UDP was.
type Protocols uint8

const (
	ProtoTCP Protocols = 1 << iota
	ProtoUDP
	// ProtoAll is every protocol a rule may count.
	ProtoAll = ProtoTCP | ProtoUDP
)

// protocolNames is indexed by a protocol's bit.
var protocolNames = [...]string{"tcp", "udp"}

// String lists the protocols as a policy writes them, "tcp,udp".
func (p Protocols) String() string {
	var names []string
	for i, name := range protocolNames {
		if p.Normal()&(1<<i) != 0 {
			names = append(names, name)
		}
	}
	if unknown := p &^ ProtoAll; unknown != 0 {
		names = append(names, fmt.Sprintf("protocols(%#x)", uint8(unknown)))
	}
	return strings.Join(names, ",")
}

// Normal is p with the zero value made TCP.
func (p Protocols) Normal() Protocols {
	if p == 0 {
		return ProtoTCP
	}
	return p
}

// Has reports whether p counts q.
func (p Protocols) Has(q Protocols) bool { return p.Normal()&q != 0 }

// ParseProtocol returns the protocol a name (tcp, udp) stands for.
func ParseProtocol(name string) (Protocols, bool) {
	for i, n := range protocolNames {
		if n == name {
			return 1 << i, true
		}
	}
	return 0, false
}

// DefaultFlowIdle is how long a UDP flow sent to an address may see no
// datagram, by default, before it ends: conntrack's timeout for a UDP
// flow that has seen datagrams both ways (nf_conntrack_udp_timeout_stream).
// A flow's idle time is kept in whole seconds, up to MaxFlowIdle.
const (
	DefaultFlowIdle = 120 * time.Second
	MaxFlowIdle     = 65535 * time.Second
)

// Scope limits a rule to the sockets of one cgroup and its descendants.
// The zero Scope is host-wide: every socket below the attach cgroup.
type Scope struct {
	CgroupID uint64
	// Level is the cgroup's depth below the cgroup2 root (1 for
	// /system.slice). The kernel walks a socket's ancestors by level.
	Level uint32
}

// HostWide reports whether the scope is the whole host.
func (s Scope) HostWide() bool { return s.CgroupID == 0 }

// Rule is one limit on connections from a scope to a destination.
type Rule struct {
	Name  string
	Scope Scope
	// Dests are the destination prefixes, one budget for all of them: a
	// host name's addresses share its limit. IPv4 prefixes also match the
	// same addresses written as v4-mapped IPv6.
	Dests []netip.Prefix
	// Port is the destination port; 0 means any port.
	Port  uint16
	Shape Shape
	// Limit is live connections (concurrency; 0 refuses every new one),
	// permits per second (per second), or permits per window (per window).
	Limit uint32
	// Burst is the per-second bucket size; 0 means one second of permits.
	Burst uint32
	// Window and Segments describe a per-window rule; Segments 0 means 8.
	Window   time.Duration
	Segments uint32
	// Granted is the permits a granted rule has been given since it was
	// created; compare Stats.Spent. Raise it to grant more; lowering it
	// takes back only what is not yet spent (see Datapath.Reclaim).
	Granted uint64
	// Until, when set, is when Limit stops holding (concurrency only):
	// from then connect() is admitted against LimitAfter. A share of a
	// budget kept elsewhere sets it to when its lease there could run
	// out, and moves it on as it renews, so that a kernel whose user
	// space stopped does not go on spending what was given away since.
	Until      time.Time
	LimitAfter uint32
	// Shadow counts what would be refused and refuses nothing.
	Shadow bool
	// Errno is what a refused connect() returns; 0 means EPERM.
	Errno syscall.Errno
	// Samples sends each latency sample to user space (adaptive rules).
	Samples bool
	// Requests tracks in-flight requests on the rule's connections.
	Requests bool
	// Protocols are what the rule counts; the zero value is TCP alone.
	Protocols Protocols
	// FlowIdle ends a UDP flow sent to an address (not one of connect())
	// that saw no datagram for it; 0 means DefaultFlowIdle. The recount
	// ends such flows, so one ends within a recount period after.
	FlowIdle time.Duration
}

// SameLimit reports whether r and o limit alike: the same shape and the
// same figures for it. What they apply to (scope, destinations, port) and
// how (shadow, errno, tracking) is not compared.
func (r Rule) SameLimit(o Rule) bool {
	return r.Shape == o.Shape && r.Limit == o.Limit && r.Granted == o.Granted &&
		r.Burst == o.Burst && r.Window == o.Window && r.Segments == o.Segments &&
		r.Until.Equal(o.Until) && r.LimitAfter == o.LimitAfter
}

// MaxDests bounds the destinations of one rule.
const MaxDests = 256

// Mapped writes an IPv4 prefix as the v4-mapped IPv6 prefix the kernel
// stores, so 10.0.0.0/8 and ::ffff:10.0.0.0/104 are the same rule.
func Mapped(p netip.Prefix) netip.Prefix {
	if p.Addr().Is4() {
		return netip.PrefixFrom(netip.AddrFrom16(p.Addr().As16()), p.Bits()+96)
	}
	return p
}

// WithDefaults returns the rule as the kernel enforces it: prefixes
// masked, a bucket's burst, a window's segments and the errno filled in,
// the window in whole segments.
func (r Rule) WithDefaults() Rule {
	dests := make([]netip.Prefix, len(r.Dests))
	for i, d := range r.Dests {
		dests[i] = d.Masked()
	}
	r.Dests = dests
	switch r.Shape {
	case ShapePerSecond:
		if r.Burst == 0 {
			r.Burst = r.Limit
		}
	case ShapePerWindow:
		if r.Segments == 0 {
			r.Segments = DefaultSegments
		}
		// The kernel keeps whole nanoseconds per segment: a window they
		// do not divide (a minute in 7) is a little shorter there, and
		// read back as such after a restart.
		if seg := r.Window / time.Duration(r.Segments); seg > 0 {
			r.Window = seg * time.Duration(r.Segments)
		}
	}
	if r.Errno == 0 {
		r.Errno = syscall.EPERM
	}
	r.Protocols = r.Protocols.Normal()
	if r.FlowIdle == 0 {
		r.FlowIdle = DefaultFlowIdle
	}
	r.FlowIdle = r.FlowIdle.Truncate(time.Second)
	return r
}

// Validate reports every problem with the rule at once.
func (r Rule) Validate() error {
	var problems []string
	add := func(format string, args ...any) { problems = append(problems, fmt.Sprintf(format, args...)) }
	switch {
	case r.Name == "":
		add("name is empty")
	case len(r.Name) > MaxNameLen:
		add("name is longer than %d bytes", MaxNameLen)
	case strings.ContainsFunc(r.Name, func(c rune) bool { return c < 0x21 || c == 0x7f }):
		add("name has spaces or control characters")
	}
	switch {
	case len(r.Dests) == 0:
		add("no destination")
	case len(r.Dests) > MaxDests:
		add("%d destinations, more than %d", len(r.Dests), MaxDests)
	}
	seen := map[netip.Prefix]bool{}
	for _, d := range r.Dests {
		if !d.IsValid() {
			add("destination %v is not a valid prefix", d)
			continue
		}
		if m := Mapped(d.Masked()); seen[m] {
			add("destination %v given twice", d)
		} else {
			seen[m] = true
		}
	}
	if r.Scope.CgroupID != 0 && (r.Scope.Level == 0 || r.Scope.Level > MaxScopeLevel) {
		add("scope level %d is outside 1..%d", r.Scope.Level, MaxScopeLevel)
	}
	if r.Limit == 0 && (r.Shape == ShapePerSecond || r.Shape == ShapePerWindow) {
		add("limit must be at least 1")
	}
	if r.Granted != 0 && r.Shape != ShapeGranted {
		add("only granted rules take granted permits")
	}
	if (!r.Until.IsZero() || r.LimitAfter != 0) && r.Shape != ShapeConcurrency {
		add("only concurrency rules take a limit until a time")
	}
	switch r.Shape {
	case ShapeConcurrency:
		if r.Burst != 0 || r.Window != 0 || r.Segments != 0 {
			add("concurrency rules take no burst, window or segments")
		}
	case ShapeGranted:
		if r.Limit != 0 || r.Burst != 0 || r.Window != 0 || r.Segments != 0 {
			add("granted rules take no limit, burst, window or segments")
		}
	case ShapePerSecond:
		if r.Limit > MaxRate {
			add("rate %d is above %d per second", r.Limit, MaxRate)
		}
		if r.Burst > MaxRate {
			add("burst %d is above %d", r.Burst, MaxRate)
		}
		if r.Window != 0 || r.Segments != 0 {
			add("per-second rules take no window or segments")
		}
	case ShapePerWindow:
		if r.Burst != 0 {
			add("per-window rules take no burst")
		}
		segs := r.Segments
		if segs == 0 {
			segs = DefaultSegments
		}
		if segs > MaxSegments {
			add("segments %d is above %d", segs, MaxSegments)
		}
		switch {
		case r.Window <= 0:
			add("window must be positive")
		case r.Window/time.Duration(segs) < minSegment:
			add("window %v in %d segments makes segments shorter than %v", r.Window, segs, minSegment)
		}
	default:
		add("unknown shape %d", r.Shape)
	}
	if r.Errno != 0 && !allowedErrnos[r.Errno] {
		add("errno %q is not one a refusal may use", r.Errno.Error())
	}
	if r.Protocols&^ProtoAll != 0 {
		add("unknown protocols %#x", uint8(r.Protocols&^ProtoAll))
	}
	if r.Protocols.Has(ProtoUDP) && (r.Samples || r.Requests) {
		add("latency samples and requests are measured on TCP connections: a rule that counts UDP takes neither")
	}
	if r.FlowIdle != 0 && (r.FlowIdle < time.Second || r.FlowIdle > MaxFlowIdle) {
		add("flow idle time %v is outside %v..%v", r.FlowIdle, time.Second, MaxFlowIdle)
	}
	if len(problems) == 0 {
		return nil
	}
	return &RuleError{Rule: r.Name, Problems: problems}
}

// ErrInvalidRule matches a *RuleError.
var ErrInvalidRule = errors.New("invalid rule")

// RuleError lists every problem found in one rule.
type RuleError struct {
	Rule     string
	Problems []string
}

func (e *RuleError) Error() string {
	name := e.Rule
	if name == "" {
		name = "(unnamed)"
	}
	return fmt.Sprintf("rule %s: %s", name, strings.Join(e.Problems, "; "))
}

// Is matches ErrInvalidRule.
func (e *RuleError) Is(target error) bool { return target == ErrInvalidRule }

// SampleKind says what a latency sample measured.
type SampleKind uint8

const (
	// SampleConnect is the handshake: connect()'s first SYN to ESTABLISHED.
	SampleConnect SampleKind = iota
	// SampleRequest is a request's first outbound payload to the next
	// inbound payload.
	SampleRequest
	// SampleKindLen is how many kinds there are: the kernel's SAMPLE_LEN.
	SampleKindLen
)

// sampleKindNames is indexed by SampleKind.
var sampleKindNames = [...]string{"connect", "request"}

func (k SampleKind) String() string {
	if int(k) < len(sampleKindNames) {
		return sampleKindNames[k]
	}
	return fmt.Sprintf("sample_kind(%d)", uint8(k))
}
