package cli

import (
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/egressd/egressd/pkg/control"
)

func topCommand() *cli.Command {
	return &cli.Command{
		Name:  "top",
		Usage: "a live table of every rule: limit, live, in flight, admitted and refused per second, baseline",
		Flags: []cli.Flag{
			&cli.DurationFlag{Name: "interval", Value: time.Second, Usage: "refresh period"},
			&cli.IntFlag{Name: "count", DefaultText: "until interrupted", Usage: "stop after this many refreshes"},
			jsonFlag,
		},
		Action: func(c *cli.Context) error {
			interval := c.Duration("interval")
			if interval <= 0 {
				return cli.Exit("--interval must be positive", exitUsage)
			}
			cl := client(c)
			prev := map[string]control.Limit{}
			var prevAt time.Time
			t := time.NewTicker(interval)
			defer t.Stop()
			count := c.Int("count")
			for n := 1; ; n++ {
				ls, err := cl.Limits(c.Context)
				if err != nil {
					return err
				}
				now := time.Now()
				if !wantJSON(c) {
					fmt.Fprint(c.App.Writer, "\033[H\033[2J") // clear the screen
				}
				rows := topRows(ls, prev, now.Sub(prevAt), !prevAt.IsZero())
				if err := output(c, rows, func(w io.Writer) { printTop(w, rows, now) }); err != nil {
					return err
				}
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
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "NAME\tSHAPE\tLIMIT\tLIVE\tIN FLIGHT\tADMITTED/S\tREFUSED/S\tBASELINE\tPROBE\t")
	for _, r := range rows {
		baseline, probe := "-", "-"
		if r.BaselineSeconds > 0 {
			baseline = seconds(r.BaselineSeconds) + " " + r.BaselineSource
		}
		switch {
		case r.Probing:
			probe = fmt.Sprintf("probing, restores %d", r.SettledLimit)
		case r.Probes > 0:
			probe = fmt.Sprintf("%d, last %s ago", r.Probes, ago(now, r.LastProbe).Round(100*time.Millisecond))
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%.1f\t%.1f\t%s\t%s\t\n", r.Name, r.Shape, r.Limit.Limit, r.Live, r.InFlight, r.AdmittedPerSecond, r.RefusedPerSecond, baseline, probe)
	}
	tw.Flush()
}
