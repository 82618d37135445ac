package cli

import (
	"bytes"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/urfave/cli/v2"
)

var update = flag.Bool("update", false, "rewrite docs/cli.md from the CLI definition")

// cliDocPath is docs/cli.md, from this package's directory.
var cliDocPath = filepath.Join("..", "..", "docs", "cli.md")

// TestCLIDocs holds docs/cli.md to what App() defines: every command,
// subcommand and flag, with its usage and default. Run
//
//	go test ./internal/cli -run TestCLIDocs -update
//
// after changing a command or a flag, and commit the file it writes.
func TestCLIDocs(t *testing.T) {
	got := renderCLIDocs(App())
	if *update {
		if err := os.WriteFile(cliDocPath, got, 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(cliDocPath)
	if err != nil {
		t.Fatalf("%v\nrun: go test ./internal/cli -run TestCLIDocs -update", err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("docs/cli.md is stale: it differs from the CLI definition in internal/cli (first difference at line %d).\n"+
			"Run: go test ./internal/cli -run TestCLIDocs -update\nand commit docs/cli.md.", firstDiffLine(got, want))
	}
}

// TestCLIDocsDeterministic: two renderings of two App()s are the same
// bytes, so the check above never flaps.
func TestCLIDocsDeterministic(t *testing.T) {
	if a, b := renderCLIDocs(App()), renderCLIDocs(App()); !bytes.Equal(a, b) {
		t.Fatal("renderCLIDocs is not deterministic")
	}
}

// TestCLIDocsCoverEveryFlag: every flag of every command appears in the
// rendering, so a new kind of flag the renderer does not know is caught.
func TestCLIDocsCoverEveryFlag(t *testing.T) {
	app := App()
	doc := string(renderCLIDocs(app))
	var walk func(prefix string, flags []cli.Flag, cmds []*cli.Command)
	walk = func(prefix string, flags []cli.Flag, cmds []*cli.Command) {
		for _, f := range flags {
			if !strings.Contains(doc, "`--"+f.Names()[0]) {
				t.Errorf("%s: flag --%s is missing from docs/cli.md's rendering", prefix, f.Names()[0])
			}
		}
		for _, c := range cmds {
			if !strings.Contains(doc, "## "+prefix+" "+c.Name+"\n") && !strings.Contains(doc, "### "+prefix+" "+c.Name+"\n") {
				t.Errorf("command %s %s is missing", prefix, c.Name)
			}
			walk(prefix+" "+c.Name, c.Flags, c.Subcommands)
		}
	}
	walk(app.Name, app.Flags, app.Commands)
}

func firstDiffLine(a, b []byte) int {
	la, lb := bytes.Split(a, []byte("\n")), bytes.Split(b, []byte("\n"))
	for i := range min(len(la), len(lb)) {
		if !bytes.Equal(la[i], lb[i]) {
			return i + 1
		}
	}
	return min(len(la), len(lb)) + 1
}

// renderCLIDocs writes the command line as Markdown, in the order App()
// defines it. It reads only the definition, never the environment: a
// flag's default is its Value as written in the code.
func renderCLIDocs(app *cli.App) []byte {
	var b bytes.Buffer
	fmt.Fprintf(&b, "# %s command line\n\n", app.Name)
	b.WriteString("<!-- Generated from internal/cli (cli.App()) by TestCLIDocs; do not edit.\n")
	b.WriteString("     Regenerate: go test ./internal/cli -run TestCLIDocs -update -->\n\n")
	fmt.Fprintf(&b, "`%s` — %s.\n\n", app.Name, app.Usage)
	fmt.Fprintf(&b, "```\n%s [global options] command [command options] [arguments...]\n```\n\n", app.Name)
	b.WriteString("Every command also takes `--help` (`-h`), and `" + app.Name + " help command [subcommand]` prints the same text\n")
	b.WriteString("(`" + app.Name + " help limit set` is `" + app.Name + " limit set --help`);\n")
	b.WriteString("`" + app.Name + " --version` (`-v`) prints the version. A command's flags may come before or after its\n")
	b.WriteString("arguments (`" + app.Name + " limit get web --json`); `--` ends them, so that the words after it are arguments.\n")
	b.WriteString("Global options go before the command; `--json` may also follow it.\n" +
		"A command line egressd does not take (an unknown command or flag, a value it cannot parse, a missing argument)\n" +
		"exits 2 with one line saying why.\n\n")

	b.WriteString("## Global options\n\n")
	flagTable(&b, app.Flags)

	b.WriteString("## Commands\n\n")
	for _, c := range app.Commands {
		fmt.Fprintf(&b, "- [`%s %s`](#%s) — %s\n", app.Name, c.Name, anchor(app.Name+" "+c.Name), c.Usage)
		for _, s := range c.Subcommands {
			fmt.Fprintf(&b, "  - [`%s %s %s`](#%s) — %s\n", app.Name, c.Name, s.Name, anchor(app.Name+" "+c.Name+" "+s.Name), s.Usage)
		}
	}
	b.WriteString("\n")

	for _, c := range app.Commands {
		command(&b, "##", app.Name, c)
		for _, s := range c.Subcommands {
			command(&b, "###", app.Name+" "+c.Name, s)
		}
	}
	return append(bytes.TrimRight(b.Bytes(), "\n"), '\n')
}

func command(b *bytes.Buffer, heading, parent string, c *cli.Command) {
	full := parent + " " + c.Name
	fmt.Fprintf(b, "%s %s\n\n", heading, full)
	fmt.Fprintf(b, "%s.\n\n", upperFirst(c.Usage))
	synopsis := full
	if len(c.Subcommands) > 0 {
		synopsis += " command"
	}
	if len(c.Flags) > 0 {
		synopsis += " [command options]"
	}
	if c.ArgsUsage != "" {
		synopsis += " " + c.ArgsUsage
	}
	fmt.Fprintf(b, "```\n%s\n```\n\n", synopsis)
	if len(c.Aliases) > 0 {
		fmt.Fprintf(b, "Also: %s.\n\n", codeList(c.Aliases))
	}
	if c.Description != "" {
		fmt.Fprintf(b, "%s\n\n", c.Description)
	}
	if len(c.Subcommands) > 0 {
		names := make([]string, len(c.Subcommands))
		for i, s := range c.Subcommands {
			names[i] = s.Name
		}
		fmt.Fprintf(b, "Subcommands: %s.\n\n", codeList(names))
	}
	if len(c.Flags) > 0 {
		flagTable(b, c.Flags)
	}
}

func flagTable(b *bytes.Buffer, flags []cli.Flag) {
	b.WriteString("| Flag | Default | Usage |\n| --- | --- | --- |\n")
	for _, f := range flags {
		names := f.Names()
		spell := "`--" + names[0]
		doc, ok := f.(cli.DocGenerationFlag)
		if ok && doc.TakesValue() {
			spell += " " + FlagValueName(f)
		}
		spell += "`"
		for _, alias := range names[1:] {
			dash := "--"
			if len(alias) == 1 {
				dash = "-"
			}
			spell += ", `" + dash + alias + "`"
		}
		usage, def := "", ""
		if ok {
			usage = doc.GetUsage()
			def = defaultText(doc)
			if env := doc.GetEnvVars(); len(env) > 0 {
				usage += " (environment: " + codeList(prefixAll("$", env)) + ")"
			}
		}
		if FlagRequired(f) {
			usage = "**required**; " + usage
		}
		fmt.Fprintf(b, "| %s | %s | %s |\n", spell, cell(def), cell(usage))
	}
	b.WriteString("\n")
}

// defaultText is the flag's default, or a dash for none.
func defaultText(f cli.DocGenerationFlag) string {
	if d := FlagDefault(f); d != "" {
		return "`" + d + "`"
	}
	return "—"
}

func cell(s string) string { return strings.ReplaceAll(s, "|", `\|`) }

func codeList(xs []string) string {
	out := make([]string, len(xs))
	for i, x := range xs {
		out[i] = "`" + x + "`"
	}
	return strings.Join(out, ", ")
}

func prefixAll(p string, xs []string) []string {
	out := make([]string, len(xs))
	for i, x := range xs {
		out[i] = p + x
	}
	return out
}

func upperFirst(s string) string {
	if s == "" {
		return s
	}
	return strings.ToUpper(s[:1]) + s[1:]
}

// anchor is the GitHub heading anchor of a heading of plain words.
func anchor(heading string) string {
	return strings.ReplaceAll(strings.ToLower(heading), " ", "-")
}

// TestHelpSaysWhatDocsSay: each flag's line in --help gives its default
// once, the one docs/cli.md gives (none for a zero value), and marks it
// required when docs/cli.md does.
func TestHelpSaysWhatDocsSay(t *testing.T) {
	app := App()
	var walk func(path []string, flags []cli.Flag, cmds []*cli.Command)
	walk = func(path []string, flags []cli.Flag, cmds []*cli.Command) {
		_, help, _ := runCLI(append(path, "--help")...)
		for _, f := range flags {
			line := helpLine(help, f.Names()[0])
			if line == "" {
				t.Errorf("egressd %s --help: no line for --%s", strings.Join(path, " "), f.Names()[0])
				continue
			}
			want := 0
			if d := FlagDefault(f.(cli.DocGenerationFlag)); d != "" {
				want = 1
				if !strings.Contains(line, d+`)`) && !strings.Contains(line, d+`")`) {
					t.Errorf("%q does not give the default %s", line, d)
				}
			}
			if n := strings.Count(line, "default"); n != want {
				t.Errorf("%q says default %d times, want %d", line, n, want)
			}
			if strings.Contains(line, "required;") != FlagRequired(f) {
				t.Errorf("%q: required is %v", line, FlagRequired(f))
			}
		}
		for _, c := range cmds {
			walk(append(slices.Clone(path), c.Name), c.Flags, c.Subcommands)
		}
	}
	walk(nil, app.Flags, app.Commands)
}

// helpLine is the line of --help text that describes the flag name.
func helpLine(help, name string) string {
	for _, l := range strings.Split(help, "\n") {
		l = strings.TrimSpace(l)
		if rest, ok := strings.CutPrefix(l, "--"+name); ok && (strings.HasPrefix(rest, " ") || strings.HasPrefix(rest, ",")) {
			return l
		}
	}
	return ""
}
