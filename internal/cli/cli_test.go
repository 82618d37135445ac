package cli

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/egressd/egressd/internal/controlserver"
	"github.com/egressd/egressd/pkg/control"
	"github.com/urfave/cli/v2"
)

// fakeDaemon serves the limits route on a control socket of the test's
// own: every limit, whatever the query, which it keeps in asked.
func fakeDaemon(t *testing.T, limits []control.Limit) (sock string, asked *[]control.LimitsQuery) {
	t.Helper()
	asked = new([]control.LimitsQuery)
	var mu sync.Mutex
	return serveRoutes(t, map[string]controlserver.Route{
		control.RouteLimits: {Method: http.MethodGet, Stream: true, Handler: func(w http.ResponseWriter, r *http.Request) error {
			q, err := control.ParseLimitsQuery(r.URL.Query())
			if err != nil {
				return err
			}
			mu.Lock()
			*asked = append(*asked, q)
			mu.Unlock()
			sw, err := controlserver.NewStreamWriter(w)
			if err != nil {
				return err
			}
			for _, l := range limits {
				if err := sw.Queue(l); err != nil {
					return err
				}
			}
			return sw.Flush()
		}},
	}), asked
}

// serveRoutes serves routes on a control socket of the test's own until
// the test ends, and returns the socket's path.
func serveRoutes(t *testing.T, routes map[string]controlserver.Route) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "sock")
	srv, err := controlserver.New(controlserver.Config{Socket: sock, Routes: routes})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := srv.Listen()
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { srv.Serve(ln); close(done) }()
	t.Cleanup(func() { srv.Close(); <-done })
	return sock
}

// TestTopCountStopsAfterLastRefresh: `top --count N` prints N tables and
// exits, without sleeping one more interval after the last.
func TestTopCountStopsAfterLastRefresh(t *testing.T) {
	sock, _ := fakeDaemon(t, []control.Limit{{Name: "web", Shape: "concurrency", Limit: 2, Live: 1}})
	app := App()
	var out bytes.Buffer
	app.Writer = &out
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	start := time.Now()
	err := app.RunContext(ctx, []string{"egressd", "--socket", sock, "--json", "top", "--count", "1", "--interval", "1m"})
	elapsed := time.Since(start)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), `"name": "web"`) {
		t.Errorf("top printed:\n%s", out.String())
	}
	if elapsed > time.Second {
		t.Errorf("top --count 1 --interval 1m took %v: it waits an interval after its last refresh", elapsed.Round(time.Millisecond))
	}
}

// TestTopText: top marks a pending rule (no limit, rather than 0) and a
// shadow one, as limit ls does, and writes no clear-screen codes where its
// output is not a terminal.
func TestTopText(t *testing.T) {
	sock, asked := fakeDaemon(t, []control.Limit{
		{Name: "web", Shape: "concurrency", Limit: 2, Live: 1},
		{Name: "later", Shape: "concurrency", Pending: "unit web.service is not running"},
		{Name: "trial", Shape: "per_second", Limit: 5, Shadow: true},
	})
	code, out, errOut := runCLI("--socket", sock, "top", "--count", "2", "--interval", "10ms")
	if code != 0 {
		t.Fatalf("top: status %d: %s", code, errOut)
	}
	if strings.Contains(out, "\033") {
		t.Errorf("top into a buffer wrote escape codes: %q", out)
	}
	if n := strings.Count(out, "egressd top — "); n != 2 {
		t.Errorf("top --count 2 printed %d tables:\n%s", n, out)
	}
	want := map[string]string{ // a row's LIMIT and STATE
		"web":   "2 installed",
		"later": "- pending: unit web.service is not running",
		"trial": "5 shadow",
	}
	rows := 0
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) == 0 || want[f[0]] == "" {
			continue
		}
		rows++
		if got := f[2] + " " + strings.Join(f[min(9, len(f)):], " "); got != want[f[0]] {
			t.Errorf("%s: LIMIT and STATE %q, want %q\n%s", f[0], got, want[f[0]], line)
		}
	}
	if rows != 2*len(want) {
		t.Errorf("%d rows, want %d:\n%s", rows, 2*len(want), out)
	}
	// Each refresh asks for the busiest rows.
	busiest := control.LimitsQuery{Sort: control.SortBusy, Max: topDefaultRows}
	if len(*asked) != 2 || (*asked)[0] != busiest || (*asked)[1] != busiest {
		t.Errorf("top asked %+v, want %+v twice", *asked, busiest)
	}
}

// TestIsTerminal: top redraws in place on a terminal (a pty here), and
// only there.
func TestIsTerminal(t *testing.T) {
	pty, err := os.OpenFile("/dev/ptmx", os.O_RDWR, 0)
	if err != nil {
		t.Skipf("no pty to test with: %v", err)
	}
	t.Cleanup(func() { pty.Close() })
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close(); w.Close() })
	if !isTerminal(pty) || isTerminal(w) || isTerminal(&bytes.Buffer{}) {
		t.Errorf("isTerminal: pty %v, pipe %v, buffer %v; want true, false, false", isTerminal(pty), isTerminal(w), isTerminal(&bytes.Buffer{}))
	}
}

func TestSplitLines(t *testing.T) {
	for _, c := range []struct {
		in   string
		want []string
	}{
		{"", nil},
		{"a", []string{"a"}},
		{"a\nb\n", []string{"a", "b"}},
		{"a\n\nb", []string{"a", "b"}},
	} {
		if got := splitLines(c.in); !slices.Equal(got, c.want) {
			t.Errorf("splitLines(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}

// TestRunRefusesFlags: a socket mode that is not permission bits, or none
// (which would silently become 0660), --max-rules 0 (which would
// silently be the default, as the policy's maxRules: 0 is not), a cgroup
// layout the kubelet does not have, and Kubernetes settings without
// --kube-node stop egressd run before it starts.
func TestRunRefusesFlags(t *testing.T) {
	for _, args := range [][]string{
		{"--socket-mode", "0"}, {"--socket-mode", "0000"}, {"--socket-mode", "1777"}, {"--socket-mode", "rw"},
		{"--max-rules", "0"},
		{"--kube-cgroup-driver", "docker", "--kube-node", "n"}, {"--kube-cgroup-root", "/a/../b", "--kube-node", "n"},
		{"--kubeconfig", "/etc/kubeconfig"}, {"--kube-cgroup-root", "/kubelet.slice"},
	} {
		app := App()
		app.ExitErrHandler = func(*cli.Context, error) {} // the default exits
		dir := t.TempDir()
		// Were the flag taken, the daemon would stop at once: no cgroup
		// to attach to, no policy file.
		run := []string{"egressd", "--socket", filepath.Join(dir, "sock"), "run", "--policy", filepath.Join(dir, "none.yaml"),
			"--cgroup", filepath.Join(dir, "none"), "--bpffs", filepath.Join(dir, "bpffs"), "--state-dir", dir, "--metrics", ""}
		err := app.Run(append(run, args...))
		if err == nil || !strings.Contains(err.Error(), args[0]+" ") {
			t.Errorf("%s: %v, want it refused", args, err)
		}
	}
}

// runCLI runs the command line as Main does, with its output kept.
func runCLI(args ...string) (code int, stdout, stderr string) {
	app := App()
	var out, errOut bytes.Buffer
	app.Writer, app.ErrWriter = &out, &errOut
	code = run(app, append([]string{"egressd"}, args...))
	return code, out.String(), errOut.String()
}

// TestUnknownCommand: a word that names no command is a usage error,
// status 2, never 3: that is egressd run's status after an uninstall,
// which supervisors take as "do not restart". A command alone still
// prints its help.
func TestUnknownCommand(t *testing.T) {
	for _, tt := range []struct {
		args    string
		code    int
		stderr  string
		printed string
	}{
		{"bogus", exitUsage, `egressd: unknown command "bogus" (see egressd --help)` + "\n", ""},
		{"--json bogus x", exitUsage, `egressd: unknown command "bogus" (see egressd --help)` + "\n", ""},
		{"limit bogus", exitUsage, `egressd: unknown command "limit bogus" (see egressd limit --help)` + "\n", ""},
		{"policy bogus --help", exitUsage, `egressd: unknown command "policy bogus" (see egressd policy --help)` + "\n", ""},
		{"", 0, "", "COMMANDS:"},
		{"limit", 0, "", "COMMANDS:"},
	} {
		code, out, errOut := runCLI(strings.Fields(tt.args)...)
		if code != tt.code || errOut != tt.stderr || !strings.Contains(out, tt.printed) {
			t.Errorf("egressd %s: status %d, stderr %q, stdout:\n%s\nwant status %d, stderr %q, stdout with %q",
				tt.args, code, errOut, out, tt.code, tt.stderr, tt.printed)
		}
	}
}

// TestBadFlag: a flag egressd does not take, or a value it cannot parse,
// is a usage error (status 2, one line naming the command), not status 1
// after the whole help; a global option after the command says where it
// goes.
func TestBadFlag(t *testing.T) {
	for _, tt := range []struct{ args, stderr string }{
		{"--bogus", "egressd: flag provided but not defined: --bogus (see egressd --help)\n"},
		{"--timeout abc status", `egressd: invalid value "abc" for flag --timeout: parse error (see egressd --help)` + "\n"},
		{"limit ls --bogus", "egressd: limit ls: flag provided but not defined: --bogus (see egressd limit ls --help)\n"},
		{"limit set x --dest 10.0.0.1 --concurrency abc",
			`egressd: limit set: invalid value "abc" for flag --concurrency: parse error (see egressd limit set --help)` + "\n"},
		{"status --timeout 5s", "egressd: status: --timeout is a global option: put it before the command (egressd --timeout … status)\n"},
		{"limit rm x y", "egressd: limit rm: want one NAME, got 2 arguments\n"},
		{"limit rm --socket /s x", "egressd: limit rm: --socket is a global option: put it before the command (egressd --socket … limit rm)\n"},
	} {
		code, out, errOut := runCLI(strings.Fields(tt.args)...)
		if code != exitUsage || errOut != tt.stderr || out != "" {
			t.Errorf("egressd %s: status %d, stderr %q, stdout %q; want status %d, stderr %q, no stdout",
				tt.args, code, errOut, out, exitUsage, tt.stderr)
		}
	}
}

func TestCommandLine(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		// help as a command is --help.
		{"egressd help", "egressd --help"},
		{"egressd help limit", "egressd limit --help"},
		{"egressd help policy check", "egressd policy check --help"},
		{"egressd h limit set", "egressd limit set --help"},
		{"egressd limit help set", "egressd limit set --help"},
		{"egressd --socket help --json help limit", "egressd --socket help --json limit --help"},
		{"egressd --socket=/s help limit", "egressd --socket=/s limit --help"},
		{"egressd help limit get web", "egressd limit get --help"},
		{"egressd limit set web --dest x --help", "egressd limit set --help"},
		{"egressd limit get -- --help", "egressd limit get -- --help"},
		{"egressd limit get help", "egressd limit get help"},
		{"egressd bogus help", "egressd bogus help"},
		{"egressd -- help", "egressd -- help"},
		{"egressd help limit --generate-bash-completion", "egressd help limit --generate-bash-completion"},
		// A command's flags go before its arguments, with their values.
		{"egressd limit set web --dest 10.0.0.1 --concurrency 2", "egressd limit set --dest 10.0.0.1 --concurrency 2 web"},
		{"egressd --socket /s --json limit set web --dest x", "egressd --socket /s --json limit set --dest x web"},
		{"egressd limit set help --dest x", "egressd limit set --dest x help"},
		{"egressd limit set --dest x web", "egressd limit set --dest x web"},
		{"egressd limit set web", "egressd limit set web"},
		{"egressd limit set", "egressd limit set"},
		{"egressd limit get web --json", "egressd limit get --json web"},
		{"egressd limit set web --shadow --dest=x --probe-every -1", "egressd limit set --shadow --dest=x --probe-every -1 web"},
		{"egressd policy check a --json b", "egressd policy check --json a b"},
		{"egressd limit rm x --socket /s", "egressd limit rm --socket x /s"},
		{"egressd events -f", "egressd events -f"},
		{"egressd limit set web --dest", "egressd limit set --dest web"},
		{"egressd limit rm - x", "egressd limit rm - x"},
		// "--" ends the flags.
		{"egressd limit rm a --json -- -b --json", "egressd limit rm --json -- a -b --json"},
		{"egressd limit rm -- -b", "egressd limit rm -- -b"},
		{"egressd limit set web --sh --generate-bash-completion", "egressd limit set web --sh --generate-bash-completion"},
	} {
		if got := strings.Join(commandLine(App(), strings.Fields(c.in)), " "); got != c.want {
			t.Errorf("commandLine(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}

// TestFlagsAnywhere: every command takes each of its flags before its
// arguments, after them or between them, and takes what follows "--" as
// arguments, flags or not; the app takes its own flags before the
// command. The commands are those App defines, each run with its action
// replaced by one that records what it was given.
func TestFlagsAnywhere(t *testing.T) {
	type given struct {
		args  []string
		value string // the flag's, as its command read it
		set   bool
	}
	// runAs runs the command at path with args after it, and returns
	// what its action was given of flag.
	runAs := func(path []string, before, args []string, flag string) (given, error) {
		app := App()
		cmds, c := app.Commands, (*cli.Command)(nil)
		for _, name := range path {
			c = cmds[slices.IndexFunc(cmds, func(c *cli.Command) bool { return c.Name == name })]
			cmds = c.Subcommands
		}
		var got given
		c.Action = func(ctx *cli.Context) error {
			got = given{ctx.Args().Slice(), fmt.Sprint(ctx.Value(flag)), ctx.IsSet(flag)}
			return nil
		}
		var out, errOut bytes.Buffer
		app.Writer, app.ErrWriter = &out, &errOut
		if code := run(app, slices.Concat([]string{"egressd"}, before, path, args)); code != 0 {
			return got, fmt.Errorf("status %d: %s", code, errOut.String())
		}
		return got, nil
	}
	// sample is a value of f's type, written and as read.
	sample := func(f cli.Flag) (value []string, read string) {
		switch f.(type) {
		case *cli.BoolFlag:
			return nil, "true"
		case *cli.StringFlag:
			return []string{"v"}, "v"
		case *cli.IntFlag:
			return []string{"-7"}, "-7"
		case *cli.Float64Flag:
			return []string{"1.5"}, "1.5"
		case *cli.DurationFlag:
			return []string{"3s"}, "3s"
		}
		t.Fatalf("no sample value for a flag of type %T; add one", f)
		return nil, ""
	}
	leaves := 0
	var walk func(path []string, cmds []*cli.Command)
	walk = func(path []string, cmds []*cli.Command) {
		for _, c := range cmds {
			p := append(slices.Clone(path), c.Name)
			if len(c.Subcommands) > 0 {
				walk(p, c.Subcommands)
				continue
			}
			leaves++
			var required []string // given before the arguments in every run
			for _, f := range c.Flags {
				if value, _ := sample(f); FlagRequired(f) {
					required = append(append(required, "--"+f.Names()[0]), value...)
				}
			}
			for _, f := range c.Flags {
				name := f.Names()[0]
				value, read := sample(f)
				spelt := append([]string{"--" + name}, value...)
				for _, args := range [][]string{
					slices.Concat(spelt, required, []string{"a1", "a2"}),
					slices.Concat(required, []string{"a1", "a2"}, spelt),
					slices.Concat(required, []string{"a1"}, spelt, []string{"a2"}),
				} {
					got, err := runAs(p, nil, args, name)
					if err != nil || !slices.Equal(got.args, []string{"a1", "a2"}) || !got.set || got.value != read {
						t.Errorf("egressd %s %s: %v; given arguments %q, --%s %q (set: %v); want [a1 a2], %q",
							strings.Join(p, " "), strings.Join(args, " "), err, got.args, name, got.value, got.set, read)
					}
				}
				args := slices.Concat(required, []string{"a1", "--"}, spelt)
				got, err := runAs(p, nil, args, name)
				if want := append([]string{"a1"}, spelt...); err != nil || !slices.Equal(got.args, want) || got.set && !FlagRequired(f) {
					t.Errorf("egressd %s %s: %v; given arguments %q, --%s set: %v; want %q, not set",
						strings.Join(p, " "), strings.Join(args, " "), err, got.args, name, got.set, want)
				}
			}
		}
	}
	walk(nil, App().Commands)
	if leaves < 10 {
		t.Fatalf("only %d commands found", leaves)
	}
	for _, f := range App().Flags {
		name := f.Names()[0]
		value, read := sample(f)
		before := append([]string{"--" + name}, value...)
		if got, err := runAs([]string{"version"}, before, []string{"a1"}, name); err != nil || !got.set || got.value != read {
			t.Errorf("egressd %s version a1: %v; --%s %q (set: %v), want %q", strings.Join(before, " "), err, name, got.value, got.set, read)
		}
	}
}

// TestHelpCommand: `egressd help CMD [SUB]` prints what `egressd CMD [SUB]
// --help` does, as docs/cli.md says: a command's subcommands among it.
func TestHelpCommand(t *testing.T) {
	var walk func(path []string, cmds []*cli.Command)
	walk = func(path []string, cmds []*cli.Command) {
		for _, c := range cmds {
			p := append(slices.Clone(path), c.Name)
			code, got, _ := runCLI(append([]string{"help"}, p...)...)
			_, want, _ := runCLI(append(p, "--help")...)
			if code != 0 || got != want {
				t.Errorf("egressd help %s: status %d, printed:\n%s\nwant what --help prints:\n%s", strings.Join(p, " "), code, got, want)
			}
			if len(c.Subcommands) > 0 && !strings.Contains(got, "COMMANDS:") {
				t.Errorf("egressd help %s does not list its commands:\n%s", strings.Join(p, " "), got)
			}
			// Help takes no arguments, wherever --help is.
			for _, args := range [][]string{{"a1", "--help"}, {"--help", "a1"}, {"a1", "-h", "a2"}} {
				if code, got, _ := runCLI(slices.Concat(p, args)...); len(c.Subcommands) == 0 && (code != 0 || got != want) {
					t.Errorf("egressd %s %s: status %d, printed:\n%s\nwant what --help prints", strings.Join(p, " "), strings.Join(args, " "), code, got)
				}
			}
			walk(p, c.Subcommands)
		}
	}
	walk(nil, App().Commands)
	for _, args := range []string{"help bogus", "limit help bogus"} {
		if code, _, errOut := runCLI(strings.Fields(args)...); code != exitUsage || !strings.Contains(errOut, "unknown command") {
			t.Errorf("egressd %s: status %d, %q; want an unknown command, status %d", args, code, errOut, exitUsage)
		}
	}
}

// TestVersionFlag: --version and -v print what the version command does.
func TestVersionFlag(t *testing.T) {
	_, want, _ := runCLI("version")
	if !strings.HasPrefix(want, "egressd "+Version+" (go") {
		t.Fatalf("egressd version printed %q", want)
	}
	for _, flag := range []string{"--version", "-v"} {
		if code, got, _ := runCLI(flag); code != 0 || got != want {
			t.Errorf("egressd %s: status %d, printed %q; want %q", flag, code, got, want)
		}
	}
}
