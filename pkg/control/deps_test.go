package control

import (
	"os/exec"
	"strings"
	"testing"
)

// The CLI and the SDK's kernel attribution import this package, so it stays
// small: the standard library and golang.org/x/sys, nothing else.
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
		if pkg != "github.com/egressd/egressd/pkg/control" && !strings.HasPrefix(pkg, "golang.org/x/sys/") {
			t.Errorf("pkg/control depends on %s", pkg)
		}
	}
}
