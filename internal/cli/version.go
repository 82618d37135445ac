package cli

import (
	"fmt"
	"runtime"

	"github.com/urfave/cli/v2"
)

func versionCommand() *cli.Command {
	return &cli.Command{
		Name:  "version",
		Usage: "print the version",
		Action: func(c *cli.Context) error {
			fmt.Fprintf(c.App.Writer, "egressd %s (%s)\n", Version, runtime.Version())
			return nil
		},
	}
}
