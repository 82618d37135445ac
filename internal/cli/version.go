package cli

import (
	"fmt"
	"io"
	"runtime"

	"github.com/urfave/cli/v2"
)

// egressd --version prints what egressd version does: urfave/cli's own
// line ("egressd version dev") lacked the Go release.
func init() {
	cli.VersionPrinter = func(c *cli.Context) { printVersion(c.App.Writer) }
}

func versionCommand() *cli.Command {
	return &cli.Command{
		Name:  "version",
		Usage: "print the version",
		Action: func(c *cli.Context) error {
			printVersion(c.App.Writer)
			return nil
		},
	}
}

func printVersion(w io.Writer) {
	fmt.Fprintf(w, "egressd %s (%s)\n", Version, runtime.Version())
}
