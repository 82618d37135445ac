package cli

import (
	"bufio"
	"encoding/json"
	"errors"
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
	return &cli.Command{
		Name:   "limit",
		Usage:  "set, show and remove limits at run time",
		Action: unknownCommand(cli.ShowSubcommandHelp),
		Subcommands: []*cli.Command{
			{
				Name:      "set",
				Usage:     "create or replace a limit; it survives restarts and wins over the policy file's rule of that name",
				ArgsUsage: "NAME",
				Flags:     append(ruleFlags(), jsonFlag),
				Action:    limitSet,
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
				Usage:   "list the limits, every one or those the flags pick, printed as the daemon reads them",
				Description: "With thousands of rules, pick the ones to see: the filters combine, --sort busy puts first the rules " +
					"refusing most lately, and --rows keeps the first N. The table is aligned by blocks of " + fmt.Sprint(listBlock) + " rows.",
				Flags: append(listFlags(control.SortName, 0), jsonFlag),
				Action: func(c *cli.Context) error {
					q, err := listQuery(c)
					if err != nil {
						return err
					}
					return listLimits(c, q)
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
func limitSet(c *cli.Context) error {
	name, err := oneArg(c, "NAME")
	if err != nil {
		return err
	}
	r, err := rule(c, name)
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

// listFlags pick the rules limit ls and top show; sort and rows are the
// command's defaults.
func listFlags(sort string, rows int) []cli.Flag {
	rowsText := "all"
	if rows > 0 {
		rowsText = ""
	}
	return []cli.Flag{
		&cli.StringFlag{Name: "state", Usage: "only rules installed (in the kernel), pending, shadow or shared"},
		&cli.StringFlag{Name: "shape", Usage: "only rules of a shape: concurrency, adaptive, per_second or per_window"},
		&cli.StringFlag{Name: "name", Usage: "only rules whose name matches a pattern (* any run of characters but /, ? one, [abc] one of a set)"},
		&cli.StringFlag{Name: "dest", Usage: "only rules with a destination holding an address, overlapping a prefix, or that is a host name"},
		&cli.StringFlag{Name: "source", Usage: "only rules of the policy file (policy), set at run time (cli), made for Kubernetes EgressLimits (k8s) or for one (k8s:NAMESPACE/NAME)"},
		&cli.StringFlag{Name: "sort", Value: sort, Usage: "name, or busy: the most refusals a second over about the last minute first, then the most live connections"},
		&cli.IntFlag{Name: "rows", Value: rows, DefaultText: rowsText, Usage: "show at most this many rules, the first in the order of --sort; 0 for all"},
	}
}

// listQuery is the query listFlags' values make.
func listQuery(c *cli.Context) (control.LimitsQuery, error) {
	if c.Int("rows") < 0 {
		return control.LimitsQuery{}, cli.Exit(fmt.Sprintf("--rows %d is negative", c.Int("rows")), exitUsage)
	}
	return control.LimitsQuery{State: c.String("state"), Shape: c.String("shape"), Name: c.String("name"), Dest: c.String("dest"),
		Source: c.String("source"), Sort: c.String("sort"), Max: c.Int("rows")}, nil
}

// listBlock is how many rows of limit ls are aligned together: each block
// is printed as soon as it is read.
const listBlock = 1000

// listLimits prints the limits q picks as the daemon sends them: with
// --json a JSON array, one element at a time.
func listLimits(c *cli.Context, q control.LimitsQuery) error {
	w := bufio.NewWriter(c.App.Writer)
	var row func(l control.Limit) error
	var end func() error
	if wantJSON(c) {
		n := 0
		row = func(l control.Limit) error {
			b, err := json.MarshalIndent(l, "  ", "  ")
			if err != nil {
				return err
			}
			sep := ",\n  "
			if n++; n == 1 {
				sep = "[\n  "
			}
			w.WriteString(sep)
			w.Write(b)
			return nil
		}
		end = func() error {
			if n == 0 {
				w.WriteString("[]\n")
			} else {
				w.WriteString("\n]\n")
			}
			return w.Flush()
		}
	} else {
		tw := limitsTable(w)
		n := 0
		row = func(l control.Limit) error {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%d\t%d\t%d\t%d\t%s\t%s\n", l.Name, l.Shape, strings.Join(l.Protocols, ","), l.Limit, l.Live, l.InFlight, l.Admitted, l.Refused, l.Source, limitState(l))
			if n++; n%listBlock == 0 {
				tw.Flush()
				return w.Flush()
			}
			return nil
		}
		end = func() error {
			tw.Flush()
			return w.Flush()
		}
	}
	err := client(c).Limits(c.Context, q, row)
	return errors.Join(err, end())
}

// limitsTable starts limit ls's table on w.
func limitsTable(w io.Writer) *tabwriter.Writer {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tSHAPE\tPROTOCOLS\tLIMIT\tLIVE\tIN FLIGHT\tADMITTED\tREFUSED\tSOURCE\tSTATE")
	return tw
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
