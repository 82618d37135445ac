package daemon

import (
	"context"
	"errors"
	"os"
	"time"

	"github.com/egressd/egressd/pkg/control"
	"github.com/egressd/egressd/pkg/policy"
)

// The policy file: read at start, and again on a reload (SIGHUP or
// `egressd policy reload`), which applies it whole or changes nothing.

// loadPolicyFile reads the policy file. At start a missing default file
// is an empty policy, so that a fresh install starts; on a reload it is a
// mistake that must not remove every rule.
func (d *Daemon) loadPolicyFile(atStart bool) (*policy.Policy, error) {
	p, err := d.reader.Load(d.cfg.PolicyFile)
	if errors.Is(err, os.ErrNotExist) && atStart && d.cfg.PolicyFile == DefaultPolicyFile {
		d.log.Warn("no policy file; starting with no rules", "path", d.cfg.PolicyFile)
		return &policy.Policy{}, nil
	}
	return p, err
}

// reloadPolicy reads the policy file again and applies it whole, or
// changes nothing and says why.
func (d *Daemon) reloadPolicy(ctx context.Context) (control.Reload, error) {
	p, err := d.loadPolicyFile(false)
	if errors.Is(err, os.ErrNotExist) {
		err = control.Errorf(control.CodeInvalid, "policy file: %v", err)
	}
	if err == nil {
		err = d.install(ctx, p)
	}
	r := control.Reload{Time: time.Now(), OK: err == nil}
	if err != nil {
		r.Error = err.Error()
	}
	d.mu.Lock()
	d.reload = r
	d.mu.Unlock()
	d.metrics.reloaded(err == nil)
	if err == nil {
		d.log.Info("policy reloaded", "path", d.cfg.PolicyFile)
	}
	return r, err
}

// installAtStart applies the policy with the run-time limits. When the two
// conflict (the file changed while the daemon was down), the daemon starts
// with the policy alone rather than not at all, keeps the run-time limits
// on disk, and says so in status: the CLI can then remove the conflicting
// one.
func (d *Daemon) installAtStart(ctx context.Context, p *policy.Policy) error {
	err := d.install(ctx, p)
	d.metrics.reloaded(err == nil)
	if err == nil || len(d.overrides.Set) == 0 {
		return err
	}
	f := d.prepare(ctx, p.Rules...)
	return d.change(func() ([]retired, error) {
		gone, ferr := d.applyLocked(p, overrides{Removed: d.overrides.Removed}, f)
		if ferr != nil {
			return gone, errors.Join(err, ferr)
		}
		d.reload = control.Reload{Time: time.Now(), Error: "run-time limits not applied: " + err.Error()}
		d.log.Error("run-time limits conflict with the policy; running with the policy alone", "err", err)
		return gone, nil
	})
}

func controlReloadOK() control.Reload { return control.Reload{Time: time.Now(), OK: true} }
