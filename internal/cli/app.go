// Package cli is egressd's command line: one file per subcommand, all
// talking to the daemon through one client.
package cli

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/egressd/egressd/pkg/control"
)

// Version is set at build time (-ldflags "-X ...cli.Version=v1.2.3").
var Version = "dev"

// App builds the command line.
func App() *cli.App {
	return &cli.App{
		Name:                 "egressd",
		Usage:                "bound the outbound connections of a Linux host's services",
		Version:              Version,
		EnableBashCompletion: true,
		Action:               unknownCommand(cli.ShowAppHelp),
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "socket", Value: control.DefaultSocket, Usage: "control socket of the daemon", EnvVars: []string{"EGRESSD_SOCKET"}},
			&cli.DurationFlag{Name: "timeout", Value: 10 * time.Second, Usage: "how long a request to the daemon may take"},
			jsonFlag,
		},
		Commands: []*cli.Command{
			runCommand(),
			limitCommand(),
			statusCommand(),
			eventsCommand(),
			topCommand(),
			policyCommand(),
			doctorCommand(),
			uninstallCommand(),
			versionCommand(),
		},
	}
}

// exitUsage is the status of a command line egressd does not take: an
// unknown command, a missing argument, a flag's bad value.
const exitUsage = 2

// Main runs the command line and returns the process's exit code.
func Main(args []string) int {
	app := App()
	app.ErrWriter = os.Stderr
	return run(app, args)
}

// run runs app on args as Main does, printing an error to app.ErrWriter.
func run(app *cli.App, args []string) int {
	app.ExitErrHandler = func(*cli.Context, error) {} // errors are printed once, below
	app.OnUsageError = usageError(app.Flags)
	for _, c := range app.Commands {
		onUsageError(c, app.Flags)
	}
	if err := app.Run(commandLine(app, args)); err != nil {
		var exit cli.ExitCoder
		if errors.As(err, &exit) {
			if msg := err.Error(); msg != "" {
				fmt.Fprintln(app.ErrWriter, "egressd:", msg)
			}
			return exit.ExitCode()
		}
		fmt.Fprintln(app.ErrWriter, "egressd:", err)
		return 1
	}
	return 0
}

// unknownCommand is the action of egressd and of each command made of
// subcommands: alone, it prints help; before a word that names none of
// its commands, it is a usage error. urfave/cli's own action calls the
// word a missing help topic and exits 3, egressd run's status after an
// uninstall, which tells a supervisor not to restart it.
func unknownCommand(help cli.ActionFunc) cli.ActionFunc {
	return func(c *cli.Context) error {
		if !c.Args().Present() {
			return help(c)
		}
		words := append(strings.Fields(c.Command.HelpName)[1:], c.Args().First())
		return cli.Exit(fmt.Sprintf("unknown command %q (see %s --help)", strings.Join(words, " "), c.Command.HelpName), exitUsage)
	}
}

// usageError makes a flag urfave/cli cannot parse a usage error, exit 2,
// said in one line: by default it exits 1, the status of a failed check or
// request, after printing the whole help. A global flag given after the
// command gets a hint, as docs/cli.md says they go before it.
func usageError(global []cli.Flag) cli.OnUsageErrorFunc {
	return func(c *cli.Context, err error, _ bool) error {
		msg := err.Error()
		// The flag package names flags with one dash; egressd's are --name.
		for _, p := range []string{"not defined: -", "for flag -"} {
			msg = strings.Replace(msg, p, p+"-", 1)
		}
		help := c.Command.HelpName
		cmd, ok := commandName(c)
		if !ok { // the app's own flags
			return cli.Exit(fmt.Sprintf("%s (see %s --help)", msg, c.App.Name), exitUsage)
		}
		if undefined, ok := strings.CutPrefix(msg, "flag provided but not defined: --"); ok &&
			slices.ContainsFunc(global, func(f cli.Flag) bool { return slices.Contains(f.Names(), undefined) }) {
			return cli.Exit(fmt.Sprintf("%s: --%s is a global option: put it before the command (%s --%s … %s)",
				cmd, undefined, c.App.Name, undefined, cmd), exitUsage)
		}
		return cli.Exit(fmt.Sprintf("%s: %s (see %s --help)", cmd, msg, help), exitUsage)
	}
}

// commandName is c's command as typed after "egressd" ("limit set"), and
// false for egressd itself. urfave/cli's FullName is the last word alone.
func commandName(c *cli.Context) (string, bool) {
	return strings.CutPrefix(c.Command.HelpName, c.App.Name+" ")
}

func onUsageError(c *cli.Command, global []cli.Flag) {
	c.OnUsageError = usageError(global)
	for _, s := range c.Subcommands {
		onUsageError(s, global)
	}
}

// jsonFlag is global and repeated on every command that prints, so that
// it may come before or after the command's name.
var jsonFlag = &cli.BoolFlag{Name: "json", Usage: "print machine-readable JSON"}

// client is the one way subcommands reach the daemon.
func client(c *cli.Context) *control.Client {
	return &control.Client{Socket: c.String("socket"), Timeout: c.Duration("timeout")}
}

// wantJSON reports whether --json was given, before or after the command.
func wantJSON(c *cli.Context) bool {
	for _, x := range c.Lineage() {
		if x.IsSet("json") {
			return x.Bool("json")
		}
	}
	return false
}

// output prints v as JSON with --json, or with text otherwise.
func output(c *cli.Context, v any, text func(w io.Writer)) error {
	if wantJSON(c) {
		enc := json.NewEncoder(c.App.Writer)
		enc.SetIndent("", "  ")
		return enc.Encode(v)
	}
	// Buffered: a tabwriter writes each cell by itself, and 100,000 rules
	// made `limit list` spend 3 s in write(2).
	w := bufio.NewWriter(c.App.Writer)
	text(w)
	return w.Flush()
}

// commandLine rewrites args so that urfave/cli v2 reads them as
// docs/cli.md says. "help CMD [SUB]" (or "CMD help SUB") becomes "CMD SUB
// --help": urfave/cli's help command shows the help of its first word
// alone, and a command's without its subcommands. A command's flags move
// before its arguments, since urfave/cli stops reading flags at the first
// argument; the flags' definitions say which take the next word as their
// value. After "--" every word is an argument. A shell completing the
// words asks with a last --generate-bash-completion, which must stay last.
func commandLine(app *cli.App, args []string) []string {
	if len(args) > 0 && args[len(args)-1] == "--generate-bash-completion" {
		return args
	}
	flags, cmds := app.Flags, app.Commands
	for i := 1; i < len(args); i++ {
		switch a := args[i]; {
		case a == "--":
			return args
		case isFlag(a):
			if takesValue(flags, a) {
				i++
			}
		case a == "help" || a == "h":
			return commandLine(app, append(append(slices.Clone(args[:i]), args[i+1:]...), "--help"))
		default:
			k := slices.IndexFunc(cmds, func(c *cli.Command) bool { return c.HasName(a) })
			switch {
			case k < 0:
				return args // an unknown command
			case len(cmds[k].Subcommands) == 0:
				return append(slices.Clone(args[:i+1]), flagsFirst(cmds[k].Flags, args[i+1:])...)
			}
			flags, cmds = cmds[k].Flags, cmds[k].Subcommands
		}
	}
	return args
}

// flagsFirst moves a command's flags before its arguments, each flag's
// value with it, keeping the order of the flags and of the arguments.
// --help is the command's help, whatever else is given: urfave/cli would
// take an argument after it for a help topic, and exit 3.
func flagsFirst(flags []cli.Flag, words []string) []string {
	var opts, rest []string
	for i := 0; i < len(words); i++ {
		switch w := words[i]; {
		case w == "--":
			return slices.Concat(opts, []string{"--"}, rest, words[i+1:])
		case w == "--help" || w == "-h":
			return []string{"--help"}
		case isFlag(w):
			opts = append(opts, w)
			if takesValue(flags, w) && i+1 < len(words) {
				i++
				opts = append(opts, words[i])
			}
		default:
			rest = append(rest, w)
		}
	}
	return append(opts, rest...)
}

// isFlag reports whether word is a flag; "-" alone is an argument.
func isFlag(word string) bool { return len(word) > 1 && word[0] == '-' }

// takesValue reports whether word, a flag among flags written without
// "=", takes the next word as its value.
func takesValue(flags []cli.Flag, word string) bool {
	if strings.Contains(word, "=") {
		return false
	}
	for _, f := range flags {
		if d, ok := f.(cli.DocGenerationFlag); ok && slices.Contains(f.Names(), strings.TrimLeft(word, "-")) {
			return d.TakesValue()
		}
	}
	return false
}
