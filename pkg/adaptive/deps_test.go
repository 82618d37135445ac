package adaptive_test

import (
	"os/exec"
	"strings"
	"testing"
)

// TestStandardLibraryOnly keeps the package pure: no cilium/ebpf, no
// Prometheus, nothing from the rest of the tree, so that the SDK can use it
// and its rules can be table-tested anywhere.
func TestStandardLibraryOnly(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", "-f", "{{if not .Standard}}{{.ImportPath}}{{end}}", ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	if got := strings.Fields(string(out)); len(got) != 1 || got[0] != "github.com/egressd/egressd/pkg/adaptive" {
		t.Fatalf("non-standard dependencies: %q", got)
	}
}
