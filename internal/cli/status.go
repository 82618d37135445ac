package cli

import (
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/urfave/cli/v2"
)

func statusCommand() *cli.Command {
	return &cli.Command{
		Name:  "status",
		Usage: "show the daemon's state",
		Flags: []cli.Flag{jsonFlag},
		Action: func(c *cli.Context) error {
			s, err := client(c).Status(c.Context)
			if err != nil {
				return err
			}
			return output(c, s, func(w io.Writer) {
				fmt.Fprintf(w, "egressd %s, up %s\n", s.Version, time.Since(s.Started).Round(time.Second))
				fmt.Fprintf(w, "datapath: %s on %s (adopted: %v)\n", s.PinDir, orWholeHost(s.Cgroup), s.Adopted)
				fmt.Fprintf(w, "policy: %s\n", s.PolicyFile)
				reload := "ok"
				if !s.LastReload.OK {
					reload = "refused: " + s.LastReload.Error
				}
				fmt.Fprintf(w, "last load: %s (%s)\n", s.LastReload.Time.Format(time.RFC3339), reload)
				fmt.Fprintf(w, "rules: %d (%d pending)\n", s.Rules, s.Pending)
				if s.Shared > 0 {
					redis := "reachable"
					if len(s.Unreachable) > 0 {
						redis = "UNREACHABLE for " + strings.Join(s.Unreachable, ", ") + " (failure modes in force)"
					}
					fmt.Fprintf(w, "shared budgets: %d rules, Redis %s\n", s.Shared, redis)
					if len(s.Frozen) > 0 {
						fmt.Fprintf(w, "  growth frozen for %s: Redis had no record of the budget (lost, or its first use)\n", strings.Join(s.Frozen, ", "))
					}
				}
				fmt.Fprintf(w, "events lost: %d refusals, %d samples\n", s.LostRefusals, s.LostSamples)
				if k := s.Kube; k != nil {
					api := fmt.Sprintf("connected since %s", k.Since.Format(time.RFC3339))
					if !k.Connected {
						api = fmt.Sprintf("UNREACHABLE since %s (%s); the rules last known stay in force", k.Since.Format(time.RFC3339), k.Error)
					}
					fmt.Fprintf(w, "kubernetes: node %s, API server %s\n", k.Node, api)
					fmt.Fprintf(w, "  %d pods, %d EgressLimits selecting them (%d not applied), %d rules\n", k.Pods, k.Limits, k.Refused, k.Rules)
				}
			})
		},
	}
}

func orWholeHost(cgroup string) string {
	if cgroup == "" {
		return "the whole host"
	}
	return cgroup
}

func seconds(s float64) string {
	return time.Duration(s * float64(time.Second)).Round(time.Microsecond).String()
}
