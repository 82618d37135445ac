package loader

import (
	"errors"
	"net/netip"
	"time"

	"github.com/egressd/egressd/pkg/kernelrule"
)

// The rule's types and bounds are package kernelrule's, which has no eBPF
// in it so that policy checks can share them; they are the loader's too.
type (
	Shape      = kernelrule.Shape
	Scope      = kernelrule.Scope
	Rule       = kernelrule.Rule
	RuleError  = kernelrule.RuleError
	SampleKind = kernelrule.SampleKind
	Protocols  = kernelrule.Protocols
)

const (
	ShapeConcurrency = kernelrule.ShapeConcurrency
	ShapePerSecond   = kernelrule.ShapePerSecond
	ShapePerWindow   = kernelrule.ShapePerWindow
	ShapeGranted     = kernelrule.ShapeGranted

	SampleConnect = kernelrule.SampleConnect
	SampleRequest = kernelrule.SampleRequest

	ProtoTCP = kernelrule.ProtoTCP
	ProtoUDP = kernelrule.ProtoUDP

	MaxNameLen      = kernelrule.MaxNameLen
	MaxSegments     = kernelrule.MaxSegments
	MaxRate         = kernelrule.MaxRate
	MaxRules        = kernelrule.MaxRules
	MaxScopeLevel   = kernelrule.MaxScopeLevel
	MaxDests        = kernelrule.MaxDests
	DefaultSegments = kernelrule.DefaultSegments
)

// ruleKey is one (scope, destination, port, protocol) a rule matches; two
// rules may not share one. proto is the kernel's: egressdProtoPROTO_TCP or
// PROTO_UDP.
type ruleKey struct {
	scope uint64
	dest  netip.Prefix
	port  uint16
	proto uint8
}

// ruleKeys are a rule's keys: one per destination for each protocol it
// counts, its first protocol's first.
func ruleKeys(r *Rule) []ruleKey {
	var protos []uint8
	for _, p := range kernelProtos {
		if r.Protocols.Has(p.bit) {
			protos = append(protos, p.kernel)
		}
	}
	keys := make([]ruleKey, 0, len(r.Dests)*len(protos))
	for _, p := range protos {
		for _, d := range r.Dests {
			keys = append(keys, ruleKey{scope: r.Scope.CgroupID, dest: kernelrule.Mapped(d), port: r.Port, proto: p})
		}
	}
	return keys
}

// kernelProtos are a rule's protocols, indexed by the kernel's numbers of
// them (enum proto).
var kernelProtos = [...]struct {
	bit    Protocols
	kernel uint8
}{
	{ProtoTCP, 0},
	{ProtoUDP, udpProto},
}

// udpProto is the kernel's number of UDP (PROTO_UDP).
const udpProto = 1

// Errors. Each sentinel is matched by errors.Is; typed errors carry detail.
var (
	// ErrNotSupported means the kernel lacks a feature the datapath needs.
	ErrNotSupported = errors.New("not supported by this kernel")
	// ErrInvalidRule matches a *RuleError.
	ErrInvalidRule = kernelrule.ErrInvalidRule
	// ErrUnknownRule means no rule has the given name.
	ErrUnknownRule = errors.New("unknown rule")
	// ErrConflict means another rule already matches the same traffic.
	ErrConflict = errors.New("rule conflict")
	// ErrFull means every rule slot is taken.
	ErrFull = errors.New("rule table full")
	// ErrBusy means another process has the pinned datapath open.
	ErrBusy = errors.New("datapath busy")
	// ErrNotPinned means no datapath is pinned where one was looked for.
	ErrNotPinned = errors.New("nothing pinned")
)

// Histogram is a latency distribution in power-of-two microsecond buckets.
type Histogram struct {
	Count uint64
	Sum   time.Duration
	// Buckets[i] counts samples in [UpperBound(i-1), UpperBound(i)); the
	// last bucket is unbounded.
	Buckets [HistogramBuckets]uint64
}

// HistogramBuckets is the number of buckets in a Histogram.
const HistogramBuckets = 28

// UpperBound returns the exclusive upper bound of bucket i: 2^i µs, and
// the largest Duration for the last bucket.
func UpperBound(i int) time.Duration {
	if i >= HistogramBuckets-1 {
		return time.Duration(1<<63 - 1)
	}
	return time.Duration(1<<i) * time.Microsecond
}

// Stats are a rule's counters since it was created.
type Stats struct {
	// Live is connections holding a slot now.
	Live int64
	// Spent is the permits a granted rule has admitted since it was
	// created (see Rule.Granted).
	Spent         uint64
	Admitted      uint64
	Refused       uint64
	ShadowRefused uint64
	Released      uint64
	Established   uint64
	// ConnectFailed counts slots released before reaching ESTABLISHED.
	ConnectFailed uint64
	// Untracked counts connections admitted without socket state because
	// the kernel could not allocate it; they hold no slot.
	Untracked uint64
	Requests  uint64
	Responses uint64
	// Aborted counts requests cut short by the connection's end.
	Aborted        uint64
	InFlight       int64
	ConnectLatency Histogram
	RequestLatency Histogram
}

// RuleStatus is a rule with its current counters.
type RuleStatus struct {
	Rule
	Stats Stats
}

// Lost counts events that never reached user space.
type Lost struct {
	// Refusals is refusal log records the kernel overwrote before they
	// were read (since this process opened the datapath): their refusals
	// are in the rule's counts but in no event.
	Refusals uint64
	// Samples is latency samples dropped because the ring buffer was full.
	Samples uint64
}

// Refusal is one connect() the datapath refused (or, in shadow mode, would
// have refused).
type Refusal struct {
	Time   time.Time
	PID    uint32
	Cgroup uint64
	// Rule is empty when the rule was deleted before the event was read.
	Rule   string
	Dest   netip.AddrPort
	Shape  Shape
	Shadow bool
	// Protocol is what was refused: a TCP connect(), or a UDP flow's
	// connect() or first send (ProtoUDP).
	Protocol Protocols
	// RetryAfter is when a permit is expected back; 0 when the shape has
	// no such hint (concurrency).
	RetryAfter time.Duration
	// Count is how many refusals of this process by this rule the event
	// stands for: those since the pair's previous event, sent at most once
	// per Config.EventInterval. Dest and the rest are the latest's.
	Count uint64
}

// Sample is one latency measurement of a rule with Samples set.
type Sample struct {
	// Time is when the measured interval ended.
	Time    time.Time
	Rule    string
	Kind    SampleKind
	Latency time.Duration
}

// Recount compares the kernel's live and in-flight counts of a rule with a
// count of the sockets themselves, and says what it gave back.
type Recount struct {
	// Live is the kernel's count when the walk began; Counted the live
	// sockets the walk found holding a slot.
	Live    int64
	Counted int64
	// Admitted and Released are the slots the kernel took and gave back
	// while the sockets were walked (Freed among them).
	Admitted, Released int64
	InFlight           int64
	CountedInFlight    int64
	// Freed is how many slots of sockets freed without giving them back
	// the walks found, and gave back.
	Freed int64
	// Expired is how many UDP flows sent to an address the walks ended,
	// idle for longer than their rule's FlowIdle.
	Expired int64
	// GivenBack is how many slots counted that no socket held, at this
	// recount and the one before, this recount gave back.
	GivenBack int64
	// Remarked is how many sockets holding a slot had their marks put
	// back after another program took them off.
	Remarked int64
}

// Drift is how far the sockets counted fall outside what the kernel's
// count allows: the walk sees each socket once, at some moment of it, so
// it finds at least Live-Released and at most Live+Admitted sockets. Any
// count within is no drift: connections that opened or closed during the
// walk. Positive: the kernel counts more slots than sockets hold them (a
// slot not given back); negative: fewer.
func (r Recount) Drift() int64 {
	switch lo, hi := r.Live-r.Released, r.Live+r.Admitted; {
	case r.Counted < lo:
		return lo - r.Counted
	case r.Counted > hi:
		return hi - r.Counted
	}
	return 0
}

// ProgramStats is the kernel's run count and run time of one program,
// recorded while kernel.bpf_stats_enabled is on.
type ProgramStats struct {
	Runs    uint64
	Runtime time.Duration
}
