package cli

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/egressd/egressd/pkg/control"
	"github.com/egressd/egressd/pkg/policy"
)

func limitCommand() *cli.Command {
	set := ruleFlags()
	return &cli.Command{
		Name:   "limit",
		Usage:  "set, show and remove limits at run time",
		Action: unknownCommand(cli.ShowSubcommandHelp),
		Subcommands: []*cli.Command{
			{
				Name:      "set",
				Usage:     "create or replace a limit; it survives restarts and wins over the policy file's rule of that name",
				ArgsUsage: "NAME",
				Flags:     append(set.cliFlags(), jsonFlag),
				Action:    func(c *cli.Context) error { return limitSet(c, set) },
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
		cmd, _ := commandName(c)
		return "", cli.Exit(fmt.Sprintf("%s: want one %s, got %d arguments", cmd, what, c.NArg()), exitUsage)
	}
	return c.Args().First(), nil
}

// limitSet builds one policy rule from the flags, checks it as a policy
// file's rule is checked, and sends it; the daemon checks it again against
// the rules in force.
func limitSet(c *cli.Context, flags ruleFlagList) error {
	name, err := oneArg(c, "NAME")
	if err != nil {
		return err
	}
	r, err := flags.rule(c, name)
	if err != nil {
		return err
	}
	text, err := policy.FormatRule(r)
	if err != nil {
		return err
	}
	l, err := client(c).SetLimit(c.Context, string(text))
	if err != nil {
		return err
	}
	return output(c, l, func(w io.Writer) { printLimit(w, l) })
}

func printLimit(w io.Writer, l control.Limit) {
	fmt.Fprintf(w, "%s (%s, from %s)\n", l.Name, l.Shape, l.Source)
	fmt.Fprint(w, indentLines(l.Rule, "  "))
	if l.Pending != "" {
		fmt.Fprintf(w, "pending: %s\n", l.Pending)
		return
	}
	fmt.Fprintf(w, "destinations: %s  protocols: %s\n", strings.Join(l.Destinations, ", "), strings.Join(l.Protocols, ","))
	fmt.Fprintf(w, "limit: %d  live: %d  in flight: %d\n", l.Limit, l.Live, l.InFlight)
	fmt.Fprintf(w, "admitted: %d  refused: %d  shadow refused: %d\n", l.Admitted, l.Refused, l.ShadowRefused)
	if l.Shape == "adaptive" {
		printLoop(w, l, time.Now())
	}
	if s := l.Shared; s != nil {
		state := "reachable"
		if s.Waiting {
			state = "waiting for Redis's first answer"
		} else if !s.Reachable {
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

// printLoop says what an adaptive rule's loop is doing: its baseline and
// where it came from, and its drain probes.
func printLoop(w io.Writer, l control.Limit, now time.Time) {
	switch {
	case l.BaselineSeconds > 0:
		fmt.Fprintf(w, "baseline: %s (%s)\n", seconds(l.BaselineSeconds), baselineFrom(l.BaselineSource))
	default:
		fmt.Fprintln(w, "baseline: none yet (the limit holds until there is one)")
	}
	switch {
	case l.Probing:
		fmt.Fprintf(w, "probe: running, the limit held at %d; it restores %d\n", l.Limit, l.SettledLimit)
	case l.NoProbes && l.BaselineSource == "fixed":
		// The baseline says it all.
	case l.NoProbes:
		fmt.Fprintln(w, "probes: none (probeEvery 0: the reference loop)")
	case l.Probes > 0:
		fmt.Fprintf(w, "probes: %d, the last ended %s ago; the next is due in %s\n",
			l.Probes, ago(now, l.LastProbe), ago(l.NextProbe, now))
	case !l.NextProbe.IsZero():
		fmt.Fprintf(w, "probes: none yet; the first is due in %s\n", ago(l.NextProbe, now))
	default:
		fmt.Fprintln(w, "probes: none yet; the first is planned once a round keeps its limit")
	}
}

func baselineFrom(source string) string {
	switch source {
	case "probes":
		return "learned in drain probes"
	case "window":
		return "10th percentile of the last five minutes"
	case "fixed":
		return "fixed"
	}
	return source
}

// ago is how long from then to now, to the millisecond, never negative.
func ago(now, then time.Time) time.Duration {
	return max(now.Sub(then), 0).Round(time.Millisecond)
}

func printLimits(w io.Writer, ls []control.Limit) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tSHAPE\tPROTOCOLS\tLIMIT\tLIVE\tIN FLIGHT\tADMITTED\tREFUSED\tSOURCE\tSTATE")
	for _, l := range ls {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%d\t%d\t%d\t%d\t%s\t%s\n", l.Name, l.Shape, strings.Join(l.Protocols, ","), l.Limit, l.Live, l.InFlight, l.Admitted, l.Refused, l.Source, limitState(l))
	}
	tw.Flush()
}

// limitState is a rule's STATE in limit ls and top: whether it is in the
// kernel, and refusing.
func limitState(l control.Limit) string {
	switch {
	case l.Pending != "":
		return "pending: " + l.Pending
	case l.Shadow:
		return "shadow"
	case l.Shared != nil && l.Shared.Waiting:
		return "shared, waiting for Redis"
	case l.Shared != nil && !l.Shared.Reachable:
		return "shared, Redis unreachable: " + l.Shared.FailureMode
	case l.Shared != nil:
		return "shared"
	}
	return "installed"
}

func indentLines(s, prefix string) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return prefix + strings.Join(lines, "\n"+prefix) + "\n"
}
