package sdk

import (
	"os/exec"
	"strings"
	"testing"
)

// The retry core is pure: the standard library and pkg/verdict, nothing
// else - no kernel package, no loader, no third-party module. Kernel
// attribution reaches it through an Attributor, never an import.
func TestDependsOnStandardLibraryOnly(t *testing.T) {
	gobin, err := exec.LookPath("go")
	if err != nil {
		t.Skipf("go command not found: %v", err)
	}
	out, err := exec.Command(gobin, "list", "-deps", "-f", "{{if not .Standard}}{{.ImportPath}}{{end}}", ".").Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	allowed := map[string]bool{
		"github.com/egressd/egressd/pkg/sdk":     true,
		"github.com/egressd/egressd/pkg/verdict": true,
	}
	for _, pkg := range strings.Fields(string(out)) {
		if !allowed[pkg] {
			t.Errorf("pkg/sdk depends on %s", pkg)
		}
	}
}
