package daemon

import (
	"fmt"
	"net/netip"
	"slices"

	"github.com/egressd/egressd/pkg/kernelrule"
	"github.com/egressd/egressd/pkg/loader"
	"github.com/egressd/egressd/pkg/policy"
)

// Rules the policy check lets through can still match the same traffic
// once resolved: a host name and an address it resolves to, two names
// sharing an address, a unit and its cgroup's path. The kernel takes one
// rule for a key (scope, destination, port) and refuses a table in which
// two share one: that table, and with it every later change, refresh and
// `limit set`, would fail for as long as the names resolve so. Instead each
// key goes to one rule, and the others go without it, as a name's
// addresses past the 256th go without the rule.

// key is what the kernel looks a connection up by: IPv4 in the v4-mapped
// form it stores.
type key struct {
	scope uint64
	dest  netip.Prefix
	port  uint16
}

func keyOf(r *loader.Rule, dest netip.Prefix) key {
	return key{r.Scope.CgroupID, kernelrule.Mapped(dest.Masked()), r.Port}
}

// resolved reports whether r's key is known only once resolved: its host
// name's addresses, its unit's or cgroup's id. Rules without either, a
// host-wide address or prefix, never share a key (the check refuses
// that), so a policy of those alone is not looked at.
func resolved(r *policy.Rule) bool {
	_, host := r.Destination.Host()
	return host || !r.Scope.HostWide()
}

// clash is a destination rule goes without: holder has its key.
type clash struct {
	rule, holder string
	dest         netip.Prefix
	port         uint16
	scoped       bool
}

func (c clash) String() string {
	port := "(any port)"
	if c.port != 0 {
		port = fmt.Sprintf("port %d", c.port)
	}
	where := ""
	if c.scoped {
		where = " in the same cgroup"
	}
	return fmt.Sprintf("destination %v %s%s is rule %s's", c.dest, port, where, c.holder)
}

// settleClashesLocked gives each key that installed entries of es share to
// one of them, and takes it from the others: a rule left with no
// destination is pending. The key goes to the rule the kernel enforces it
// for, so that a name moving onto a rule's address never takes it; else
// to the rule first in es. It returns what the rules still installed go
// without. Call with t.mu held.
func (t *table) settleClashesLocked(es []*entry) []clash {
	owner := map[key]int{}
	var contested []int
	claim := func(k key, i int) {
		j, ok := owner[k]
		if !ok {
			owner[k] = i
			return
		}
		contested = append(contested, i, j)
		if ii, ij := t.enforces(es[i], k), t.enforces(es[j], k); ii != ij && ii || ii == ij && i < j {
			owner[k] = i
		}
	}
	for i, e := range es {
		if e.installed() && resolved(e.spec) {
			for _, p := range e.kernel.Dests {
				claim(keyOf(&e.kernel, p), i)
			}
		}
	}
	if len(owner) == 0 {
		return nil
	}
	for i, e := range es {
		if e.installed() && !resolved(e.spec) {
			for _, p := range e.kernel.Dests {
				k := keyOf(&e.kernel, p)
				if _, ok := owner[k]; ok {
					claim(k, i)
				}
			}
		}
	}
	slices.Sort(contested)
	var partial []clash
	for _, i := range slices.Compact(contested) {
		e := es[i]
		var kept []netip.Prefix
		var lost []clash
		for _, p := range e.kernel.Dests {
			k := keyOf(&e.kernel, p)
			if o := owner[k]; o != i {
				lost = append(lost, clash{e.spec.Name, es[o].spec.Name, p, k.port, k.scope != 0})
				continue
			}
			kept = append(kept, p)
		}
		switch {
		case len(lost) == 0:
		case len(kept) == 0:
			e.pending = lost[0].String()
			if len(lost) > 1 {
				e.pending += fmt.Sprintf("; %d more of its destinations are other rules' too", len(lost)-1)
			}
		default:
			e.kernel.Dests = kept
			if e.base != nil {
				e.base.Dests = kept
			}
			partial = append(partial, lost...)
		}
	}
	return partial
}

// enforces reports whether the kernel enforces e's rule for k now.
func (t *table) enforces(e *entry, k key) bool {
	r, err := t.dp.Rule(e.spec.Name)
	return err == nil && slices.ContainsFunc(r.Dests, func(p netip.Prefix) bool { return keyOf(&r, p) == k })
}
