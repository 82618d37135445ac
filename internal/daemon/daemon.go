// Package daemon is egressd run: it keeps the kernel datapath's rules equal
// to the policy file plus the changes made at run time, moves adaptive
// limits, holds this host's shares of shared budgets, serves the control
// API and the metrics, and follows refusals.
//
// Where things live:
//   - daemon.go: the configuration, and the Daemon, which makes the parts
//     and wires them; run.go: Run, which starts them and stops them on
//     one path; reload.go: the policy file and its reloads.
//   - datapath.go: the kernel side, as the narrow interface the parts
//     call (the loader implements it; the tests' fake does too).
//   - table.go: the table, the rules in force and how each is written to
//     the kernel; its other files are overrides.go (run-time changes,
//     kept on disk), scope.go (cgroups and units), capacity.go (the size
//     of the kernel's rule tables), clash.go (rules that resolve to the
//     same traffic), adaptive.go (adaptive rules' loops and their pushes)
//     and share*.go (this host's shares of shared budgets, decided by
//     package decide).
//   - names.go: host-name destinations, looked up outside every lock.
//   - events.go: the event log of refusals, and attribution; api.go and
//     listing.go: the control API; metrics.go: the metrics, and
//     tracker.go what they remember of every rule's counts between reads
//     of them all (the classes' sums, the busiest rules).
package daemon

import (
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"strings"
	"sync"
	"time"
	"unicode"

	"github.com/egressd/egressd/internal/dns"
	"github.com/egressd/egressd/internal/kube"
	"github.com/egressd/egressd/pkg/control"
	"github.com/egressd/egressd/pkg/kernelrule"
	"github.com/egressd/egressd/pkg/loader"
)

// Defaults for Config.
const (
	DefaultPolicyFile  = "/etc/egressd/policy.yaml"
	DefaultStateDir    = "/var/lib/egressd"
	DefaultMetricsAddr = "127.0.0.1:9464"
	DefaultRefresh     = 30 * time.Second
	DefaultRecount     = 30 * time.Second
	// MinRecount is the shortest recount period: a recount walks every
	// tracked socket's state.
	MinRecount = 100 * time.Millisecond
	// DefaultMetricsRules keeps a scrape of 100,000 rules near 1 MB: 500
	// rules' series of their own, about 2.4 KB each, and the classes'
	// sums.
	DefaultMetricsRules = 500
	// NoMetricsRules, as Config.MetricsRules, gives no rule series of its
	// own: the classes' sums alone.
	NoMetricsRules = -1
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
	// MetricsRules is the most rules the metrics serve series of their
	// own for; with more, the policy's metrics.rules come first, then
	// rules in trouble, then the busiest, and every rule is in its
	// class's sums. 0 is DefaultMetricsRules; NoMetricsRules is none.
	MetricsRules int
	// StateDir keeps the changes made at run time, and the addresses
	// host names last resolved to.
	StateDir string
	// DetachOnExit removes the datapath when the daemon stops (fail-open);
	// by default it stays and keeps enforcing (fail-static).
	DetachOnExit bool
	// Refresh is how often units are looked up again (a restarted unit
	// gets a new cgroup); host names are looked up again when their DNS
	// TTL runs out.
	Refresh time.Duration
	// UDPIdle is how long a UDP flow sent to an address may see no
	// datagram before it ends, for rules that do not say (udpIdle); 0 is
	// kernelrule.DefaultFlowIdle.
	UDPIdle time.Duration
	// RecountEvery is how often the sockets holding slots are recounted,
	// the slots no socket holds given back (within two periods of their
	// loss) and marks other programs took off put back. 0 is
	// DefaultRecount.
	RecountEvery time.Duration
	// Resolver looks host names up; nil is /etc/hosts then the servers of
	// /etc/resolv.conf.
	Resolver *dns.Resolver
	// MaxRules sizes the kernel's rule tables, up to loader.MaxRules; 0
	// takes the policy's maxRules, else sizes them from the policy.
	MaxRules int
	// HostID names this host to the others sharing a budget (its slots
	// in Redis are its own); empty is the host name. Two daemons sharing
	// a budget must not have the same one.
	HostID  string
	Version string
	Logger  *slog.Logger
	// Notify hears of the daemon's lifecycle (systemd's sd_notify).
	Notify Notifier
	// Kube, when not nil, makes rules of the EgressLimits that select
	// pods of its node (its CgroupMount and Logger are the daemon's).
	Kube *kube.Config

	// open opens the datapath; nil is the kernel's (the tests' fake
	// otherwise). keepalive is how often a follower of events that waits
	// is sent an empty line; 0 is followKeepalive.
	open      func(*loader.Config) (datapath, error)
	keepalive time.Duration
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

func (c Config) withDefaults() Config {
	if c.PolicyFile == "" {
		c.PolicyFile = DefaultPolicyFile
	}
	if c.StateDir == "" {
		c.StateDir = DefaultStateDir
	}
	if c.Socket == "" {
		c.Socket = control.DefaultSocket
	}
	if c.Refresh == 0 {
		c.Refresh = DefaultRefresh
	}
	if c.RecountEvery == 0 {
		c.RecountEvery = DefaultRecount
	}
	if c.UDPIdle == 0 {
		c.UDPIdle = kernelrule.DefaultFlowIdle
	}
	if c.MetricsRules == 0 {
		c.MetricsRules = DefaultMetricsRules
	}
	if c.Resolver == nil {
		c.Resolver = &dns.Resolver{}
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Notify == nil {
		c.Notify = noNotifier{}
	}
	if c.HostID == "" {
		c.HostID, _ = os.Hostname()
	}
	if c.open == nil {
		c.open = openKernel
	}
	if c.keepalive == 0 {
		c.keepalive = followKeepalive
	}
	return c
}

// maxSocketPath is the longest unix socket path the kernel takes
// (sun_path is 108 bytes, with its NUL).
const maxSocketPath = 107

// validate lists every problem with a Config that has its defaults.
func (c *Config) validate() error {
	var problems []string
	if len(c.Socket) > maxSocketPath {
		problems = append(problems, fmt.Sprintf("socket path %s is longer than %d bytes", c.Socket, maxSocketPath))
	}
	if c.SocketMode&^fs.ModePerm != 0 {
		problems = append(problems, fmt.Sprintf("socket mode %v has more than permission bits", c.SocketMode))
	}
	if c.Refresh < 0 {
		problems = append(problems, fmt.Sprintf("refresh %v is negative", c.Refresh))
	}
	if c.RecountEvery < MinRecount {
		problems = append(problems, fmt.Sprintf("recount period %v is shorter than %v", c.RecountEvery, MinRecount))
	}
	if c.UDPIdle < time.Second || c.UDPIdle > kernelrule.MaxFlowIdle || c.UDPIdle%time.Second != 0 {
		problems = append(problems, fmt.Sprintf("UDP flow idle time %v is not a whole number of seconds between 1s and %v", c.UDPIdle, kernelrule.MaxFlowIdle))
	}
	if c.MetricsRules < NoMetricsRules {
		problems = append(problems, fmt.Sprintf("metrics rules %d is negative", c.MetricsRules))
	}
	if c.MaxRules < 0 || c.MaxRules > loader.MaxRules {
		problems = append(problems, fmt.Sprintf("max rules %d is outside 1..%d", c.MaxRules, loader.MaxRules))
	}
	if c.HostID == "" || strings.ContainsFunc(c.HostID, func(r rune) bool { return unicode.IsSpace(r) || !unicode.IsPrint(r) }) {
		problems = append(problems, fmt.Sprintf("host id %q must be non-empty, printable and without whitespace", c.HostID))
	}
	if c.MetricsAddr != "" {
		if _, _, err := net.SplitHostPort(c.MetricsAddr); err != nil {
			problems = append(problems, fmt.Sprintf("metrics address %q: %v", c.MetricsAddr, err))
		}
	}
	if len(problems) == 0 {
		return nil
	}
	return fmt.Errorf("%w: %s", ErrConfig, strings.Join(problems, "; "))
}

// ErrConfig is what New's error for a bad Config matches.
var ErrConfig = errors.New("bad configuration")

// Daemon is one egressd run: it makes the parts, wires them together and
// runs them.
type Daemon struct {
	cfg Config
	log *slog.Logger
	dp  datapath

	file    *policyFile
	table   *table
	names   *names
	redis   *redisClients
	events  *eventLog
	metrics *metrics
	list    *lister
	api     *api
	// reloadMu makes reloads (SIGHUP's and the API's) one at a time, each
	// held from the read of the file to the apply: otherwise a reload
	// whose lookups are slow applies the file it read after a later
	// reload applied a newer one. The table's lock cannot serve: it is not
	// held across the lookups.
	reloadMu sync.Mutex
	stop     chan struct{} // closed by an uninstall request
	stopOnce sync.Once
	kube     *kube.Source // nil without Config.Kube
}

// New checks cfg and makes a daemon that Run starts. It does no I/O.
func New(cfg Config) (*Daemon, error) {
	c := cfg.withDefaults()
	if err := c.validate(); err != nil {
		return nil, err
	}
	d := &Daemon{cfg: c, log: c.Logger, redis: newRedisClients(), events: newEventLog(), stop: make(chan struct{})}
	d.names = newNames(c.Resolver, c.StateDir, d.log)
	d.file = &policyFile{cfg: &d.cfg, log: d.log}
	d.table = newTable(&d.cfg, d.names, d.redis, d.log)
	d.metrics = newMetrics(&d.cfg, d.table, max(c.MetricsRules, 0), d.log)
	d.list = &lister{table: d.table, metrics: d.metrics}
	d.api = &api{cfg: &d.cfg, table: d.table, list: d.list, events: d.events, reload: d.reloadPolicy, uninstall: d.requestStop, log: d.log}
	return d, nil
}

// useDatapath makes dp the kernel side of every part.
func (d *Daemon) useDatapath(dp datapath) {
	d.dp, d.table.dp, d.metrics.dp, d.list.dp, d.api.dp = dp, dp, dp, dp, dp
}

// ErrUninstalled is Run's result after an uninstall request: the datapath
// is gone and the daemon must not be restarted (egressd run exits with
// status 3, which the unit's RestartPreventExitStatus honours).
var ErrUninstalled = errors.New("uninstalled")

func (d *Daemon) requestStop() { d.stopOnce.Do(func() { close(d.stop) }) }
