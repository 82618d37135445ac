package main

import (
	"bytes"
	"fmt"
	"strings"

	"github.com/urfave/cli/v2"

	egressdcli "github.com/egressd/egressd/internal/cli"
)

// page is one man page: its name (egressd-limit-set) and roff text.
type page struct {
	name string
	text []byte
}

// pages renders the app and each of its commands, depth first, in the
// order the app defines them.
func pages(app *cli.App, date, version string) []page {
	var all []page
	var walk func(path []string, cmds []*cli.Command)
	walk = func(path []string, cmds []*cli.Command) {
		for _, c := range cmds {
			p := append(append([]string(nil), path...), c.Name)
			all = append(all, commandPage(app, p, c, date, version))
			walk(p, c.Subcommands)
		}
	}
	all = append(all, appPage(app, date, version))
	walk([]string{app.Name}, app.Commands)
	return all
}

func header(b *bytes.Buffer, name, date, version string) {
	fmt.Fprintf(b, ".TH %s 1 %s %s \"egressd manual\"\n", quote(strings.ToUpper(name)), quote(date), quote("egressd "+version))
}

func appPage(app *cli.App, date, version string) page {
	var b bytes.Buffer
	header(&b, app.Name, date, version)
	section(&b, "NAME")
	fmt.Fprintf(&b, "%s \\- %s\n", app.Name, escape(app.Usage))
	section(&b, "SYNOPSIS")
	fmt.Fprintf(&b, ".B %s\n[\\fIglobal options\\fR] \\fIcommand\\fR [\\fIcommand options\\fR] [\\fIarguments\\fR]\n", app.Name)
	section(&b, "DESCRIPTION")
	text(&b, "egressd bounds what leaves a Linux host: how many outbound TCP connections each local service holds to each destination, and how fast it opens new ones. "+
		"eBPF programs at the cgroup connect and socket hooks count every connection and refuse a connect() that would pass a limit; the program sees EPERM. "+
		"The daemon (egressd run) keeps the limits, adapts adaptive ones, and serves this command line, a control API on a unix socket and Prometheus metrics.")
	text(&b, "Each command has its own page, named after it: egressd-run(1), egressd-limit-set(1) and so on. "+
		"Every command takes --help, and --json on every command that prints.")
	section(&b, "GLOBAL OPTIONS")
	options(&b, app.Flags)
	section(&b, "COMMANDS")
	commands(&b, app.Name, app.Commands)
	section(&b, "ENVIRONMENT")
	fmt.Fprintf(&b, ".TP\n.B EGRESSD_SOCKET\nThe control socket, as --socket sets it.\n")
	section(&b, "FILES")
	for _, f := range [][2]string{
		{"/etc/egressd/policy.yaml", "The policy: the rules the daemon enforces (egressd policy check FILE checks one)."},
		{"/var/lib/egressd", "Limits set at run time with egressd limit set, kept across restarts."},
		{"/run/egressd/egressd.sock", "The control socket."},
		{"/sys/fs/bpf/egressd", "The pinned datapath: it keeps enforcing while the daemon is down, until egressd uninstall."},
	} {
		fmt.Fprintf(&b, ".TP\n.I %s\n%s\n", f[0], escape(f[1]))
	}
	section(&b, "SEE ALSO")
	var also []string
	for _, c := range app.Commands {
		also = append(also, app.Name+"-"+c.Name)
	}
	seeAlso(&b, also)
	text(&b, "The documentation in /usr/share/doc/egressd: policy, command line, metrics, operations, installation.")
	return page{name: app.Name, text: b.Bytes()}
}

func commandPage(app *cli.App, path []string, c *cli.Command, date, version string) page {
	name := strings.Join(path, "-")
	full := strings.Join(path, " ")
	var b bytes.Buffer
	header(&b, name, date, version)
	section(&b, "NAME")
	fmt.Fprintf(&b, "%s \\- %s\n", escapeName(name), escape(c.Usage))
	section(&b, "SYNOPSIS")
	fmt.Fprintf(&b, ".B %s\n", escape(full))
	if len(c.Subcommands) > 0 {
		b.WriteString("\\fIcommand\\fR\n")
	}
	if len(c.Flags) > 0 {
		b.WriteString("[\\fIcommand options\\fR]\n")
	}
	if c.ArgsUsage != "" {
		fmt.Fprintf(&b, "\\fI%s\\fR\n", escape(c.ArgsUsage))
	}
	section(&b, "DESCRIPTION")
	usage := c.Usage
	if usage != "" {
		usage = strings.ToUpper(usage[:1]) + usage[1:] + "."
	}
	text(&b, usage)
	if len(c.Aliases) > 0 {
		text(&b, "Also: "+strings.Join(c.Aliases, ", ")+".")
	}
	if c.Description != "" {
		text(&b, c.Description)
	}
	if len(c.Flags) > 0 {
		section(&b, "OPTIONS")
		options(&b, c.Flags)
	}
	text(&b, "The global options of "+app.Name+"(1) go before the command.")
	if len(c.Subcommands) > 0 {
		section(&b, "COMMANDS")
		commands(&b, full, c.Subcommands)
	}
	section(&b, "SEE ALSO")
	also := []string{app.Name}
	if len(path) > 2 {
		also = append(also, strings.Join(path[:len(path)-1], "-"))
	}
	for _, s := range c.Subcommands {
		also = append(also, name+"-"+s.Name)
	}
	seeAlso(&b, also)
	return page{name: name, text: b.Bytes()}
}

func section(b *bytes.Buffer, title string) { fmt.Fprintf(b, ".SH %s\n", title) }

// text writes a paragraph, filled by the formatter.
func text(b *bytes.Buffer, s string) {
	if s == "" {
		return
	}
	fmt.Fprintf(b, ".PP\n%s\n", escape(s))
}

func commands(b *bytes.Buffer, parent string, cmds []*cli.Command) {
	for _, c := range cmds {
		fmt.Fprintf(b, ".TP\n.B %s\n%s\n", escape(parent+" "+c.Name), escape(c.Usage))
	}
}

func seeAlso(b *bytes.Buffer, names []string) {
	b.WriteString(".PP\n")
	for i, n := range names {
		sep := ","
		if i == len(names)-1 {
			sep = ""
		}
		fmt.Fprintf(b, ".BR %s (1)%s\n", escapeName(n), sep)
	}
}

// options lists flags with their value, usage, default and environment.
func options(b *bytes.Buffer, flags []cli.Flag) {
	for _, f := range flags {
		names := f.Names()
		var spelled []string
		for _, n := range names {
			dash := "\\-\\-"
			if len(n) == 1 {
				dash = "\\-"
			}
			spelled = append(spelled, "\\fB"+dash+escapeName(n)+"\\fR")
		}
		doc, ok := f.(cli.DocGenerationFlag)
		head := strings.Join(spelled, ", ")
		if ok && doc.TakesValue() {
			head += " \\fI" + egressdcli.FlagValueName(f) + "\\fR"
		}
		fmt.Fprintf(b, ".TP\n%s\n", head)
		if !ok {
			continue
		}
		usage := doc.GetUsage()
		if egressdcli.FlagRequired(f) {
			usage = "required; " + usage
		}
		if d := egressdcli.FlagDefault(doc); d != "" {
			usage += " (default: " + d + ")"
		}
		if env := doc.GetEnvVars(); len(env) > 0 {
			usage += " (environment: $" + strings.Join(env, ", $") + ")"
		}
		fmt.Fprintf(b, "%s\n", escape(usage))
	}
}

// escape makes text safe for roff: backslashes escaped, and no line that
// starts with a control character.
func escape(s string) string {
	s = strings.ReplaceAll(s, `\`, `\e`)
	lines := strings.Split(s, "\n")
	for i, l := range lines {
		if strings.HasPrefix(l, ".") || strings.HasPrefix(l, "'") {
			lines[i] = `\&` + l
		}
	}
	return strings.Join(lines, "\n")
}

// escapeName also makes hyphens the ASCII minus that copying a command
// or a flag from the page needs.
func escapeName(s string) string { return strings.ReplaceAll(escape(s), "-", `\-`) }

// quote makes a macro argument of s.
func quote(s string) string { return `"` + strings.ReplaceAll(escape(s), `"`, `\(dq`) + `"` }
