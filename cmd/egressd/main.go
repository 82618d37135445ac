// Command egressd bounds what leaves a Linux host: run the daemon, and
// change and watch its limits.
package main

import (
	"os"

	"github.com/egressd/egressd/internal/cli"
)

func main() { os.Exit(cli.Main(os.Args)) }
