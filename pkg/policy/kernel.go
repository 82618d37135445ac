package policy

import (
	"cmp"
	"net/netip"
	"slices"
	"syscall"

	"github.com/egressd/egressd/pkg/adaptive"
	"github.com/egressd/egressd/pkg/kernelrule"
)

// errnos are the refusal errnos a rule may name; the kernel allows exactly
// these (a test holds the two lists together).
var errnos = map[string]syscall.Errno{
	"EACCES":       syscall.EACCES,
	"EAGAIN":       syscall.EAGAIN,
	"ECONNREFUSED": syscall.ECONNREFUSED,
	"EHOSTUNREACH": syscall.EHOSTUNREACH,
	"ENETUNREACH":  syscall.ENETUNREACH,
	"ENOBUFS":      syscall.ENOBUFS,
	"EPERM":        syscall.EPERM,
	"ETIMEDOUT":    syscall.ETIMEDOUT,
}

// LoaderRule returns the kernel rule that enforces r, a rule of a valid
// policy, for the cgroup the daemon resolved r.Scope to. The kernel rule is
// named r.Name, whatever the destination.
//
// A prefix destination gives Dests of that one prefix, and addrs is ignored.
// A host name gives one /32 or /128 in Dests per address in addrs (what the
// name resolved to). Addresses are unmapped and lose their zones, so
// duplicates and v4-mapped spellings (::ffff:192.0.2.25 and 192.0.2.25)
// count once, and are sorted (IPv4 before IPv6), so the same answer in any
// order gives the same rule. At most [kernelrule.MaxDests] addresses are kept,
// the first in that order; a name resolving to more is limited only on
// those, and connections to the rest are not limited by this rule.
//
// All of a rule's destinations share its one budget: a concurrency of 50 on
// a name with three addresses admits 50 connections in all, however they
// spread over the addresses.
//
// With no valid address in addrs — a name that has not resolved — the rule
// has no Dests and kernelrule.Rule.Validate refuses it: the daemon must not
// install it until the name resolves. Otherwise the rule passes
// kernelrule.Rule.Validate.
//
// An adaptive rule is a concurrency rule that starts at its Initial limit
// and sends latency samples; the daemon moves the limit from there.
func (r Rule) LoaderRule(scope kernelrule.Scope, addrs []netip.Addr) kernelrule.Rule {
	// The shape's fields come back by value: a pointer handed to the
	// interface's method would put every rule's kernel rule on the heap.
	kr := r.Limit.kernel()
	kr.Name, kr.Scope, kr.Port, kr.Shadow, kr.Errno = r.Name, scope, r.Port, r.Shadow, errnos[r.Errno]
	kr.Protocols, kr.FlowIdle = r.Protocols, r.UDPIdle
	if p, ok := r.Destination.Prefix(); ok {
		kr.Dests = []netip.Prefix{p}
		return kr
	}
	var unique []netip.Addr
	for _, a := range addrs {
		if a.IsValid() {
			unique = append(unique, a.Unmap().WithZone(""))
		}
	}
	slices.SortFunc(unique, netip.Addr.Compare)
	unique = slices.Compact(unique)
	unique = unique[:min(len(unique), kernelrule.MaxDests)]
	for _, a := range unique {
		kr.Dests = append(kr.Dests, netip.PrefixFrom(a, a.BitLen()))
	}
	return kr
}

func (c Concurrency) kernel() kernelrule.Rule {
	return kernelrule.Rule{Shape: kernelrule.ShapeConcurrency, Limit: uint32(c)}
}

func (p PerSecond) kernel() kernelrule.Rule {
	return kernelrule.Rule{Shape: kernelrule.ShapePerSecond, Limit: uint32(p.Permits), Burst: uint32(p.Burst)}
}

func (p PerWindow) kernel() kernelrule.Rule {
	return kernelrule.Rule{Shape: kernelrule.ShapePerWindow, Limit: uint32(p.Permits), Window: p.Window, Segments: uint32(p.Segments)}
}

func (a Adaptive) kernel() kernelrule.Rule {
	return kernelrule.Rule{
		Shape:    kernelrule.ShapeConcurrency,
		Limit:    uint32(cmp.Or(a.Initial, adaptive.DefaultInitial)),
		Samples:  true,
		Requests: a.Samples.kind() == kernelrule.SampleRequest,
	}
}
