package cli

import (
	"strconv"
	"strings"

	"github.com/urfave/cli/v2"
)

// A flag's line in --help says what docs/cli.md and the man pages say:
// urfave/cli's own does not mark a required flag, and writes a zero
// default ("(default: 0)") for a flag that has none.
func init() {
	plain := cli.FlagStringer
	cli.FlagStringer = func(f cli.Flag) string {
		line := plain(f) // names, a tab, the usage, its default
		if d, ok := f.(cli.DocGenerationFlag); ok && FlagDefault(d) == "" && d.GetDefaultText() != "" {
			line = strings.Replace(line, " (default: "+d.GetDefaultText()+")", "", 1)
		}
		if FlagRequired(f) {
			line = strings.Replace(line, "\t", "\trequired; ", 1)
		}
		return line
	}
}

// FlagRequired reports whether a command refuses to run without f.
func FlagRequired(f cli.Flag) bool {
	r, ok := f.(cli.RequiredFlag)
	return ok && r.IsRequired()
}

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
