// Package deptest holds the packages that must stay light to their
// dependency budgets: the pure cores (no cilium/ebpf, no Prometheus, no
// loader), the small helpers the SDK and the daemon share, and the clients
// (the SDK, the control API's client) apart from the servers.
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

// grpcDeps are gRPC and what it needs, for the gRPC client and server.
var grpcDeps = []string{
	"google.golang.org/grpc", "google.golang.org/protobuf/", "google.golang.org/genproto/",
	"golang.org/x/net/", "golang.org/x/text/", "golang.org/x/sys/",
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
		{"pkg/sdk", []string{module + "pkg/verdict", module + "pkg/edge", module + "pkg/control"}},
		{"pkg/limit", []string{module + "pkg/adaptive", module + "pkg/verdict"}},
		// The client and the wire types; the server is controlserver's.
		{"pkg/control", nil},
		{"pkg/sdk/sdkhttp", []string{module + "pkg/sdk", module + "pkg/edge", module + "pkg/limit", module + "pkg/adaptive", module + "pkg/verdict", module + "pkg/control"}},
		{"pkg/sdk/sdkgrpc", append([]string{module + "pkg/sdk", module + "pkg/edge", module + "pkg/verdict", module + "pkg/control"}, grpcDeps...)},
		// quic-go and what it needs; not its http3 (the caller's choice).
		{"pkg/sdk/sdkquic", []string{module + "pkg/sdk", module + "pkg/edge", module + "pkg/verdict", module + "pkg/control", "github.com/quic-go/quic-go", "golang.org/x/crypto/", "golang.org/x/net/", "golang.org/x/sys/"}},
		// The serving side: Redis through package shared, for shared
		// partitions; no Prometheus (servemetrics has it) and no kernel.
		{"pkg/shared", append([]string{module + "pkg/limit", module + "pkg/shared/redisurl"}, servingDeps...)},
		{"pkg/partition", append([]string{module + "pkg/limit", module + "pkg/shared"}, servingDeps...)},
		{"pkg/serve", append([]string{module + "pkg/partition", module + "pkg/limit", module + "pkg/shared", module + "pkg/edge"}, servingDeps...)},
		{"pkg/serve/servegrpc", append(append([]string{module + "pkg/serve", module + "pkg/partition", module + "pkg/limit", module + "pkg/shared", module + "pkg/edge"}, servingDeps...), grpcDeps...)},
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
// API's client with it), the BPF loader and the eBPF library. A service that
// only limits its own calls must not link them.
var heavy = []string{module + "pkg/control", module + "internal/controlserver", module + "pkg/sdk", module + "pkg/loader", "github.com/cilium/ebpf"}

// servers are what a client has no use for: the serving side (limiters per
// caller, Redis budgets, the gRPC server interceptors), the Redis client
// it brings, and the control API's server. A service that calls others
// through the SDK must not link them.
var servers = []string{
	module + "pkg/serve", module + "pkg/partition", module + "pkg/shared",
	"github.com/redis/go-redis/", module + "internal/controlserver",
}

// TestReachesNone holds packages, subpackages included, away from what
// their users have no use for.
func TestReachesNone(t *testing.T) {
	tests := []struct {
		pattern   string
		forbidden []string
	}{
		{"pkg/limit/...", heavy},
		{"pkg/shared/...", heavy},
		{"pkg/partition/...", heavy},
		// policy compiles rules to package kernelrule's types, which the
		// loader shares: parsing a policy links no eBPF. It checks Redis
		// URLs with redisurl: it opens no Redis client either.
		{"pkg/policy/...", append([]string{"github.com/redis/go-redis/"}, heavy...)},
		{"pkg/kernelrule/...", heavy},
		// The daemon's share decisions are pure: they read package
		// shared's types (Redis comes with them) and link no kernel.
		{"internal/daemon/decide/...", heavy},
		// serve reads criticality and the caller's time from package edge,
		// which the SDK re-exports: a server, gRPC's included, links
		// neither the SDK nor the control API. It may link Redis.
		{"pkg/serve/...", heavy},
		{"pkg/edge/...", heavy},
		// The SDK, sdkgrpc and the other clients among them, links neither
		// the serving side nor Redis nor the control API's server: only
		// package control's client.
		{"pkg/sdk/...", servers},
		{"pkg/control/...", servers},
	}
	for _, tt := range tests {
		pkgs := deps(t, tt.pattern)
		if len(pkgs) == 0 {
			t.Fatalf("%s matches no package", tt.pattern)
		}
		for pkg, pkgDeps := range pkgs {
			for _, dep := range pkgDeps {
				if hasPrefix(dep, tt.forbidden) {
					t.Errorf("%s reaches %s", pkg, dep)
				}
			}
		}
	}
}
