// Package deptest holds the packages that must stay light to their
// dependency budgets: the pure cores (no cilium/ebpf, no Prometheus, no
// loader) and the small helpers the SDK and the daemon share.
package deptest

import (
	"os/exec"
	"strings"
	"testing"
)

const module = "github.com/egressd/egressd/"

// servingDeps are what the serving side may import besides its own
// packages: the SDK core, and the Redis client with its dependencies.
var servingDeps = []string{
	module + "pkg/sdk", module + "pkg/adaptive", module + "pkg/verdict", module + "pkg/control", "golang.org/x/sys/",
	"github.com/redis/go-redis/v9", "github.com/cespare/xxhash/", "go.uber.org/atomic",
}

func TestDependencies(t *testing.T) {
	tests := []struct {
		pkg string
		// allowed are the non-standard packages (prefixes) it may import,
		// directly or not, besides itself.
		allowed []string
	}{
		{"pkg/adaptive", nil},
		{"pkg/verdict", nil},
		{"pkg/sdk", []string{module + "pkg/verdict", module + "pkg/control", "golang.org/x/sys/"}},
		{"pkg/limit", []string{module + "pkg/adaptive", module + "pkg/sdk", module + "pkg/verdict", module + "pkg/control", "golang.org/x/sys/"}},
		{"pkg/control", []string{"golang.org/x/sys/"}},
		{"pkg/sdk/sdkhttp", []string{module + "pkg/sdk", module + "pkg/limit", module + "pkg/adaptive", module + "pkg/verdict", module + "pkg/control", "golang.org/x/sys/"}},
		// The serving side: Redis through package shared, for shared
		// partitions; no Prometheus (servemetrics has it) and no kernel.
		{"pkg/partition", append([]string{module + "pkg/limit", module + "pkg/shared"}, servingDeps...)},
		{"pkg/serve", append([]string{module + "pkg/partition", module + "pkg/limit", module + "pkg/shared"}, servingDeps...)},
		{"internal/sdnotify", []string{"golang.org/x/sys/"}},
		{"internal/dns", nil},
	}
	for _, tt := range tests {
		out, err := exec.Command("go", "list", "-deps", "-f", "{{if not .Standard}}{{.ImportPath}}{{end}}", module+tt.pkg).CombinedOutput()
		if err != nil {
			t.Fatalf("go list %s: %v\n%s", tt.pkg, err, out)
		}
		for _, dep := range strings.Fields(string(out)) {
			ok := dep == module+tt.pkg
			for _, a := range tt.allowed {
				ok = ok || dep == a || strings.HasPrefix(dep, a)
			}
			if !ok {
				t.Errorf("%s depends on %s", tt.pkg, dep)
			}
		}
	}
}
