// Package completion holds egressd's shell completion scripts, which
// packaging/deb installs; its test drives them in real shells against the
// real command line.
package completion

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/egressd/egressd/internal/cli"
)

// asEgressdEnv makes a copy of the test binary named egressd behave as
// egressd, so the scripts can run it as they run the real one.
const asEgressdEnv = "EGRESSD_COMPLETION_TEST_MAIN"

func TestMain(m *testing.M) {
	if os.Getenv(asEgressdEnv) != "" {
		os.Exit(cli.Main(os.Args))
	}
	os.Exit(m.Run())
}

// egressdOnPath puts a copy of this test binary, named egressd, first on
// PATH and returns the environment for the shells.
func egressdOnPath(t *testing.T) []string {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	b, err := os.ReadFile(self)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "egressd"), b, 0o755); err != nil {
		t.Fatal(err)
	}
	return append(os.Environ(), "PATH="+dir+":"+os.Getenv("PATH"), asEgressdEnv+"=1")
}

// cases are command lines typed so far (the last word is being completed)
// and candidates the completion must offer.
var cases = []struct {
	line string
	want []string
}{
	{"egressd li", []string{"limit"}},
	{"egressd ", []string{"run", "limit", "doctor", "uninstall"}},
	{"egressd limit ", []string{"set", "get", "ls", "rm"}},
	{"egressd limit set web --sh", []string{"--shadow", "--shared-redis"}},
	{"egressd doctor --b", []string{"--bpffs"}},
	{"egressd policy ch", []string{"check"}},
}

func TestBash(t *testing.T) {
	bash, err := exec.LookPath("bash")
	if err != nil {
		t.Skip("skipping: bash is not installed")
	}
	env := egressdOnPath(t)
	// With bash-completion's helpers loaded, as on a Debian host, and
	// without them, as under a bare bash.
	preludes := map[string]string{"bare": ""}
	if _, err := os.Stat("/usr/share/bash-completion/bash_completion"); err == nil {
		preludes["bash-completion"] = "source /usr/share/bash-completion/bash_completion\n"
	}
	for name, prelude := range preludes {
		for _, tt := range cases {
			t.Run(name+"/"+tt.line, func(t *testing.T) {
				script := prelude + `source ./egressd.bash
COMP_LINE=$1
COMP_POINT=${#COMP_LINE}
read -ra COMP_WORDS <<<"$COMP_LINE"
[[ $COMP_LINE == *" " ]] && COMP_WORDS+=("")
COMP_CWORD=$((${#COMP_WORDS[@]} - 1))
_egressd
printf '%s\n' "${COMPREPLY[@]}"
`
				cmd := exec.Command(bash, "--norc", "--noprofile", "-c", script, "bash", tt.line)
				cmd.Env = env
				got := run(t, cmd)
				for _, w := range tt.want {
					if !slices.Contains(got, w) {
						t.Errorf("%q completes to %q, want %q among them", tt.line, got, w)
					}
				}
			})
		}
	}
}

// TestZsh runs the completion function zsh would autoload from
// vendor-completions, with zsh's _describe and _files replaced by
// functions that print what they are given.
func TestZsh(t *testing.T) {
	zsh, err := exec.LookPath("zsh")
	if err != nil {
		t.Skip("skipping: zsh is not installed (Debian: apt-get install zsh; make deps installs it)")
	}
	env := egressdOnPath(t)
	for _, tt := range cases {
		t.Run(tt.line, func(t *testing.T) {
			script := `_describe() { print -rl -- "${(@P)2}" }
_files() { print -r -- FILES }
words=(${(z)1})
[[ $1 == *" " ]] && words+=("")
CURRENT=${#words}
fpath=(. $fpath)
autoload -Uz _egressd
_egressd
`
			cmd := exec.Command(zsh, "-f", "-c", script, "zsh", tt.line)
			cmd.Env = env
			got := run(t, cmd)
			for _, w := range tt.want {
				if !slices.Contains(got, w) {
					t.Errorf("%q completes to %q, want %q among them", tt.line, got, w)
				}
			}
		})
	}
}

func run(t *testing.T, cmd *exec.Cmd) []string {
	t.Helper()
	out, err := cmd.Output()
	if err != nil {
		var stderr string
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = string(ee.Stderr)
		}
		t.Fatalf("%v: %v\n%s", cmd.Args, err, stderr)
	}
	return strings.Fields(string(out))
}
