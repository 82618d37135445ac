package daemon

import (
	"github.com/egressd/egressd/pkg/adaptive"
	"github.com/egressd/egressd/pkg/policy"
)

// An adaptive rule's loop (package adaptive) runs on the latency samples
// and refusals the kernel reports (events.go); each change of its limit is
// written to the kernel here.

// newController makes an adaptive rule's loop, which pushes its limit to
// the kernel rule named name while that rule is its.
func (d *Daemon) newController(name string, a policy.Adaptive) (*adaptive.Controller, error) {
	opts := a.Options()
	var c *adaptive.Controller
	opts.OnChange = func(from, to int) { d.pushLimit(name, c, to) }
	c, err := adaptive.New(&opts)
	return c, err
}

// pushLimit moves an adaptive rule's kernel limit; it is the change
// callback of c, the rule's loop. A loop the table replaced may still be
// handed a sample (followSamples lets go of the table first): the rule of
// its name is then another's, which it must not move.
func (d *Daemon) pushLimit(name string, c *adaptive.Controller, limit int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	e, ok := d.entries[name]
	if !ok || e.ctrl != c || !e.installed() {
		return
	}
	r := e.kernel
	r.Limit = uint32(limit)
	if err := d.dp.Put(r); err != nil {
		d.log.Error("push adaptive limit", "rule", name, "limit", limit, "err", err)
		return
	}
	e.kernel = r
	// Settled is the limit outside probes: during one, the one it restores.
	settled := limit
	if restore, ok := c.Probing(); ok {
		settled = restore
	}
	d.log.Debug("adaptive limit", "rule", name, "limit", limit, "settled", settled)
}

// constrained tells an adaptive rule's loop that its limit held a
// connection back this round.
func (d *Daemon) constrained(rule string) {
	d.mu.Lock()
	e := d.entries[rule]
	d.mu.Unlock()
	if e != nil && e.ctrl != nil {
		e.ctrl.Constrained()
	}
}
