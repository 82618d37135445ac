// Package daemon is egressd run: it keeps the kernel datapath's rules equal
// to the policy file plus the changes made at run time, moves adaptive
// limits, serves the control API and the metrics, and follows refusals.
package daemon

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/redis/go-redis/v9"

	"github.com/egressd/egressd/internal/dns"
	"github.com/egressd/egressd/pkg/control"
	"github.com/egressd/egressd/pkg/loader"
	"github.com/egressd/egressd/pkg/policy"
)

// Defaults for Config.
const (
	DefaultPolicyFile  = "/etc/egressd/policy.yaml"
	DefaultStateDir    = "/var/lib/egressd"
	DefaultMetricsAddr = "127.0.0.1:9464"
	DefaultRefresh     = 30 * time.Second
)

// Config is how egressd run was started.
type Config struct {
	// PolicyFile is read at start and on reload. A missing file is an
	// empty policy only when it is the default path.
	PolicyFile string
	// Cgroup is where the datapath attaches; empty is the cgroup2 root.
	Cgroup string
	// PinDir is the bpffs directory of the datapath's pins.
	PinDir string
	// Socket is the control socket; SocketGroup may write to it.
	// SocketMode 0 is 0660; 0666 lets every local service's SDK ask
	// whether a refusal was egressd's (read-only, about its own process).
	Socket      string
	SocketGroup string
	SocketMode  fs.FileMode
	// MetricsAddr serves /metrics; empty turns it off.
	MetricsAddr string
	// StateDir keeps the changes made at run time.
	StateDir string
	// DetachOnExit removes the datapath when the daemon stops (fail-open);
	// by default it stays and keeps enforcing (fail-static).
	DetachOnExit bool
	// Refresh is how often units are looked up again (a restarted unit
	// gets a new cgroup) and the sockets recounted; host names are looked
	// up again when their DNS TTL runs out.
	Refresh time.Duration
	// Resolver looks host names up; nil is /etc/hosts then the servers of
	// /etc/resolv.conf.
	Resolver *dns.Resolver
	// HostID names this host to the others sharing a budget (its slots
	// in Redis are its own); empty is the host name. Two daemons sharing
	// a budget must not have the same one.
	HostID  string
	Version string
	Logger  *slog.Logger
	// Notify hears of the daemon's lifecycle (systemd's sd_notify).
	Notify Notifier
}

// Notifier is told when the daemon is ready, reloading and stopping, and
// pinged while it is healthy.
type Notifier interface {
	Ready()
	Reloading()
	Stopping()
	Watchdog()
	// WatchdogInterval is how often Watchdog must be called, if at all.
	WatchdogInterval() (time.Duration, bool)
}

type noNotifier struct{}

func (noNotifier) Ready()                                  {}
func (noNotifier) Reloading()                              {}
func (noNotifier) Stopping()                               {}
func (noNotifier) Watchdog()                               {}
func (noNotifier) WatchdogInterval() (time.Duration, bool) { return 0, false }

func (c *Config) withDefaults() Config {
	out := *c
	if out.PolicyFile == "" {
		out.PolicyFile = DefaultPolicyFile
	}
	if out.StateDir == "" {
		out.StateDir = DefaultStateDir
	}
	if out.Socket == "" {
		out.Socket = control.DefaultSocket
	}
	if out.Refresh == 0 {
		out.Refresh = DefaultRefresh
	}
	if out.Resolver == nil {
		out.Resolver = &dns.Resolver{}
	}
	if out.Logger == nil {
		out.Logger = slog.Default()
	}
	if out.Notify == nil {
		out.Notify = noNotifier{}
	}
	if out.HostID == "" {
		out.HostID, _ = os.Hostname()
	}
	return out
}

// Daemon is one running egressd.
type Daemon struct {
	cfg     Config
	log     *slog.Logger
	dp      *loader.Datapath
	started time.Time

	mu     sync.Mutex
	policy *policy.Policy
	// overrides are the run-time limits as saved; applied are those in
	// force, which differ only after a conflict at start.
	overrides overrides
	applied   overrides
	entries   map[string]*entry
	hostsMu   sync.Mutex // guards hosts, looked up without mu
	hosts     map[string]hostEntry
	reload    control.Reload
	redisMu   sync.Mutex
	redis     map[string]redis.UniversalClient // by URL, for shared budgets

	events   *eventLog
	metrics  *metrics
	stop     chan struct{} // closed by an uninstall request
	stopOnce sync.Once
}

// Run runs the daemon until ctx ends, SIGTERM or SIGINT arrives, or an
// uninstall request. SIGHUP reloads the policy.
func Run(ctx context.Context, cfg Config) error {
	c := cfg.withDefaults()
	d := &Daemon{cfg: c, log: c.Logger, started: time.Now(), entries: map[string]*entry{}, hosts: map[string]hostEntry{}, redis: map[string]redis.UniversalClient{}, stop: make(chan struct{})}
	d.events = newEventLog()
	d.metrics = newMetrics(d)

	pol, err := d.loadPolicyFile(true)
	if err != nil {
		return err
	}
	if d.overrides, err = loadOverrides(c.StateDir); err != nil {
		return err
	}
	// The socket first: a second daemon started by mistake stops here,
	// before it touches the datapath of the first.
	srv, err := control.NewServer(control.Config{Socket: c.Socket, Group: c.SocketGroup, Mode: c.SocketMode, Routes: d.routes(), Logger: d.log})
	if err != nil {
		return err
	}
	ln, err := srv.Listen()
	if err != nil {
		return err
	}
	dp, err := loader.Open(&loader.Config{Cgroup: c.Cgroup, PinDir: c.PinDir})
	if err != nil {
		srv.Close()
		return fmt.Errorf("datapath: %w", err)
	}
	d.dp = dp
	d.log.Info("datapath ready", "pins", dp.PinDir(), "adopted", dp.Adopted(), "cgroup", c.Cgroup)

	if err := d.installAtStart(ctx, pol); err != nil {
		d.endShares(false)
		srv.Close()
		dp.Close()
		return fmt.Errorf("apply policy: %w", err)
	}

	var metricsLn net.Listener
	if c.MetricsAddr != "" {
		if metricsLn, err = net.Listen("tcp", c.MetricsAddr); err != nil {
			d.endShares(false)
			srv.Close()
			dp.Close()
			return fmt.Errorf("metrics listener: %w", err)
		}
	}

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	wg.Go(func() { d.followRefusals(ctx) })
	wg.Go(func() { d.followSamples(ctx) })
	wg.Go(func() { d.refreshLoop(ctx) })
	wg.Go(func() {
		if err := srv.Serve(ln); err != nil {
			d.log.Error("control server", "err", err)
		}
	})
	var metricsSrv *http.Server
	if metricsLn != nil {
		reg := prometheus.NewRegistry()
		reg.MustRegister(d.metrics)
		metricsSrv = &http.Server{Handler: promhttp.HandlerFor(reg, promhttp.HandlerOpts{}), ReadHeaderTimeout: 10 * time.Second}
		wg.Go(func() {
			if err := metricsSrv.Serve(metricsLn); !errors.Is(err, http.ErrServerClosed) {
				d.log.Error("metrics server", "err", err)
			}
		})
	}
	c.Notify.Ready()
	var watchdog <-chan time.Time
	if every, ok := c.Notify.WatchdogInterval(); ok {
		t := time.NewTicker(every / 2)
		defer t.Stop()
		watchdog = t.C
	}
	d.mu.Lock()
	rules := len(d.entries)
	d.mu.Unlock()
	d.log.Info("egressd running", "socket", c.Socket, "metrics", c.MetricsAddr, "rules", rules)

	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	uninstall := false
	for done := false; !done; {
		select {
		case <-ctx.Done():
			done = true
		case <-d.stop:
			done, uninstall = true, true
		case <-hup:
			c.Notify.Reloading()
			if _, err := d.reloadPolicy(ctx); err != nil {
				d.log.Error("policy reload refused; the old policy stays", "err", err)
			}
			c.Notify.Ready()
		case <-watchdog:
			c.Notify.Watchdog()
		}
	}
	c.Notify.Stopping()

	d.log.Info("egressd stopping", "detach", uninstall || c.DetachOnExit)
	shutdown, cancelShutdown := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancelShutdown()
	srv.Shutdown(shutdown)
	if metricsSrv != nil {
		metricsSrv.Shutdown(shutdown)
	}
	cancel()
	d.events.close()
	wg.Wait()
	d.endShares(uninstall || c.DetachOnExit)
	switch {
	case uninstall:
		if err := d.dp.Uninstall(); err != nil {
			return err
		}
		return ErrUninstalled
	case c.DetachOnExit:
		return d.dp.Uninstall()
	}
	return d.dp.Close()
}

// ErrUninstalled is Run's result after an uninstall request: the datapath
// is gone and the daemon must not be restarted (egressd run exits with
// status 3, which the unit's RestartPreventExitStatus honours).
var ErrUninstalled = errors.New("uninstalled")

// loadPolicyFile reads the policy file. At start a missing default file
// is an empty policy, so that a fresh install starts; on a reload it is a
// mistake that must not remove every rule.
func (d *Daemon) loadPolicyFile(atStart bool) (*policy.Policy, error) {
	p, err := policy.Load(d.cfg.PolicyFile)
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
	d.mu.Lock()
	defer d.mu.Unlock()
	if ferr := d.installLocked(ctx, p, overrides{Removed: d.overrides.Removed}); ferr != nil {
		return errors.Join(err, ferr)
	}
	d.reload = control.Reload{Time: time.Now(), Error: "run-time limits not applied: " + err.Error()}
	d.log.Error("run-time limits conflict with the policy; running with the policy alone", "err", err)
	return nil
}

// endShares stops the shared budgets' loops. Their slots go back only when
// the datapath goes too; otherwise the kernel keeps enforcing them, so they
// stay claimed until their leases run out or a restarted daemon takes them.
func (d *Daemon) endShares(release bool) {
	d.mu.Lock()
	var shares []*shareRunner
	for _, e := range d.entries {
		if e.share != nil {
			shares = append(shares, e.share)
		}
	}
	d.mu.Unlock()
	for _, s := range shares {
		s.end(release)
	}
	d.closeRedis()
}

func (d *Daemon) requestStop() { d.stopOnce.Do(func() { close(d.stop) }) }
