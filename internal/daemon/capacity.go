package daemon

import (
	"errors"

	"github.com/egressd/egressd/pkg/loader"
	"github.com/egressd/egressd/pkg/policy"
)

// ruleSlots is the size of the kernel's rule tables for a policy whose
// kernel rules need need slots (loader.SlotsFor): egressd run
// --max-rules, else the policy's maxRules (explicit), else what they need
// and a quarter more, in whole multiples of loader.DefaultMaxRules.
func (c *Config) ruleSlots(p *policy.Policy, need int) (n int, explicit bool) {
	switch {
	case c.MaxRules > 0:
		return c.MaxRules, true
	case p.MaxRules > 0:
		return p.MaxRules, true
	}
	step := loader.DefaultMaxRules
	n = max(step, (need+need/4+step-1)/step*step)
	return min(n, loader.MaxRules), false
}

// openingSize is the size of the kernel's rule tables to open for rules
// of pol's and the run-time ones (see Config.ruleSlots), before the
// table's first change.
func (t *table) openingSize(pol *policy.Policy, rules int) (n int, explicit bool) {
	return t.cfg.ruleSlots(pol, rules+len(t.overrides.Set))
}

// fitTables resizes the rule tables, enforcing all along, to an explicit
// size, or up when the size taken from the policy outgrew them. Tables that
// hold a rule beyond an explicit smaller size stay as they are.
func (t *table) fitTables(p *policy.Policy, kernel []loader.Rule) error {
	n, explicit := t.cfg.ruleSlots(p, loader.SlotsFor(kernel))
	cur := t.dp.MaxRules()
	if n == cur || (!explicit && n < cur) {
		return nil
	}
	err := t.dp.Resize(n)
	switch {
	case err == nil:
		t.log.Info("rule tables resized", "from", cur, "to", n)
		return nil
	case explicit && n < cur && errors.Is(err, loader.ErrFull):
		t.log.Warn("rule tables kept at their size: a rule's slot is beyond the size asked", "size", cur, "asked", n, "err", err)
		return nil
	}
	return err
}
