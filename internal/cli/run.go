package cli

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/egressd/egressd/internal/daemon"
	"github.com/egressd/egressd/internal/kube"
	"github.com/egressd/egressd/internal/sdnotify"
	"github.com/egressd/egressd/pkg/control"
	"github.com/egressd/egressd/pkg/kernelrule"
	"github.com/egressd/egressd/pkg/loader"
)

// exitUninstalled is egressd run's status after an uninstall request; the
// unit's RestartPreventExitStatus keeps systemd from starting it again.
const exitUninstalled = 3

func runCommand() *cli.Command {
	return &cli.Command{
		Name:  "run",
		Usage: "run the daemon: load the datapath, apply the policy, serve the control API and metrics",
		Description: "Adopts a datapath pinned by an earlier run, so enforcement never gaps across a restart. " +
			"SIGHUP reloads the policy. On SIGTERM the datapath stays and keeps enforcing (fail-static) " +
			"unless --detach-on-exit is given (fail-open).",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "policy", Value: daemon.DefaultPolicyFile, Usage: "policy file"},
			&cli.StringFlag{Name: "socket", Value: control.DefaultSocket, Usage: "control socket to serve"},
			&cli.StringFlag{Name: "cgroup", DefaultText: "the cgroup2 root, the whole host", Usage: "cgroup v2 directory to attach to"},
			&cli.StringFlag{Name: "bpffs", Value: loader.DefaultPinDir, Usage: "bpffs directory for the datapath's pins"},
			&cli.StringFlag{Name: "metrics", Value: daemon.DefaultMetricsAddr, Usage: "address for /metrics; empty turns it off"},
			&cli.IntFlag{Name: "metrics-rules", Value: daemon.DefaultMetricsRules, Usage: "the most rules with metrics series of their own (the policy's metrics.rules first, then rules in trouble, then the busiest); every rule is in its class's sums; 0: sums only"},
			&cli.StringFlag{Name: "state-dir", Value: daemon.DefaultStateDir, Usage: "where limits set at run time, and the addresses host names last resolved to, are kept"},
			&cli.IntFlag{Name: "max-rules", DefaultText: "the policy's maxRules, else what its rules need and a quarter more, in steps of 4096", Usage: "rule slots in the kernel's tables, up to 1048576"},
			&cli.StringFlag{Name: "socket-group", Usage: "group allowed to change limits through the socket"},
			&cli.StringFlag{Name: "socket-mode", Value: "0660", Usage: "socket permissions; 0666 lets every local service's SDK ask about its own refusals (read-only)"},
			&cli.BoolFlag{Name: "detach-on-exit", Usage: "remove the datapath when the daemon stops (fail-open)"},
			&cli.StringFlag{Name: "host-id", DefaultText: "the host name", Usage: "this host's name to the hosts sharing a budget in Redis; unique among them"},
			&cli.StringFlag{Name: "log-level", Value: "info", Usage: "debug, info, warn or error"},
			&cli.DurationFlag{Name: "udp-idle", Value: kernelrule.DefaultFlowIdle, Usage: "how long a UDP flow sent to an address may see no datagram before it ends, for rules that do not set udpIdle"},
			&cli.StringFlag{Name: "kube-node", EnvVars: []string{"EGRESSD_KUBE_NODE"}, Usage: "this Kubernetes node's name: make rules of the EgressLimits that select the pods bound to it"},
			&cli.StringFlag{Name: "kubeconfig", DefaultText: "the pod's service account", Usage: "kubeconfig file to reach the API server with (with --kube-node)"},
			&cli.StringFlag{Name: "kube-cgroup-driver", Value: string(kube.Systemd), Usage: "the kubelet's cgroup driver: systemd or cgroupfs (with --kube-node)"},
			&cli.StringFlag{Name: "kube-cgroup-root", Value: "/", Usage: "the kubelet's --cgroup-root (with --kube-node)"},
			&cli.DurationFlag{Name: "recount-every", Value: daemon.DefaultRecount, Usage: "how often the sockets holding slots are recounted and slots no socket holds given back (at least " + daemon.MinRecount.String() + ")"},
		},
		Action: func(c *cli.Context) error {
			var level slog.Level
			if err := level.UnmarshalText([]byte(c.String("log-level"))); err != nil {
				return cli.Exit(fmt.Sprintf("--log-level: %v", err), exitUsage)
			}
			mode, err := strconv.ParseUint(c.String("socket-mode"), 8, 32)
			if err != nil || mode&^0o777 != 0 {
				return cli.Exit(fmt.Sprintf("--socket-mode %q: want octal permission bits such as 0660", c.String("socket-mode")), exitUsage)
			}
			if mode == 0 {
				// The control server takes 0 for its default, 0660.
				return cli.Exit(fmt.Sprintf("--socket-mode %q: no permission bits; for root and the daemon's uid alone, use 0600", c.String("socket-mode")), exitUsage)
			}
			metricsRules := c.Int("metrics-rules")
			switch {
			case metricsRules < 0:
				return cli.Exit(fmt.Sprintf("--metrics-rules %d is negative", metricsRules), exitUsage)
			case metricsRules == 0:
				metricsRules = daemon.NoMetricsRules // the daemon's 0 is the default
			}
			if c.IsSet("max-rules") && c.Int("max-rules") == 0 {
				// The daemon takes 0 for no flag, as a policy's maxRules: 0
				// would be, were it not refused.
				return cli.Exit("--max-rules 0 is not allowed; leave it out for the default", exitUsage)
			}
			var kc *kube.Config
			switch {
			case c.String("kube-node") != "":
				kc = &kube.Config{Node: c.String("kube-node"), Kubeconfig: c.String("kubeconfig"),
					Layout: kube.Layout{Driver: kube.Driver(c.String("kube-cgroup-driver")), Root: c.String("kube-cgroup-root")}}
				if _, err := kube.PodCgroup(kc.Layout.Driver, kc.Layout.Root, kube.Burstable, "x"); err != nil {
					return cli.Exit(fmt.Sprintf("--kube-cgroup-driver %q, --kube-cgroup-root %q: %v", kc.Layout.Driver, kc.Layout.Root, err), exitUsage)
				}
			default:
				for _, f := range []string{"kubeconfig", "kube-cgroup-driver", "kube-cgroup-root"} {
					if c.IsSet(f) {
						return cli.Exit(fmt.Sprintf("--%s needs --kube-node", f), exitUsage)
					}
				}
			}
			log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
			d, err := daemon.New(daemon.Config{
				PolicyFile:   c.String("policy"),
				Cgroup:       c.String("cgroup"),
				PinDir:       c.String("bpffs"),
				Socket:       socketFlag(c),
				SocketGroup:  c.String("socket-group"),
				SocketMode:   fs.FileMode(mode),
				MetricsAddr:  c.String("metrics"),
				MetricsRules: metricsRules,
				StateDir:     c.String("state-dir"),
				MaxRules:     c.Int("max-rules"),
				DetachOnExit: c.Bool("detach-on-exit"),
				HostID:       c.String("host-id"),
				RecountEvery: c.Duration("recount-every"),
				UDPIdle:      c.Duration("udp-idle"),
				Version:      Version,
				Logger:       log,
				Notify:       systemdNotifier{log},
				Kube:         kc,
			})
			if err != nil {
				return cli.Exit(err.Error(), exitUsage)
			}
			ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
			defer stop()
			err = d.Run(ctx)
			if errors.Is(err, daemon.ErrUninstalled) {
				return cli.Exit("", exitUninstalled)
			}
			return err
		},
	}
}

// socketFlag takes run's own --socket, else the global one.
func socketFlag(c *cli.Context) string {
	if c.IsSet("socket") {
		return c.String("socket")
	}
	for _, p := range c.Lineage() {
		if p.IsSet("socket") {
			return p.String("socket")
		}
	}
	return control.DefaultSocket
}

// systemdNotifier reports the daemon's lifecycle to systemd (Type=notify);
// outside systemd every call does nothing.
type systemdNotifier struct{ log *slog.Logger }

func (n systemdNotifier) report(err error) {
	if err != nil {
		n.log.Warn("sd_notify", "err", err)
	}
}

func (n systemdNotifier) Ready()     { n.report(sdnotify.Ready()) }
func (n systemdNotifier) Reloading() { n.report(sdnotify.Reloading()) }
func (n systemdNotifier) Stopping()  { n.report(sdnotify.Stopping()) }
func (n systemdNotifier) Watchdog()  { n.report(sdnotify.Watchdog()) }

func (n systemdNotifier) WatchdogInterval() (time.Duration, bool) { return sdnotify.WatchdogInterval() }
