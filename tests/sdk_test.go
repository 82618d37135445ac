package tests

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strconv"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	gbackoff "google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/egressd/egressd/internal/privtest"
	"github.com/egressd/egressd/pkg/control"
	"github.com/egressd/egressd/pkg/loader"
	"github.com/egressd/egressd/pkg/sdk"
	"github.com/egressd/egressd/pkg/sdk/sdkgrpc"
	"github.com/egressd/egressd/pkg/verdict"
)

// TestSDKSeesKernelRefusalsAsSelfImposed runs the SDK's executor in a
// process the daemon limits: its EPERMs are attributed to the rule and
// become self-imposed refusals, which spend no retry budget and leave the
// breaker closed; an EPERM from something else stays Permanent.
func TestSDKSeesKernelRefusalsAsSelfImposed(t *testing.T) {
	e := newEnv(t)
	port, firewalled := listen(t), listen(t)
	e.writePolicy(t, policyRule("web", port, 1))
	e.start(t)

	// Another BPF program on a child cgroup stands in for a firewall: it
	// refuses with EPERM too, and the daemon never hears of it.
	child := privtest.SubCgroup(t, e.cg, "app")
	fw, err := loader.Open(&loader.Config{Cgroup: child, PinDir: privtest.PinDir(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { fw.Uninstall() })
	if err := fw.Put(loader.Rule{Name: "firewall", Dests: []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}, Port: uint16(firewalled), Limit: 1}); err != nil {
		t.Fatal(err)
	}
	privtest.Join(t, child)

	dial := func(port int) func(ctx context.Context) (net.Conn, error) {
		return func(ctx context.Context) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "tcp", "127.0.0.1:"+strconv.Itoa(port))
		}
	}
	hold := func(port int) {
		c, err := dial(port)(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
	}
	hold(port)       // the daemon's limit of 1 is now full
	hold(firewalled) // and so is the "firewall"'s

	budget := sdk.NewRetryBudget(0.1, 10)
	breaker := sdk.NewBreaker(sdk.BreakerOptions{})
	policy := &sdk.Policy{
		MaxAttempts: 3,
		Backoff:     sdk.Backoff{Throttled: sdk.Curve{Initial: 5 * time.Millisecond, Multiplier: 1}, Transient: sdk.Curve{Initial: 5 * time.Millisecond, Multiplier: 1}, MaxDelay: 20 * time.Millisecond},
		Classifier:  sdk.DefaultClassifier().WithAttributor(sdk.DaemonAttributor(&control.Client{Socket: e.socket})),
		Budget:      budget,
		Breaker:     breaker,
	}
	tokens := budget.Tokens()

	refused := sdk.Try(context.Background(), policy, dial(port))
	if refused.Stop != sdk.StopAttemptsExhausted || len(refused.Attempts) != 3 {
		t.Fatalf("limited dial: stop %v after %d attempts (%v)", refused.Stop, len(refused.Attempts), refused.Err)
	}
	for i, a := range refused.Attempts {
		if a.Kind() != verdict.Throttled || !a.SelfImposed() {
			t.Errorf("attempt %d: %v, want a self-imposed refusal", i, a)
		}
	}
	rl, ok := sdk.AsRateLimited(refused.Err)
	if !ok || rl.Limiter != "web" {
		t.Errorf("error %v, want a *RateLimitedError from rule web", refused.Err)
	}
	if budget.Tokens() != tokens {
		t.Errorf("retry budget %v after refusals, want %v untouched", budget.Tokens(), tokens)
	}
	if st := breaker.State(time.Now()); st != sdk.BreakerClosed {
		t.Errorf("breaker %v after refusals, want closed", st)
	}

	other := sdk.Try(context.Background(), policy, dial(firewalled))
	if other.Stop != sdk.StopPermanent || len(other.Attempts) != 1 || other.Attempts[0].Kind() != verdict.Permanent {
		t.Fatalf("EPERM from a firewall: stop %v, attempts %v (%v), want one Permanent", other.Stop, other.Attempts, other.Err)
	}
	if _, ok := sdk.AsRateLimited(other.Err); ok || !errors.Is(other.Err, syscall.EPERM) {
		t.Errorf("firewall error %v, want the EPERM itself", other.Err)
	}
}

// TestSDKAttributesFromPIDNamespace runs the SDK in a process of its own pid
// namespace, as in a container, where os.Getpid() names another process
// of the host: the daemon still finds that process's refusal and the SDK
// makes it self-imposed.
func TestSDKAttributesFromPIDNamespace(t *testing.T) {
	e := newEnv(t)
	port := listen(t)
	e.writePolicy(t, policyRule("web", port, 1))
	e.start(t)

	client := privtest.SpawnPIDNamespace(t, e.cg, "sdkdial", e.socket, strconv.Itoa(port))
	got := client.Line(t)
	client.Wait(t)
	if want := `pid 1 kind Throttled self true rule "web"`; got != want {
		t.Fatalf("the SDK in a pid namespace said %q, want %q", got, want)
	}
}

// runSDKDial holds a connection to 127.0.0.1:PORT, tries a second one
// through the SDK with the daemon at SOCKET as its attributor, and prints
// its own pid and what the SDK made of the refusal.
func runSDKDial(args []string) error {
	if len(args) != 2 {
		return fmt.Errorf("sdkdial: want SOCKET PORT, got %q", args)
	}
	addr := "127.0.0.1:" + args[1]
	held, err := net.Dial("tcp", addr)
	if err != nil {
		return fmt.Errorf("sdkdial: the first connection: %w", err)
	}
	defer held.Close()
	policy := &sdk.Policy{
		MaxAttempts: 1,
		Classifier:  sdk.DefaultClassifier().WithAttributor(sdk.DaemonAttributor(&control.Client{Socket: args[0]})),
	}
	r := sdk.Try(context.Background(), policy, func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "tcp", addr)
	})
	if r.Err == nil {
		r.Value.Close()
		return errors.New("sdkdial: the second connection was admitted")
	}
	rule := ""
	if rl, ok := sdk.AsRateLimited(r.Err); ok {
		rule = rl.Limiter
	}
	a := r.Attempts[len(r.Attempts)-1]
	fmt.Printf("pid %d kind %v self %t rule %q\n", os.Getpid(), a.Kind(), a.SelfImposed(), rule)
	return nil
}

// TestSDKGRPCFailFastRefusalsSelfImposed: a gRPC channel whose dial the
// kernel refused fails the calls that come during its reconnect backoff at
// once, with the UNAVAILABLE of that dial, and dials nothing for them.
// Those calls began after the refusal, yet it is their cause: the daemon's
// refusal is claimed for them too, so they stay self-imposed.
func TestSDKGRPCFailFastRefusalsSelfImposed(t *testing.T) {
	e := newEnv(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	healthpb.RegisterHealthServer(srv, health.NewServer())
	go srv.Serve(ln)
	t.Cleanup(srv.Stop)
	port := ln.Addr().(*net.TCPAddr).Port
	e.writePolicy(t, policyRule("web", port, 1))
	e.start(t)
	privtest.Join(t, e.cg)
	held, err := net.Dial("tcp", ln.Addr().String()) // the limit of 1 is now full
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { held.Close() })

	var dials atomic.Int32
	var d net.Dialer
	c := sdkgrpc.NewClient(sdkgrpc.ClientOptions{
		Policy: &sdk.Policy{MaxAttempts: 1, Classifier: sdk.DefaultClassifier().WithAttributor(sdk.DaemonAttributor(&control.Client{Socket: e.socket}))},
		Dial: func(ctx context.Context, addr string) (net.Conn, error) {
			dials.Add(1)
			return d.DialContext(ctx, "tcp", addr)
		},
	})
	// A reconnect backoff of 10 s (at least 8 with gRPC's jitter), so that
	// a loaded machine's delays cannot bring the next dial within the test.
	backoff := grpc.WithConnectParams(grpc.ConnectParams{Backoff: gbackoff.Config{BaseDelay: 10 * time.Second, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 10 * time.Second}})
	conn, err := grpc.NewClient("passthrough:///"+ln.Addr().String(), append(c.DialOptions(), backoff, grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	hc := healthpb.NewHealthClient(conn)
	call := func(which string) {
		t.Helper()
		var res sdkgrpc.Result
		_, err := hc.Check(sdkgrpc.WithResult(context.Background(), &res), &healthpb.HealthCheckRequest{})
		if status.Code(err) != codes.Unavailable || len(res.Attempts) != 1 {
			t.Fatalf("%s call: %v after %d attempts, want UNAVAILABLE after 1", which, err, len(res.Attempts))
		}
		if a := res.Attempts[0]; a.Kind() != verdict.Throttled || !a.SelfImposed() {
			t.Errorf("%s call: %v, want a self-imposed refusal", which, a)
		}
		if rl, ok := sdk.AsRateLimited(err); !ok || rl.Limiter != "web" {
			t.Errorf("%s call: error %v, want one naming rule web", which, err)
		}
	}
	call("first") // dials, and is refused
	n := dials.Load()
	// Past the SDK's cache of the daemon's answer, within the reconnect
	// backoff.
	time.Sleep(300 * time.Millisecond)
	call("second")
	if dials.Load() != n {
		t.Fatalf("the second call dialled (%d dials, %d before): it does not test a call failed fast", dials.Load(), n)
	}
}
