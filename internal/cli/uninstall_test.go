package cli

import (
	"bytes"
	"os"
	"strings"
	"testing"

	"github.com/urfave/cli/v2"

	"github.com/egressd/egressd/internal/privtest"
	"github.com/egressd/egressd/pkg/loader"
)

// uninstall runs `egressd uninstall --bpffs pins` with no daemon to ask.
func uninstall(t *testing.T, pins string) (string, error) {
	t.Helper()
	app := App()
	var out bytes.Buffer
	app.Writer = &out
	app.ExitErrHandler = func(*cli.Context, error) {}
	err := app.Run([]string{"egressd", "--socket", absentSocket, "uninstall", "--bpffs", pins})
	return out.String(), err
}

// TestUninstallNothingPinned: with no daemon and nothing pinned at
// --bpffs (a typo, a directory off bpffs, a second uninstall) uninstall
// fails saying so, rather than reporting that enforcement ended.
func TestUninstallNothingPinned(t *testing.T) {
	privtest.RequireRoot(t)
	cg := privtest.Cgroup(t, "uninstall")
	pins := privtest.PinDir(t)
	d, err := loader.Open(&loader.Config{Cgroup: cg, PinDir: pins, MaxRules: 16})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	out, err := uninstall(t, pins)
	if err != nil || out != "removed the datapath pinned at "+pins+"\n" {
		t.Fatalf("uninstall of a pinned datapath: %v, printed %q", err, out)
	}

	offBPFFS := t.TempDir()
	for _, dir := range []string{pins, pins + "-typo", offBPFFS} {
		out, err := uninstall(t, dir)
		if err == nil || !strings.Contains(err.Error(), "nothing pinned at "+dir) || out != "" {
			t.Errorf("uninstall --bpffs %s: %v, printed %q; want it refused, saying nothing is pinned there", dir, err, out)
		}
	}
	if _, err := os.Stat(offBPFFS); err != nil {
		t.Errorf("uninstall removed a directory off bpffs: %v", err)
	}
}
