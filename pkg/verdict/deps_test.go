package verdict

import (
	"os/exec"
	"strings"
	"testing"
)

// The verdict is part of the pure core: it may reach the standard library and
// nothing else - no kernel package, no loader, no third-party module.
func TestDependsOnStandardLibraryOnly(t *testing.T) {
	gobin, err := exec.LookPath("go")
	if err != nil {
		t.Skipf("go command not found: %v", err)
	}
	out, err := exec.Command(gobin, "list", "-deps", "-f", "{{if not .Standard}}{{.ImportPath}}{{end}}", ".").Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	for _, pkg := range strings.Fields(string(out)) {
		if pkg != "github.com/egressd/egressd/pkg/verdict" {
			t.Errorf("pkg/verdict depends on %s", pkg)
		}
	}
}
