package cli

import (
	"errors"
	"fmt"

	"github.com/urfave/cli/v2"

	"github.com/egressd/egressd/pkg/control"
	"github.com/egressd/egressd/pkg/loader"
)

func uninstallCommand() *cli.Command {
	return &cli.Command{
		Name:  "uninstall",
		Usage: "detach the datapath and remove its pins, ending enforcement; a running daemon exits",
		Flags: []cli.Flag{&cli.StringFlag{Name: "bpffs", Value: loader.DefaultPinDir, Usage: "bpffs directory of the pins, when no daemon runs"}},
		Action: func(c *cli.Context) error {
			err := client(c).Uninstall(c.Context)
			if control.IsNotRunning(err) {
				// No daemon: remove what a stopped one left pinned.
				err := loader.Uninstall(c.String("bpffs"))
				if errors.Is(err, loader.ErrNotPinned) {
					// A mistyped --bpffs, or a second uninstall: an
					// operator told enforcement ended would be wrong.
					return fmt.Errorf("%w; nothing removed, enforcement unchanged", err)
				}
				if err != nil {
					return err
				}
				fmt.Fprintf(c.App.Writer, "removed the datapath pinned at %s\n", c.String("bpffs"))
				return nil
			}
			if err != nil {
				return err
			}
			fmt.Fprintln(c.App.Writer, "the daemon is detaching the datapath and exiting")
			return nil
		},
	}
}
