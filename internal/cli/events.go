package cli

import (
	"encoding/json"
	"fmt"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/egressd/egressd/pkg/control"
)

func eventsCommand() *cli.Command {
	return &cli.Command{
		Name:  "events",
		Usage: "show recent refused connections (an event per process and rule per second, the latest refusal with the count since the last event) and slots recounts gave back; a caller without write access sees only its own process's refusals",
		Flags: []cli.Flag{&cli.BoolFlag{Name: "follow", Aliases: []string{"f"}, Usage: "keep printing refusals as they happen"}, jsonFlag},
		Action: func(c *cli.Context) error {
			cl := client(c)
			if c.Bool("follow") {
				cl.Timeout = 0 // a follow stream lasts until interrupted
			}
			enc := json.NewEncoder(c.App.Writer)
			return cl.Events(c.Context, c.Bool("follow"), func(r control.Event) error {
				if wantJSON(c) {
					return enc.Encode(r)
				}
				if r.Kind == control.EventRecount {
					_, err := fmt.Fprintf(c.App.Writer, "%s recount gave back %d slots of rule %s (%d of sockets freed holding them, %d held by no socket)\n",
						r.Time.Format(time.RFC3339Nano), r.Count, r.Rule, r.Freed, r.GivenBack)
					return err
				}
				mode := "refused"
				if r.Shadow {
					mode = "would refuse (shadow)"
				}
				retry := ""
				if r.RetryAfterSeconds > 0 {
					retry = ", retry after " + seconds(r.RetryAfterSeconds)
				}
				times := ""
				if r.Count > 1 {
					times = fmt.Sprintf(" %d times", r.Count)
				}
				// A UDP flow's destination is marked so; a TCP
				// connection's, as before UDP was counted.
				dest := r.Dest
				if r.Protocol == "udp" {
					dest += "/udp"
				}
				_, err := fmt.Fprintf(c.App.Writer, "%s %s pid %d -> %s by rule %s (%s%s)%s\n",
					r.Time.Format(time.RFC3339Nano), mode, r.PID, dest, r.Rule, r.Shape, retry, times)
				return err
			})
		},
	}
}
