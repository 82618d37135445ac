package daemon

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/egressd/egressd/pkg/control"
	"github.com/egressd/egressd/pkg/policy"
)

// The policy file: read at start, and again on a reload (SIGHUP or
// `egressd policy reload`), which applies it whole or changes nothing.

// policyFile reads the policy file and keeps a copy of the last one
// applied.
type policyFile struct {
	cfg *Config
	log *slog.Logger
	// reader keeps the rules it read last, so that a reload parses only
	// what changed.
	reader policy.Reader
	// lastGood is the hash of the policy text kept as the last applied
	// (see lastGoodPath), so that a reload of the same text writes nothing.
	lastGood [sha256.Size]byte
}

// load reads the policy file, and returns its text with what it says. At
// start a missing default file is an empty policy, so that a fresh install
// starts; on a reload it is a mistake that must not remove every rule.
func (f *policyFile) load(atStart bool) (*policy.Policy, []byte, error) {
	text, err := os.ReadFile(f.cfg.PolicyFile)
	if errors.Is(err, os.ErrNotExist) && atStart && f.cfg.PolicyFile == DefaultPolicyFile {
		f.log.Warn("no policy file; starting with no rules", "path", f.cfg.PolicyFile)
		return &policy.Policy{}, nil, nil
	}
	if err != nil {
		return nil, nil, fmt.Errorf("read policy: %w", err)
	}
	p, err := f.reader.Parse(text)
	if e, ok := errors.AsType[*policy.Error](err); ok {
		e.File = f.cfg.PolicyFile
	}
	return p, text, err
}

// The text of the last policy applied from the file is kept in the state
// directory: a start whose file is invalid (an edit a reload refused, and
// then a crash or a reboot) runs it rather than not at all, which would
// leave a rebooted host with no limits.
func lastGoodPath(dir string) string { return filepath.Join(dir, "policy.last-good.yaml") }

// keep keeps text, a policy just applied, unless it is what was kept
// last. A failure is logged: the policy is in force all the same.
func (f *policyFile) keep(text []byte) {
	if text == nil {
		return
	}
	sum := sha256.Sum256(text)
	if sum == f.lastGood {
		return
	}
	err := makeDir(f.cfg.StateDir)
	if err == nil {
		err = writeAtomic(f.cfg.StateDir, lastGoodPath(f.cfg.StateDir), text)
	}
	if err != nil {
		f.log.Warn("keeping a copy of the policy applied", "err", err)
		return
	}
	f.lastGood = sum
}

// loadLastGood reads the last policy applied, for a start whose policy
// file is invalid (invalid, its error), and says so in problem; it returns
// invalid, unchanged, when there is none to run.
func (f *policyFile) loadLastGood(invalid error) (p *policy.Policy, problem string, err error) {
	path := lastGoodPath(f.cfg.StateDir)
	text, err := os.ReadFile(path)
	if err != nil {
		if !errors.Is(err, os.ErrNotExist) {
			f.log.Warn("the last policy applied could not be read", "path", path, "err", err)
		}
		return nil, "", invalid
	}
	p, err = f.reader.Parse(text)
	if err != nil {
		f.log.Warn("the last policy applied does not parse", "path", path, "err", err)
		return nil, "", invalid
	}
	f.lastGood = sha256.Sum256(text)
	f.log.Error("policy file invalid; running the last policy applied until a reload takes a valid one", "file", f.cfg.PolicyFile, "err", invalid, "running", path)
	return p, fmt.Sprintf("%v (running the last policy applied, kept in %s)", invalid, path), nil
}

// reloadPolicy reads the policy file again and applies it whole, or
// changes nothing and says why. A reload started while another runs waits
// for it, then reads the file as it is then.
func (d *Daemon) reloadPolicy(ctx context.Context) (control.Reload, error) {
	d.reloadMu.Lock()
	defer d.reloadMu.Unlock()
	t := time.Now()
	p, text, err := d.file.load(false)
	if errors.Is(err, os.ErrNotExist) {
		err = control.Errorf(control.CodeInvalid, "policy file: %v", err)
	}
	read, t := time.Since(t), time.Now()
	if err == nil {
		err = d.table.install(ctx, p, t)
	}
	install := time.Since(t)
	r := control.Reload{Time: time.Now(), OK: err == nil}
	if err != nil {
		r.Error = err.Error()
	}
	d.table.loaded(r)
	d.metrics.reloaded(err == nil)
	if err != nil {
		d.log.Error("policy reload refused; the old policy stays", "path", d.cfg.PolicyFile, "err", err)
	} else {
		d.log.Info("policy reloaded", "path", d.cfg.PolicyFile, "read", ms(read), "install", ms(install))
		d.file.keep(text)
	}
	return r, err
}

// installAtStart applies the policy with the run-time limits. When the two
// conflict (the file changed while the daemon was down), the daemon starts
// with the policy alone rather than not at all, keeps the run-time limits
// on disk, and says so in status: the CLI can then remove the conflicting
// one.
func (d *Daemon) installAtStart(ctx context.Context, p *policy.Policy) error {
	now := time.Now()
	err := d.table.install(ctx, p, now)
	d.metrics.reloaded(err == nil)
	if err != nil {
		err = d.table.holdBackOverrides(ctx, p, err, now)
	}
	return err
}

// ms rounds a phase's time for a log line.
func ms(d time.Duration) time.Duration { return d.Round(time.Millisecond) }
