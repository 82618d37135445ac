// Command mangen writes egressd's man pages from the command line's own
// definition (internal/cli.App()): egressd(1), and one page per command
// and subcommand, git-style (egressd-limit-set(1)), so `man egressd` and
// `man egressd-doctor` both work. `make deb` runs it.
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"

	"github.com/egressd/egressd/internal/cli"
)

func main() {
	out := flag.String("o", "man", "directory to write the pages to (section 1)")
	date := flag.String("date", "", "date in the pages' footer, YYYY-MM-DD (the commit's, for reproducible builds)")
	version := flag.String("version", cli.Version, "version in the pages' footer")
	flag.Parse()
	if err := write(*out, *date, *version); err != nil {
		fmt.Fprintln(os.Stderr, "mangen:", err)
		os.Exit(1)
	}
}

func write(dir, date, version string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	for _, p := range pages(cli.App(), date, version) {
		if err := os.WriteFile(filepath.Join(dir, p.name+".1"), p.text, 0o644); err != nil {
			return err
		}
	}
	return nil
}
