package cli

import (
	"strconv"

	"github.com/urfave/cli/v2"
)

// FlagValueName names a flag's value by its type, for docs/cli.md and the
// man pages.
func FlagValueName(f cli.Flag) string {
	switch f.(type) {
	case *cli.DurationFlag:
		return "DURATION"
	case *cli.IntFlag, *cli.UintFlag, *cli.Int64Flag, *cli.Uint64Flag:
		return "N"
	case *cli.Float64Flag:
		return "X"
	}
	return "VALUE"
}

// FlagDefault is a flag's default as written in the code, for docs/cli.md
// and the man pages; empty for a zero value, whose meaning the flag's
// usage says. It reads only the definition, never the environment.
func FlagDefault(f cli.DocGenerationFlag) string {
	d := f.GetDefaultText()
	if u, err := strconv.Unquote(d); err == nil {
		d = u
	}
	switch d {
	case "", "0", "false", "0s":
		return ""
	}
	return d
}
