package daemon

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/egressd/egressd/pkg/control"
	"github.com/egressd/egressd/pkg/policy"
)

// The policy file: read at start, and again on a reload (SIGHUP or
// `egressd policy reload`), which applies it whole or changes nothing.

// loadPolicyFile reads the policy file, and returns its text with what it
// says. At start a missing default file is an empty policy, so that a
// fresh install starts; on a reload it is a mistake that must not remove
// every rule.
func (d *Daemon) loadPolicyFile(atStart bool) (*policy.Policy, []byte, error) {
	text, err := os.ReadFile(d.cfg.PolicyFile)
	if errors.Is(err, os.ErrNotExist) && atStart && d.cfg.PolicyFile == DefaultPolicyFile {
		d.log.Warn("no policy file; starting with no rules", "path", d.cfg.PolicyFile)
		return &policy.Policy{}, nil, nil
	}
	if err != nil {
		return nil, nil, fmt.Errorf("read policy: %w", err)
	}
	p, err := d.reader.Parse(text)
	if e, ok := errors.AsType[*policy.Error](err); ok {
		e.File = d.cfg.PolicyFile
	}
	return p, text, err
}

// The text of the last policy applied from the file is kept in the state
// directory: a start whose file is invalid (an edit a reload refused, and
// then a crash or a reboot) runs it rather than not at all, which would
// leave a rebooted host with no limits.
func lastGoodPath(dir string) string { return filepath.Join(dir, "policy.last-good.yaml") }

// saveLastGood keeps text, a policy just applied, unless it is what was
// kept last. A failure is logged: the policy is in force all the same.
func (d *Daemon) saveLastGood(text []byte) {
	if text == nil {
		return
	}
	sum := sha256.Sum256(text)
	if sum == d.lastGood {
		return
	}
	err := makeDir(d.cfg.StateDir)
	if err == nil {
		err = writeAtomic(d.cfg.StateDir, lastGoodPath(d.cfg.StateDir), text)
	}
	if err != nil {
		d.log.Warn("keeping a copy of the policy applied", "err", err)
		return
	}
	d.lastGood = sum
}

// loadLastGood reads the last policy applied, for a start whose policy
// file is invalid (invalid, its error); it returns invalid, unchanged,
// when there is none to run.
func (d *Daemon) loadLastGood(invalid error) (*policy.Policy, error) {
	path := lastGoodPath(d.cfg.StateDir)
	text, err := os.ReadFile(path)
	if err != nil {
		if !errors.Is(err, os.ErrNotExist) {
			d.log.Warn("the last policy applied could not be read", "path", path, "err", err)
		}
		return nil, invalid
	}
	p, err := d.reader.Parse(text)
	if err != nil {
		d.log.Warn("the last policy applied does not parse", "path", path, "err", err)
		return nil, invalid
	}
	d.lastGood = sha256.Sum256(text)
	d.log.Error("policy file invalid; running the last policy applied until a reload takes a valid one", "file", d.cfg.PolicyFile, "err", invalid, "running", path)
	d.startProblem(fmt.Sprintf("%v (running the last policy applied, kept in %s)", invalid, path))
	return p, nil
}

// startProblem adds what the start could not do as it should to the
// status's last load, which a reload that succeeds clears.
func (d *Daemon) startProblem(msg string) {
	if d.reload.Error != "" {
		msg = d.reload.Error + "; " + msg
	}
	d.reload = control.Reload{Time: time.Now(), Error: msg}
}

// reloadPolicy reads the policy file again and applies it whole, or
// changes nothing and says why. A reload started while another runs waits
// for it, then reads the file as it is then.
func (d *Daemon) reloadPolicy(ctx context.Context) (control.Reload, error) {
	d.reloadMu.Lock()
	defer d.reloadMu.Unlock()
	t := time.Now()
	p, text, err := d.loadPolicyFile(false)
	if errors.Is(err, os.ErrNotExist) {
		err = control.Errorf(control.CodeInvalid, "policy file: %v", err)
	}
	read, t := time.Since(t), time.Now()
	if err == nil {
		err = d.install(ctx, p)
	}
	install := time.Since(t)
	r := control.Reload{Time: time.Now(), OK: err == nil}
	if err != nil {
		r.Error = err.Error()
	}
	d.mu.Lock()
	d.reload = r
	d.mu.Unlock()
	d.metrics.reloaded(err == nil)
	if err != nil {
		d.log.Error("policy reload refused; the old policy stays", "path", d.cfg.PolicyFile, "err", err)
	} else {
		d.log.Info("policy reloaded", "path", d.cfg.PolicyFile, "read", ms(read), "install", ms(install))
		d.saveLastGood(text)
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
	return d.change(ctx, d.prepare(ctx, p.Rules...), func(f found) ([]retired, error) {
		gone, ferr := d.applyLocked(p, overrides{Removed: d.overrides.Removed}, f)
		if ferr != nil {
			return gone, errors.Join(err, ferr)
		}
		d.reload = control.Reload{Time: time.Now(), Error: "run-time limits not applied: " + err.Error()}
		d.heldBack = true
		d.log.Error("run-time limits conflict with the policy; running with the policy less the rules removed at run time", "err", err)
		return gone, nil
	})
}

// ms rounds a phase's time for a log line.
func ms(d time.Duration) time.Duration { return d.Round(time.Millisecond) }

func controlReloadOK() control.Reload { return control.Reload{Time: time.Now(), OK: true} }
