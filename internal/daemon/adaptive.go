package daemon

import (
	"cmp"

	"github.com/egressd/egressd/pkg/adaptive"
	"github.com/egressd/egressd/pkg/loader"
	"github.com/egressd/egressd/pkg/policy"
)

// An adaptive rule's loop (package adaptive) runs on the latency samples
// and refusals the kernel reports (events.go); each change of its limit is
// written to the kernel here.

// newController makes an adaptive rule's loop, which pushes its limit to
// the kernel rule named name while that rule is its. It starts at resume,
// within the rule's Minimum and Maximum, when that is not 0, else at
// Initial.
func (d *Daemon) newController(name string, a policy.Adaptive, resume int) (*adaptive.Controller, error) {
	opts := a.Options()
	if resume > 0 {
		opts.Initial = min(max(resume, cmp.Or(opts.Minimum, adaptive.DefaultMinimum)), cmp.Or(opts.Maximum, adaptive.DefaultMaximum))
	}
	var c *adaptive.Controller
	opts.OnChange = func(from, to int) { d.pushLimit(name, c, to) }
	c, err := adaptive.New(&opts)
	return c, err
}

// resumeAt is where a new loop of the adaptive rule named name starts:
// for a rule new to this daemon, the limit a previous daemon's loop left
// in its pinned kernel rule, so that a restart (an upgrade, a crash) does
// not lift a limit the loop had lowered for a struggling dependency back
// to Initial. 0 (Initial) for a rule this daemon had, since it changed,
// and for one the kernel does not have as an adaptive rule.
func (d *Daemon) resumeAt(name string, old *entry) int {
	if old != nil || !d.dp.Adopted() {
		return 0
	}
	kr, err := d.dp.Rule(name)
	if err != nil || kr.Shape != loader.ShapeConcurrency || !kr.Samples {
		return 0
	}
	return int(kr.Limit)
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
