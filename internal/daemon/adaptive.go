package daemon

import (
	"cmp"
	"context"
	"time"

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
func (t *table) newController(name string, a policy.Adaptive, resume int) (*adaptive.Controller, error) {
	opts := a.Options()
	if resume > 0 {
		opts.Initial = min(max(resume, cmp.Or(opts.Minimum, adaptive.DefaultMinimum)), cmp.Or(opts.Maximum, adaptive.DefaultMaximum))
	}
	var c *adaptive.Controller
	opts.OnChange = func(from, to int) { t.pushLimit(name, c, to) }
	c, err := adaptive.New(&opts)
	return c, err
}

// resumeAt is where a new loop of the adaptive rule named name starts:
// for a rule new to this daemon, the limit a previous daemon's loop left
// in its pinned kernel rule, so that a restart (an upgrade, a crash) does
// not lift a limit the loop had lowered for a struggling dependency back
// to Initial. 0 (Initial) for a rule this daemon had, since it changed,
// and for one the kernel does not have as an adaptive rule.
func (t *table) resumeAt(name string, old *entry) int {
	if old != nil || !t.dp.Adopted() {
		return 0
	}
	kr, err := t.dp.Rule(name)
	if err != nil || kr.Shape != loader.ShapeConcurrency || !kr.Samples {
		return 0
	}
	return int(kr.Limit)
}

// pushLimit moves an adaptive rule's kernel limit; it is the change
// callback of c, the rule's loop. A loop the table replaced may still be
// handed a sample (followSamples lets go of the table first): the rule of
// its name is then another's, which it must not move.
func (t *table) pushLimit(name string, c *adaptive.Controller, limit int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e, ok := t.entries[name]
	if !ok || e.ctrl != c || !e.installed() {
		return
	}
	r := e.kernel
	r.Limit = uint32(limit)
	if err := t.dp.Put(r); err != nil {
		t.log.Error("push adaptive limit", "rule", name, "limit", limit, "err", err)
		return
	}
	e.kernel = r
	// Settled is the limit outside probes: during one, the one it restores.
	settled := limit
	if restore, ok := c.Probing(); ok {
		settled = restore
	}
	t.log.Debug("adaptive limit", "rule", name, "limit", limit, "settled", settled)
}

// constrained tells an adaptive rule's loop that its limit held a
// connection back this round.
func (t *table) constrained(rule string) {
	t.mu.Lock()
	e := t.entries[rule]
	t.mu.Unlock()
	if e != nil && e.ctrl != nil {
		e.ctrl.Constrained()
	}
}

// sample feeds a latency sample to its adaptive rule's loop, if the rule
// has one and measures the sample's kind. The loop runs outside the
// table's lock: its change callback takes it.
func (t *table) sample(s loader.Sample) {
	t.mu.Lock()
	e := t.entries[s.Rule]
	var want loader.SampleKind
	if e != nil && e.ctrl != nil {
		want = e.kernelSampleKind()
	}
	t.mu.Unlock()
	if e != nil && e.ctrl != nil && s.Kind == want {
		// The kernel's time: samples arrive in batches.
		e.ctrl.Sample(s.Time, s.Latency)
	}
}

func (e *entry) kernelSampleKind() loader.SampleKind {
	if e.kernel.Requests {
		return loader.SampleRequest
	}
	return loader.SampleConnect
}

// saturationTick is how often watchSaturation looks at adaptive rules'
// live connections.
const saturationTick = 50 * time.Millisecond

// watchSaturation marks adaptive rules constrained when their live
// connections reach the limit: in-flight at the limit is the other way a
// limit holds callers back. It ticks only while there are adaptive rules:
// a daemon without one does not wake twenty times a second for nothing.
func (t *table) watchSaturation(ctx context.Context) {
	tick := time.NewTicker(saturationTick)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		t.mu.Lock()
		adaptive := t.adaptive
		t.mu.Unlock()
		if len(adaptive) == 0 {
			tick.Stop()
			select {
			case <-ctx.Done():
				return
			case <-t.adaptiveAdded:
			}
			tick.Reset(saturationTick)
			continue
		}
		for _, e := range adaptive {
			live, err := t.dp.Live(e.spec.Name)
			if err == nil && live >= int64(e.ctrl.Limit()) {
				e.ctrl.Constrained()
			}
		}
	}
}
