package sdnotify

import (
	"os/exec"
	"strings"
	"testing"
)

// The daemon imports this package for four datagrams: it stays the
// standard library and golang.org/x/sys, nothing else.
func TestDependencies(t *testing.T) {
	gobin, err := exec.LookPath("go")
	if err != nil {
		t.Skipf("go command not found: %v", err)
	}
	out, err := exec.Command(gobin, "list", "-deps", "-f", "{{if not .Standard}}{{.ImportPath}}{{end}}", ".").Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	for _, pkg := range strings.Fields(string(out)) {
		if pkg != "github.com/egressd/egressd/internal/sdnotify" && !strings.HasPrefix(pkg, "golang.org/x/sys/") {
			t.Errorf("internal/sdnotify depends on %s", pkg)
		}
	}
}
