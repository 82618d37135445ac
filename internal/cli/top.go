package cli

import (
	"fmt"
	"io"
	"os"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/urfave/cli/v2"
	"golang.org/x/sys/unix"

	"github.com/egressd/egressd/pkg/control"
)

func topCommand() *cli.Command {
	return &cli.Command{
		Name:  "top",
		Usage: "a live table of the busiest rules: limit, live, in flight, admitted and refused per second, baseline, probes and state",
		Description: "STATE says, as in limit ls, whether a rule is installed, pending (not in the kernel, with why; its limit shows as -), " +
			"in shadow or shared. The rows are the busiest rules (--sort busy: the most refusals a second over about the last minute, " +
			"then the most live connections), " + fmt.Sprint(topDefaultRows) + " of them unless --rows says otherwise, picked by the same filters as limit ls. " +
			"On a terminal the table is redrawn in place; into a file or a pipe each table follows the last.",
		Flags: append([]cli.Flag{
			&cli.DurationFlag{Name: "interval", Value: time.Second, Usage: "refresh period"},
			&cli.IntFlag{Name: "count", DefaultText: "until interrupted", Usage: "stop after this many refreshes"},
			jsonFlag,
		}, listFlags(control.SortBusy, topDefaultRows)...),
		Action: func(c *cli.Context) error {
			interval := c.Duration("interval")
			if interval <= 0 {
				return cli.Exit("--interval must be positive", exitUsage)
			}
			q, err := listQuery(c)
			if err != nil {
				return err
			}
			cl := client(c)
			prev := map[string]control.Limit{}
			var prevAt time.Time
			t := time.NewTicker(interval)
			defer t.Stop()
			count := c.Int("count")
			for n := 1; ; n++ {
				var ls []control.Limit
				if err := cl.Limits(c.Context, q, func(l control.Limit) error { ls = append(ls, l); return nil }); err != nil {
					return err
				}
				now := time.Now()
				if !wantJSON(c) && isTerminal(c.App.Writer) {
					// Into a file or a pipe, the tables follow one another.
					fmt.Fprint(c.App.Writer, "\033[H\033[2J") // clear the screen
				}
				rows := topRows(ls, prev, now.Sub(prevAt), !prevAt.IsZero())
				if err := output(c, rows, func(w io.Writer) { printTop(w, rows, now) }); err != nil {
					return err
				}
				clear(prev) // the rows of the last table, for the rates of the next
				for _, l := range ls {
					prev[l.Name] = l
				}
				prevAt = now
				if count > 0 && n >= count {
					return nil
				}
				select {
				case <-c.Context.Done():
					return nil
				case <-t.C:
				}
			}
		},
	}
}

// topDefaultRows is how many rules top shows unless --rows says
// otherwise.
const topDefaultRows = 50

type topRow struct {
	control.Limit
	AdmittedPerSecond float64 `json:"admittedPerSecond"`
	RefusedPerSecond  float64 `json:"refusedPerSecond"`
}

func topRows(ls []control.Limit, prev map[string]control.Limit, elapsed time.Duration, rates bool) []topRow {
	rows := make([]topRow, len(ls))
	for i, l := range ls {
		rows[i].Limit = l
		if p, ok := prev[l.Name]; ok && rates && elapsed > 0 && l.Admitted >= p.Admitted && l.Refused >= p.Refused {
			rows[i].AdmittedPerSecond = float64(l.Admitted-p.Admitted) / elapsed.Seconds()
			rows[i].RefusedPerSecond = float64(l.Refused-p.Refused) / elapsed.Seconds()
		}
	}
	return rows
}

func printTop(w io.Writer, rows []topRow, now time.Time) {
	fmt.Fprintf(w, "egressd top — %s\n\n", now.Format(time.TimeOnly))
	// Numbers align right; STATE, the last cell of a line, left.
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "NAME\tSHAPE\tLIMIT\tLIVE\tIN FLIGHT\tADMITTED/S\tREFUSED/S\tBASELINE\tPROBE\t  STATE")
	for _, r := range rows {
		limit, baseline, probe := strconv.FormatUint(uint64(r.Limit.Limit), 10), "-", "-"
		if r.Pending != "" {
			limit = "-" // not in the kernel: no limit at all, rather than 0
		}
		if r.BaselineSeconds > 0 {
			baseline = seconds(r.BaselineSeconds) + " " + r.BaselineSource
		}
		switch {
		case r.Probing:
			probe = fmt.Sprintf("probing, restores %d", r.SettledLimit)
		case r.Probes > 0:
			probe = fmt.Sprintf("%d, last %s ago", r.Probes, ago(now, r.LastProbe).Round(100*time.Millisecond))
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%d\t%.1f\t%.1f\t%s\t%s\t  %s\n", r.Name, r.Shape, limit, r.Live, r.InFlight, r.AdmittedPerSecond, r.RefusedPerSecond, baseline, probe, limitState(r.Limit))
	}
	tw.Flush()
}

// isTerminal reports whether w is a terminal, where top redraws in place.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}
