package policy

import (
	"cmp"
	"encoding/base64"
	"net/netip"
	"slices"
	"strings"
	"syscall"

	"github.com/egressd/egressd/pkg/adaptive"
	"github.com/egressd/egressd/pkg/loader"
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

// maxHostName is the longest name a rule with a host name destination may
// have: its kernel rules add '#' and an address of up to 22 bytes.
const maxHostName = loader.MaxNameLen - 1 - 22

// LoaderRules returns the kernel rules that enforce r, a rule of a valid
// policy, for the cgroup the daemon resolved r.Scope to.
//
// A prefix destination gives one kernel rule named r.Name, and addrs is
// ignored. A host name gives one kernel rule per address in addrs (what it
// resolved to; duplicates and v4-mapped spellings count once), named
// NAME#ADDRESS — "email#192.0.2.25", "api#2001:db8::1" — or, for an IPv6
// address too long to fit in 63 bytes, NAME# and the address's 16 bytes in
// unpadded base64url. A kernel rule's name depends only on the rule and its
// address, so re-resolving keeps the rules of addresses that stayed, and
// their counts; [RuleName] maps a kernel name back.
//
// Each address gets the whole limit: the kernel counts per rule, so a
// concurrency of 50 on a name with three addresses admits up to 150
// connections in all.
//
// An adaptive rule is a concurrency rule that starts at its Initial limit
// and sends latency samples; the daemon moves the limit from there.
func (r Rule) LoaderRules(scope loader.Scope, addrs []netip.Addr) []loader.Rule {
	base := loader.Rule{
		Name:   r.Name,
		Scope:  scope,
		Port:   r.Port,
		Shadow: r.Shadow,
		Errno:  errnos[r.Errno],
	}
	r.Limit.kernel(&base)
	if p, ok := r.Destination.Prefix(); ok {
		base.Dest = p
		return []loader.Rule{base}
	}
	var unique []netip.Addr
	for _, a := range addrs {
		if a.IsValid() {
			unique = append(unique, a.Unmap().WithZone(""))
		}
	}
	slices.SortFunc(unique, netip.Addr.Compare)
	unique = slices.Compact(unique)
	rules := make([]loader.Rule, len(unique))
	for i, a := range unique {
		rules[i] = base
		rules[i].Name = addressName(r.Name, a)
		rules[i].Dest = netip.PrefixFrom(a, a.BitLen())
	}
	return rules
}

// addressName names the kernel rule of one address of a host name rule.
// The base64 form cannot be mistaken for an address: it has neither '.' nor
// ':'.
func addressName(name string, a netip.Addr) string {
	if n := name + "#" + a.String(); len(n) <= loader.MaxNameLen {
		return n
	}
	b := a.As16()
	return name + "#" + base64.RawURLEncoding.EncodeToString(b[:])
}

// RuleName returns the policy rule a kernel rule belongs to, for attributing
// refusals and samples: kernel names of host name rules carry an address
// after '#', which policy names never contain.
func RuleName(kernelName string) string {
	name, _, _ := strings.Cut(kernelName, "#")
	return name
}

func (c Concurrency) kernel(r *loader.Rule) {
	r.Shape = loader.ShapeConcurrency
	r.Limit = uint32(c)
}

func (p PerSecond) kernel(r *loader.Rule) {
	r.Shape = loader.ShapePerSecond
	r.Limit = uint32(p.Permits)
	r.Burst = uint32(p.Burst)
}

func (p PerWindow) kernel(r *loader.Rule) {
	r.Shape = loader.ShapePerWindow
	r.Limit = uint32(p.Permits)
	r.Window = p.Window
	r.Segments = uint32(p.Segments)
}

func (a Adaptive) kernel(r *loader.Rule) {
	r.Shape = loader.ShapeConcurrency
	r.Limit = uint32(cmp.Or(a.Initial, adaptive.DefaultInitial))
	r.Samples = true
	r.Requests = a.Samples == loader.SampleRequest
}
