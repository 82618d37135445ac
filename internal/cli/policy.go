package cli

import (
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/urfave/cli/v2"

	"github.com/egressd/egressd/pkg/policy"
)

func policyCommand() *cli.Command {
	return &cli.Command{
		Name:   "policy",
		Usage:  "check a policy file, or make the daemon read its own again",
		Action: unknownCommand(cli.ShowSubcommandHelp),
		Subcommands: []*cli.Command{
			{
				Name:      "check",
				Usage:     "list every problem in a policy file (no daemon needed); exits 1 if there is one",
				ArgsUsage: "FILE",
				Flags:     []cli.Flag{jsonFlag},
				Action: func(c *cli.Context) error {
					file, err := oneArg(c, "FILE")
					if err != nil {
						return err
					}
					_, err = policy.Load(file)
					var pe *policy.Error
					switch {
					case errors.As(err, &pe):
						problems := pe.Problems
						if wantJSON(c) {
							output(c, policyCheck{Problems: splitLines(pe.Error())}, nil)
						} else {
							fmt.Fprint(c.App.ErrWriter, pe.Error())
							if len(pe.Error()) > 0 && pe.Error()[len(pe.Error())-1] != '\n' {
								fmt.Fprintln(c.App.ErrWriter)
							}
						}
						return cli.Exit(fmt.Sprintf("%s: %d problem(s)", file, len(problems)), 1)
					case errors.Is(err, os.ErrNotExist):
						return cli.Exit(err.Error(), 1)
					case err != nil:
						return err
					}
					return output(c, policyCheck{OK: true}, func(w io.Writer) { fmt.Fprintf(w, "%s: ok\n", file) })
				},
			},
			{
				Name:  "reload",
				Usage: "make the daemon read its policy file again; a bad file changes nothing",
				Flags: []cli.Flag{jsonFlag},
				Action: func(c *cli.Context) error {
					r, err := client(c).ReloadPolicy(c.Context)
					if err != nil {
						return err
					}
					return output(c, r, func(w io.Writer) { fmt.Fprintln(w, "policy reloaded") })
				},
			},
		},
	}
}

// policyCheck is what policy check --json prints.
type policyCheck struct {
	OK       bool     `json:"ok"`
	Problems []string `json:"problems,omitempty"`
}

func splitLines(s string) []string {
	var out []string
	start := 0
	for i := range len(s) {
		if s[i] == '\n' {
			if i > start {
				out = append(out, s[start:i])
			}
			start = i + 1
		}
	}
	if start < len(s) {
		out = append(out, s[start:])
	}
	return out
}
