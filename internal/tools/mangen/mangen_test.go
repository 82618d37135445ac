package main

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/urfave/cli/v2"

	egressdcli "github.com/egressd/egressd/internal/cli"
)

// TestEveryCommandHasAPage: a page per command and subcommand, each with
// all of its flags, so a new command or flag cannot go undocumented.
func TestEveryCommandHasAPage(t *testing.T) {
	app := egressdcli.App()
	byName := map[string]string{}
	for _, p := range pages(app, "2025-01-01", "test") {
		byName[p.name] = string(p.text)
	}
	if _, ok := byName["egressd"]; !ok {
		t.Fatal("no egressd page")
	}
	for _, f := range app.Flags {
		if !strings.Contains(byName["egressd"], `\fB\-\-`+strings.ReplaceAll(f.Names()[0], "-", `\-`)+`\fR`) {
			t.Errorf("egressd(1) lacks global flag --%s", f.Names()[0])
		}
	}
	var walk func(path string, cmds []*cli.Command)
	walk = func(path string, cmds []*cli.Command) {
		for _, c := range cmds {
			name := path + "-" + c.Name
			text, ok := byName[name]
			if !ok {
				t.Errorf("no page for %s", name)
				continue
			}
			if !strings.Contains(text, ".SH NAME\n"+strings.ReplaceAll(name, "-", `\-`)+` \- `) {
				t.Errorf("%s: NAME section does not name it", name)
			}
			for _, f := range c.Flags {
				if !strings.Contains(text, `\fB\-\-`+strings.ReplaceAll(f.Names()[0], "-", `\-`)+`\fR`) {
					t.Errorf("%s lacks flag --%s", name, f.Names()[0])
				}
			}
			if !strings.Contains(byName[strings.TrimSuffix(name, "-"+c.Name)], `.BR `+strings.ReplaceAll(name, "-", `\-`)+` (1)`) {
				t.Errorf("the parent page does not point at %s", name)
			}
			walk(name, c.Subcommands)
		}
	}
	walk("egressd", app.Commands)
}

func TestPagesDeterministic(t *testing.T) {
	a, b := pages(egressdcli.App(), "2025-01-01", "v"), pages(egressdcli.App(), "2025-01-01", "v")
	for i := range a {
		if a[i].name != b[i].name || !bytes.Equal(a[i].text, b[i].text) {
			t.Fatalf("page %s renders differently twice", a[i].name)
		}
	}
}

// TestPagesFormatCleanly formats every page as lintian does and fails on
// any warning the formatter prints.
func TestPagesFormatCleanly(t *testing.T) {
	man, err := exec.LookPath("man")
	if err != nil {
		t.Skip("skipping: man is not installed (Debian: man-db)")
	}
	dir := t.TempDir()
	if err := write(dir, "2025-01-01", "test"); err != nil {
		t.Fatal(err)
	}
	files, err := filepath.Glob(filepath.Join(dir, "*.1"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no pages written: %v", err)
	}
	for _, f := range files {
		cmd := exec.Command(man, "--warnings", "-E", "UTF-8", "-l", "-Tutf8", "-Z", f)
		cmd.Env = append(os.Environ(), "LC_ALL=C.UTF-8", "MANROFFSEQ=", "MANWIDTH=80")
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		if err := cmd.Run(); err != nil || stderr.Len() > 0 {
			t.Errorf("%s: %v\n%s", filepath.Base(f), err, stderr.String())
		}
	}
}

func TestEscape(t *testing.T) {
	for _, tt := range []struct{ in, want string }{
		{`a\b`, `a\eb`},
		{".starts with a dot", `\&.starts with a dot`},
		{"line\n'quote", "line\n\\&'quote"},
		{"plain - text", "plain - text"},
	} {
		if got := escape(tt.in); got != tt.want {
			t.Errorf("escape(%q) = %q, want %q", tt.in, got, tt.want)
		}
	}
}

// TestRequiredFlag: a page marks a flag its command requires, as
// docs/cli.md and --help do.
func TestRequiredFlag(t *testing.T) {
	for _, p := range pages(egressdcli.App(), "2025-01-01", "test") {
		if p.name == "egressd-limit-set" && !strings.Contains(string(p.text), "\\fB\\-\\-dest\\fR \\fIVALUE\\fR\nrequired; ") {
			t.Errorf("egressd-limit-set(1) does not mark --dest required:\n%s", p.text)
		}
	}
}
