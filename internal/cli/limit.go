package cli

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/egressd/egressd/pkg/control"
)

func limitCommand() *cli.Command {
	return &cli.Command{
		Name:  "limit",
		Usage: "set, show and remove limits at run time",
		Subcommands: []*cli.Command{
			{
				Name:      "set",
				Usage:     "create or replace a limit; it survives restarts and wins over the policy file's rule of that name",
				ArgsUsage: "NAME",
				Flags: []cli.Flag{
					&cli.StringFlag{Name: "dest", Required: true, Usage: "IP, CIDR or host name"},
					&cli.UintFlag{Name: "port", Usage: "destination port (default: any)"},
					&cli.StringFlag{Name: "scope", Usage: "cgroup path inside the cgroup2 hierarchy (default: the whole host)"},
					&cli.StringFlag{Name: "unit", Usage: "systemd unit whose cgroup the limit applies to"},
					&cli.IntFlag{Name: "concurrency", Usage: "live connections at most"},
					&cli.IntFlag{Name: "per-second", Usage: "new connections per second"},
					&cli.IntFlag{Name: "burst", Usage: "with --per-second: bucket size (default: one second's permits)"},
					&cli.IntFlag{Name: "per-window", Usage: "new connections per --window"},
					&cli.DurationFlag{Name: "window", Usage: "with --per-window: the sliding window"},
					&cli.IntFlag{Name: "segments", Usage: "with --per-window: segments of the window (default 8)"},
					&cli.BoolFlag{Name: "adaptive", Usage: "a concurrency limit moved by measured latency"},
					&cli.IntFlag{Name: "min", Usage: "with --adaptive: floor (default 4)"},
					&cli.IntFlag{Name: "max", Usage: "with --adaptive: ceiling (default 200)"},
					&cli.IntFlag{Name: "initial", Usage: "with --adaptive: starting limit (default 20)"},
					&cli.Float64Flag{Name: "multiple", Usage: "with --adaptive: how many times the baseline latency counts as queueing (default 2.0)"},
					&cli.Float64Flag{Name: "decrease-factor", Usage: "with --adaptive: what the limit is multiplied by on queueing (default 0.9)"},
					&cli.IntFlag{Name: "probe-every", Usage: "with --adaptive: rounds between drain probes that relearn the baseline (default: no probes)"},
					&cli.Float64Flag{Name: "probe-factor", Usage: "with --probe-every: the limit during a probe, as a fraction (default 0.5)"},
					&cli.StringFlag{Name: "samples", Usage: "with --adaptive: connect (default) or request latency"},
					&cli.BoolFlag{Name: "shadow", Usage: "count what would be refused, refuse nothing"},
					&cli.StringFlag{Name: "errno", Usage: "errno a refused connect() returns (default EPERM)"},
					&cli.StringFlag{Name: "shared-redis", Usage: "share the limit with every host naming the same --shared-key: URL of the Redis server keeping it"},
					&cli.StringFlag{Name: "shared-key", Usage: "with --shared-redis: the budget's Redis key"},
					&cli.StringFlag{Name: "shared-failure-mode", Usage: "with --shared-redis: throw (keep the last share, default), allow (the whole limit) or deny while Redis is unreachable"},
					jsonFlag,
				},
				Action: limitSet,
			},
			{
				Name:      "get",
				Usage:     "show one limit, its resolved destinations and counts",
				ArgsUsage: "NAME",
				Flags:     []cli.Flag{jsonFlag},
				Action: func(c *cli.Context) error {
					name, err := oneArg(c, "NAME")
					if err != nil {
						return err
					}
					l, err := client(c).Limit(c.Context, name)
					if err != nil {
						return err
					}
					return output(c, l, func(w io.Writer) { printLimit(w, l) })
				},
			},
			{
				Name:    "ls",
				Aliases: []string{"list"},
				Usage:   "list every limit",
				Flags:   []cli.Flag{jsonFlag},
				Action: func(c *cli.Context) error {
					ls, err := client(c).Limits(c.Context)
					if err != nil {
						return err
					}
					return output(c, ls, func(w io.Writer) { printLimits(w, ls) })
				},
			},
			{
				Name:      "rm",
				Aliases:   []string{"remove"},
				Usage:     "remove a limit; a policy file rule stays removed across reloads until set again",
				ArgsUsage: "NAME",
				Action: func(c *cli.Context) error {
					name, err := oneArg(c, "NAME")
					if err != nil {
						return err
					}
					return client(c).RemoveLimit(c.Context, name)
				},
			},
		},
	}
}

func oneArg(c *cli.Context, what string) (string, error) {
	if c.NArg() != 1 {
		return "", cli.Exit(fmt.Sprintf("%s: want one %s, got %d arguments", c.Command.FullName(), what, c.NArg()), 2)
	}
	return c.Args().First(), nil
}

// limitSet writes the flags as one policy rule; the daemon checks it as it
// checks the policy file and names every problem.
func limitSet(c *cli.Context) error {
	name, err := oneArg(c, "NAME")
	if err != nil {
		return err
	}
	var b strings.Builder
	field := func(k string, v any) { fmt.Fprintf(&b, "%s: %s\n", k, yamlValue(v)) }
	field("name", name)
	field("destination", c.String("dest"))
	if c.IsSet("port") {
		field("port", c.Uint("port"))
	}
	if c.IsSet("scope") {
		field("cgroup", c.String("scope"))
	}
	if c.IsSet("unit") {
		field("unit", c.String("unit"))
	}
	if c.IsSet("concurrency") {
		field("concurrency", c.Int("concurrency"))
	}
	nested := func(key string, subs ...string) {
		var parts []string
		for i := 0; i < len(subs); i += 2 {
			if c.IsSet(subs[i+1]) {
				parts = append(parts, fmt.Sprintf("%s: %s", subs[i], yamlValue(c.Value(subs[i+1]))))
			}
		}
		fmt.Fprintf(&b, "%s: {%s}\n", key, strings.Join(parts, ", "))
	}
	if c.IsSet("per-second") || c.IsSet("burst") {
		nested("perSecond", "permits", "per-second", "burst", "burst")
	}
	if c.IsSet("per-window") || c.IsSet("window") || c.IsSet("segments") {
		nested("perWindow", "permits", "per-window", "window", "window", "segments", "segments")
	}
	if c.Bool("adaptive") || c.IsSet("min") || c.IsSet("max") || c.IsSet("initial") || c.IsSet("multiple") ||
		c.IsSet("decrease-factor") || c.IsSet("probe-every") || c.IsSet("probe-factor") || c.IsSet("samples") {
		nested("adaptive", "minimum", "min", "maximum", "max", "initial", "initial", "multiple", "multiple",
			"decreaseFactor", "decrease-factor", "probeEvery", "probe-every", "probeFactor", "probe-factor", "samples", "samples")
	}
	if c.Bool("shadow") {
		field("shadow", true)
	}
	if c.IsSet("shared-redis") || c.IsSet("shared-key") || c.IsSet("shared-failure-mode") {
		nested("shared", "redis", "shared-redis", "key", "shared-key", "failureMode", "shared-failure-mode")
	}
	if c.IsSet("errno") {
		field("errno", c.String("errno"))
	}
	l, err := client(c).SetLimit(c.Context, b.String())
	if err != nil {
		return err
	}
	return output(c, l, func(w io.Writer) { printLimit(w, l) })
}

// yamlValue quotes strings so that a value is never read as YAML syntax.
func yamlValue(v any) string {
	switch v := v.(type) {
	case string:
		return fmt.Sprintf("%q", v)
	case fmt.Stringer:
		return fmt.Sprintf("%q", v.String())
	}
	return fmt.Sprint(v)
}

func printLimit(w io.Writer, l control.Limit) {
	fmt.Fprintf(w, "%s (%s, from %s)\n", l.Name, l.Shape, l.Source)
	fmt.Fprint(w, indentLines(l.Rule, "  "))
	if l.Pending != "" {
		fmt.Fprintf(w, "pending: %s\n", l.Pending)
		return
	}
	fmt.Fprintf(w, "destinations: %s\n", strings.Join(l.Destinations, ", "))
	fmt.Fprintf(w, "limit: %d  live: %d  in flight: %d\n", l.Limit, l.Live, l.InFlight)
	fmt.Fprintf(w, "admitted: %d  refused: %d  shadow refused: %d\n", l.Admitted, l.Refused, l.ShadowRefused)
	if l.BaselineSeconds > 0 {
		fmt.Fprintf(w, "baseline: %s\n", seconds(l.BaselineSeconds))
	}
	if s := l.Shared; s != nil {
		state := "reachable"
		if !s.Reachable {
			state = fmt.Sprintf("UNREACHABLE since %s (%s in force): %s", s.Since.Format(time.TimeOnly), s.FailureMode, s.Error)
		}
		fmt.Fprintf(w, "shared: key %s, %s\n", s.Key, state)
		settings := s.Durability
		if s.Replicas > 0 {
			settings += fmt.Sprintf(", %d replicas confirm grants", s.Replicas)
		}
		if l.Shape == "concurrency" {
			fmt.Fprintf(w, "  %s, lease %s\n", settings, seconds(s.LeaseSeconds))
			fmt.Fprintf(w, "  this host holds %d slots; its fair share is %d\n", s.Slots, s.FairShare)
			if !s.FrozenUntil.IsZero() {
				fmt.Fprintf(w, "  growth frozen until %s: Redis had no record of the budget (lost, or its first use)\n", s.FrozenUntil.Format(time.TimeOnly))
			}
			if s.Expired {
				fmt.Fprintf(w, "  unreachable for a lease: the slots may have expired in Redis, so nothing new is admitted\n")
			}
			if s.Unconfirmed > 0 {
				fmt.Fprintf(w, "  growth left unused %d times: replicas did not confirm it\n", s.Unconfirmed)
			}
		} else {
			fmt.Fprintf(w, "  %s\n", settings)
			fmt.Fprintf(w, "  this host claimed %d permits, spent %d, handed back %d\n", s.Granted, s.Spent, s.Returned)
			if s.Unconfirmed > 0 {
				fmt.Fprintf(w, "  %d permits claimed but not used: replicas did not confirm them\n", s.Unconfirmed)
			}
		}
	}
}

func printLimits(w io.Writer, ls []control.Limit) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tSHAPE\tLIMIT\tLIVE\tIN FLIGHT\tADMITTED\tREFUSED\tSOURCE\tSTATE")
	for _, l := range ls {
		state := "installed"
		if l.Pending != "" {
			state = "pending: " + l.Pending
		} else if l.Shadow {
			state = "shadow"
		} else if l.Shared != nil && !l.Shared.Reachable {
			state = "shared, Redis unreachable: " + l.Shared.FailureMode
		} else if l.Shared != nil {
			state = "shared"
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%d\t%d\t%s\t%s\n", l.Name, l.Shape, l.Limit, l.Live, l.InFlight, l.Admitted, l.Refused, l.Source, state)
	}
	tw.Flush()
}

func indentLines(s, prefix string) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return prefix + strings.Join(lines, "\n"+prefix) + "\n"
}
