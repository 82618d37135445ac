// Package deptest holds the packages that must stay light to their
// dependency budgets: the pure cores (no cilium/ebpf, no Prometheus, no
// loader) and the small helpers the SDK and the daemon share.
package deptest

import (
	"os/exec"
	"slices"
	"strings"
	"testing"
)

const module = "github.com/egressd/egressd/"

// servingDeps are what the in-process limiters and the serving side may
// import besides their own packages: the refusal vocabulary, the adaptive
// controller, and the Redis client with its dependencies.
var servingDeps = []string{
	module + "pkg/adaptive", module + "pkg/verdict", "golang.org/x/sys/",
	"github.com/redis/go-redis/v9", "github.com/cespare/xxhash/", "go.uber.org/atomic",
}

// deps returns, for each package pattern matches, the non-standard
// packages it imports, directly or not.
func deps(t *testing.T, pattern string) map[string][]string {
	t.Helper()
	pkgs := map[string][]string{}
	for _, pkg := range goList(t, module+pattern) {
		pkgs[pkg] = slices.DeleteFunc(goList(t, "-deps", "-f", "{{if not .Standard}}{{.ImportPath}}{{end}}", pkg),
			func(dep string) bool { return dep == pkg })
	}
	return pkgs
}

func goList(t *testing.T, args ...string) []string {
	t.Helper()
	out, err := exec.Command("go", append([]string{"list"}, args...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("go list %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return strings.Fields(string(out))
}

func hasPrefix(s string, prefixes []string) bool {
	return slices.ContainsFunc(prefixes, func(p string) bool { return strings.HasPrefix(s, p) })
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
		{"pkg/edge", nil},
		{"pkg/kernelrule", nil},
		{"pkg/sdk", []string{module + "pkg/verdict", module + "pkg/edge", module + "pkg/control", "golang.org/x/sys/"}},
		{"pkg/limit", []string{module + "pkg/adaptive", module + "pkg/verdict"}},
		{"pkg/control", []string{"golang.org/x/sys/"}},
		{"pkg/sdk/sdkhttp", []string{module + "pkg/sdk", module + "pkg/edge", module + "pkg/limit", module + "pkg/adaptive", module + "pkg/verdict", module + "pkg/control", "golang.org/x/sys/"}},
		// quic-go and what it needs; not its http3 (the caller's choice).
		{"pkg/sdk/sdkquic", []string{module + "pkg/sdk", module + "pkg/edge", module + "pkg/verdict", module + "pkg/control", "github.com/quic-go/quic-go", "golang.org/x/crypto/", "golang.org/x/net/", "golang.org/x/sys/"}},
		// The serving side: Redis through package shared, for shared
		// partitions; no Prometheus (servemetrics has it) and no kernel.
		{"pkg/shared", append([]string{module + "pkg/limit"}, servingDeps...)},
		{"pkg/partition", append([]string{module + "pkg/limit", module + "pkg/shared"}, servingDeps...)},
		{"pkg/serve", append([]string{module + "pkg/partition", module + "pkg/limit", module + "pkg/shared", module + "pkg/edge"}, servingDeps...)},
		{"internal/sdnotify", []string{"golang.org/x/sys/"}},
		{"internal/dns", []string{"golang.org/x/net/dns/dnsmessage"}},
	}
	for _, tt := range tests {
		for pkg, pkgDeps := range deps(t, tt.pkg) {
			for _, dep := range pkgDeps {
				if !hasPrefix(dep, tt.allowed) {
					t.Errorf("%s depends on %s", pkg, dep)
				}
			}
		}
	}
}

// heavy are what an in-process limiter, a policy parser and the serving side
// have no use for: the daemon's control API, the SDK (which brings the control
// API with it), the BPF loader and the eBPF library. A service that only
// limits its own calls must not link them.
var heavy = []string{module + "pkg/control", module + "pkg/sdk", module + "pkg/loader", "github.com/cilium/ebpf"}

// TestLimitersReachNoKernelNorSDK holds the limiters, the policy parser and
// the serving side, subpackages included, away from the heavy packages. An
// exception must be in use: when a package stops reaching it, the test asks
// for it to be removed.
func TestLimitersReachNoKernelNorSDK(t *testing.T) {
	tests := []struct {
		pattern string
		except  []string
	}{
		{"pkg/limit/...", nil},
		{"pkg/shared/...", nil},
		{"pkg/partition/...", nil},
		// policy compiles rules to package kernelrule's types, which the
		// loader shares: parsing a policy links no eBPF.
		{"pkg/policy/...", nil},
		{"pkg/kernelrule/...", nil},
		// serve reads criticality and the caller's time from package edge,
		// which the SDK re-exports: a server links neither the SDK nor the
		// control API.
		{"pkg/serve/...", nil},
		{"pkg/edge/...", nil},
	}
	for _, tt := range tests {
		used := map[string]bool{}
		pkgs := deps(t, tt.pattern)
		if len(pkgs) == 0 {
			t.Fatalf("%s matches no package", tt.pattern)
		}
		for pkg, pkgDeps := range pkgs {
			for _, dep := range pkgDeps {
				if !hasPrefix(dep, heavy) {
					continue
				}
				if i := slices.IndexFunc(tt.except, func(e string) bool { return strings.HasPrefix(dep, e) }); i >= 0 {
					used[tt.except[i]] = true
					continue
				}
				t.Errorf("%s reaches %s", pkg, dep)
			}
		}
		for _, e := range tt.except {
			if !used[e] {
				t.Errorf("%s no longer reaches %s: remove the exception", tt.pattern, e)
			}
		}
	}
}
