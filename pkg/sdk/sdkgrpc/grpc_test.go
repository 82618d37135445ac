package sdkgrpc

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"testing/synctest"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/egressd/egressd/internal/pipenet"
	"github.com/egressd/egressd/pkg/limit"
	"github.com/egressd/egressd/pkg/partition"
	"github.com/egressd/egressd/pkg/sdk"
	"github.com/egressd/egressd/pkg/serve"
	"github.com/egressd/egressd/pkg/serve/servegrpc"
	"github.com/egressd/egressd/pkg/verdict"
)

const (
	checkMethod = "/grpc.health.v1.Health/Check"
	hedgeDelay  = 20 * time.Millisecond
)

// A step is what the test server does for one call of Check.
type step func(ctx context.Context) (*healthpb.HealthCheckResponse, error)

func serving(context.Context) (*healthpb.HealthCheckResponse, error) {
	return &healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_SERVING}, nil
}

func fail(c codes.Code, pushback string) step {
	return func(ctx context.Context) (*healthpb.HealthCheckResponse, error) {
		if pushback != "" {
			_ = grpc.SetTrailer(ctx, metadata.Pairs(PushbackKey, pushback))
		}
		return nil, status.Error(c, c.String())
	}
}

// stall answers nothing until the call is cancelled.
func stall(ctx context.Context) (*healthpb.HealthCheckResponse, error) {
	<-ctx.Done()
	return nil, ctx.Err()
}

// healthServer plays a script, one step per Check, the last repeated, and
// keeps what each call's handler saw.
type healthServer struct {
	healthpb.UnimplementedHealthServer
	steps []step
	calls atomic.Int32
	mu    sync.Mutex
	seen  []context.Context
}

func (h *healthServer) Check(ctx context.Context, _ *healthpb.HealthCheckRequest) (*healthpb.HealthCheckResponse, error) {
	n := int(h.calls.Add(1)) - 1
	h.mu.Lock()
	h.seen = append(h.seen, ctx)
	h.mu.Unlock()
	return h.steps[min(n, len(h.steps)-1)](ctx)
}

func (h *healthServer) Watch(_ *healthpb.HealthCheckRequest, ss grpc.ServerStreamingServer[healthpb.HealthCheckResponse]) error {
	h.mu.Lock()
	h.seen = append(h.seen, ss.Context())
	h.mu.Unlock()
	for range 2 {
		if err := ss.Send(&healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_SERVING}); err != nil {
			return err
		}
	}
	return nil
}

func (h *healthServer) handlerCtx(i int) context.Context {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.seen[i]
}

// The tests' servers and clients meet on an in-memory network, so that
// the tests of timing (retries, pushback, hedging) run in synctest
// bubbles, whose clock a loopback socket would keep from moving.
var (
	network pipenet.Network
	servers atomic.Int64
)

// newClient is NewClient dialling over the tests' network, unless o has a
// dialer of its own.
func newClient(o ClientOptions) *Client {
	if o.Dial == nil {
		o.Dial = func(ctx context.Context, addr string) (net.Conn, error) { return network.DialContext(ctx, "tcp", addr) }
	}
	return NewClient(o)
}

// listen runs a gRPC server with opts on the tests' network; it returns
// its address.
func listen(t *testing.T, h *healthServer, opts ...grpc.ServerOption) string {
	t.Helper()
	lis, err := network.Listen(fmt.Sprintf("srv%d.test:443", servers.Add(1)))
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(opts...)
	healthpb.RegisterHealthServer(srv, h)
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	return lis.Addr().String()
}

// dial connects a client through c.
func dial(t *testing.T, addr string, c *Client) healthpb.HealthClient {
	t.Helper()
	conn, err := grpc.NewClient("passthrough:///"+addr, append(c.DialOptions(), grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return healthpb.NewHealthClient(conn)
}

// testPolicy retries on short curves, without jitter, budget or breaker.
func testPolicy(attempts int) *sdk.Policy {
	return &sdk.Policy{
		MaxAttempts: attempts,
		Backoff: sdk.Backoff{
			Transient: sdk.Curve{Initial: 2 * time.Millisecond, Multiplier: 1},
			Throttled: sdk.Curve{Initial: 20 * time.Millisecond, Multiplier: 1},
			MaxDelay:  time.Second,
		},
	}
}

func check(t *testing.T, hc healthpb.HealthClient, ctx context.Context) (*healthpb.HealthCheckResponse, Result, error) {
	t.Helper()
	var res Result
	resp, err := hc.Check(WithResult(ctx, &res), &healthpb.HealthCheckRequest{})
	return resp, res, err
}

func log(res Result) []string {
	var s []string
	for _, a := range res.Attempts {
		s = append(s, a.Verdict().String())
	}
	return s
}

func TestClassifier(t *testing.T) {
	st := func(c codes.Code, pushback string) error {
		return &StatusError{Err: status.Error(c, "x"), Pushback: pushback}
	}
	tests := []struct {
		name string
		err  error
		want verdict.Verdict
	}{
		{"resource exhausted", st(codes.ResourceExhausted, ""), verdict.New(verdict.Throttled)},
		{"resource exhausted with pushback", st(codes.ResourceExhausted, "250"), verdict.New(verdict.Throttled).WithRetryAfter(250 * time.Millisecond)},
		{"pushback zero: retry now", st(codes.ResourceExhausted, "0"), verdict.New(verdict.Throttled).WithRetryAfter(0)},
		{"negative pushback: do not retry", st(codes.ResourceExhausted, "-1"), verdict.New(verdict.Permanent)},
		{"malformed pushback: do not retry", st(codes.Unavailable, "soon"), verdict.New(verdict.Permanent)},
		{"unavailable", st(codes.Unavailable, ""), verdict.New(verdict.Transient)},
		{"unavailable with pushback", st(codes.Unavailable, "5"), verdict.New(verdict.Transient).WithRetryAfter(5 * time.Millisecond)},
		{"server's deadline exceeded", st(codes.DeadlineExceeded, ""), verdict.New(verdict.Transient)},
		{"a bare status error", status.Error(codes.Unavailable, "x"), verdict.New(verdict.Transient)},
		{"aborted", st(codes.Aborted, ""), verdict.New(verdict.Permanent)},
		{"internal", st(codes.Internal, ""), verdict.New(verdict.Permanent)},
		{"not found", st(codes.NotFound, ""), verdict.New(verdict.Permanent)},
		{"unattributed EPERM", &StatusError{Err: status.Error(codes.Unavailable, "x"), dial: eperm()}, verdict.New(verdict.Permanent)},
		{"a limiter's refusal", &sdk.RateLimitedError{Limiter: "l", RetryAfter: time.Second}, verdict.Refused(time.Second)},
	}
	c := Classifier(nil)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := c.Classify(context.Background(), tt.err); got != tt.want {
				t.Errorf("Classify = %v, want %v", got, tt.want)
			}
		})
	}
}

// Over a real connection: UNAVAILABLE is retried on the transient curve,
// RESOURCE_EXHAUSTED waits the server's pushback, and a failed call keeps
// its status code.
func TestUnaryRetries(t *testing.T) {
	tests := []struct {
		name      string
		steps     []step
		wantLog   []string
		wantDelay time.Duration
		wantCode  codes.Code
	}{
		{"unavailable then serving", []step{fail(codes.Unavailable, ""), serving}, []string{"Transient", "OK"}, 2 * time.Millisecond, codes.OK},
		{"resource exhausted with pushback", []step{fail(codes.ResourceExhausted, "30"), serving}, []string{"Throttled(retry after 30ms)", "OK"}, 30 * time.Millisecond, codes.OK},
		{"pushback says stop", []step{fail(codes.ResourceExhausted, "-1"), serving}, []string{"Permanent"}, 0, codes.ResourceExhausted},
		{"not found is final", []step{fail(codes.NotFound, ""), serving}, []string{"Permanent"}, 0, codes.NotFound},
		{"unavailable to the end", []step{fail(codes.Unavailable, "")}, []string{"Transient", "Transient", "Transient"}, 2 * time.Millisecond, codes.Unavailable},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				h := &healthServer{steps: tt.steps}
				hc := dial(t, listen(t, h), newClient(ClientOptions{Policy: testPolicy(3)}))
				_, res, err := check(t, hc, context.Background())
				if got := status.Code(err); got != tt.wantCode {
					t.Fatalf("status %v (%v), want %v", got, err, tt.wantCode)
				}
				if got := log(res); !slices.Equal(got, tt.wantLog) {
					t.Errorf("attempt log %q, want %q", got, tt.wantLog)
				}
				if d := res.Attempts[0].Delay(); d != tt.wantDelay {
					t.Errorf("first delay %v, want %v", d, tt.wantDelay)
				}
			})
		})
	}
}

// A server whose partitioned limiter refuses: the refusal is
// RESOURCE_EXHAUSTED with the limiter's hint as pushback, which the client
// waits out before its retry is admitted.
func TestServerRefusalWithPushback(t *testing.T) { synctest.Test(t, testServerRefusalWithPushback) }

func testServerRefusalWithPushback(t *testing.T) {
	s, err := servegrpc.New(servegrpc.Options{Policies: []servegrpc.Policy{{
		Name: "per-peer", Partition: servegrpc.ByPeer,
		Limiter: partition.Options{Local: &limit.Options{PerWindow: &limit.PerWindowOptions{Permits: 1, Window: time.Second}}},
	}}})
	if err != nil {
		t.Fatal(err)
	}
	h := &healthServer{steps: []step{serving}}
	addr := listen(t, h, s.ServerOptions()...)

	// A client without retries sees the refusal as it is.
	plain := dial(t, addr, newClient(ClientOptions{Policy: testPolicy(1)}))
	if _, _, err := check(t, plain, context.Background()); err != nil {
		t.Fatalf("first call: %v", err)
	}
	var trailer metadata.MD
	_, err = plain.Check(context.Background(), &healthpb.HealthCheckRequest{}, grpc.Trailer(&trailer))
	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("second call: %v, want RESOURCE_EXHAUSTED", err)
	}
	d, ok := ParsePushback(firstOf(trailer.Get(PushbackKey)))
	if !ok || d <= 0 || d > time.Second {
		t.Fatalf("pushback %q, want up to the 1s window", trailer.Get(PushbackKey))
	}

	// One with retries waits the pushback and gets through.
	retrying := dial(t, addr, newClient(ClientOptions{Policy: testPolicy(3)}))
	_, res, err := check(t, retrying, context.Background())
	if err != nil {
		t.Fatalf("retrying call: %v (%q)", err, log(res))
	}
	if len(res.Attempts) != 2 || res.Attempts[0].Kind() != verdict.Throttled || res.Attempts[0].SelfImposed() {
		t.Errorf("attempt log %q, want the server's throttling then OK", log(res))
	}
	if ra, ok := res.Attempts[0].Verdict().RetryAfter(); !ok || ra <= 0 || ra > time.Second {
		t.Errorf("retry after %v, %v; want the server's pushback", ra, ok)
	}
	if h.calls.Load() != 2 {
		t.Errorf("handler ran %d times, want 2: refusals never reach it", h.calls.Load())
	}
}

func firstOf(vs []string) string {
	if len(vs) == 0 {
		return ""
	}
	return vs[0]
}

// Criticality and the remaining deadline cross in metadata: the handler's
// context holds them (the criticality within the ceiling, the deadline no
// later than sent), and the metadata it sees no longer has them.
func TestPropagateAndEdge(t *testing.T) { synctest.Test(t, testPropagateAndEdge) }

func testPropagateAndEdge(t *testing.T) {
	s, err := servegrpc.New(servegrpc.Options{Criticality: serve.CriticalityOptions{Default: sdk.Critical, Ceiling: sdk.Critical}})
	if err != nil {
		t.Fatal(err)
	}
	h := &healthServer{steps: []step{serving}}
	addr := listen(t, h, s.ServerOptions()...)
	hc := dial(t, addr, newClient(ClientOptions{Policy: testPolicy(1), Propagate: true}))

	for i, tt := range []struct {
		sent, want sdk.Criticality
	}{{sdk.Sheddable, sdk.Sheddable}, {sdk.CriticalPlus, sdk.Critical}} {
		ctx, cancel := context.WithTimeout(sdk.WithCriticality(context.Background(), tt.sent), 5*time.Second)
		if _, _, err := check(t, hc, ctx); err != nil {
			t.Fatal(err)
		}
		cancel()
		hctx := h.handlerCtx(i)
		if got := sdk.CriticalityFrom(hctx); got != tt.want {
			t.Errorf("sent %v: handler sees %v, want %v", tt.sent, got, tt.want)
		}
		if d, ok := hctx.Deadline(); !ok || time.Until(d) > 5*time.Second {
			t.Errorf("handler's deadline %v, %v; want within 5s", d, ok)
		}
		md, _ := metadata.FromIncomingContext(hctx)
		if len(md.Get(criticalityKey)) > 0 || len(md.Get(timeoutKey)) > 0 {
			t.Errorf("handler's metadata still has the edge keys: %v", md)
		}
	}
}

// A stream is established through the interceptor, and lives on after
// its establishment's attempt: both messages arrive.
func TestStream(t *testing.T) {
	h := &healthServer{}
	hc := dial(t, listen(t, h), newClient(ClientOptions{Policy: sdk.HTTPDefaults(), Propagate: true}))
	var res Result
	ctx := sdk.WithCriticality(context.Background(), sdk.Sheddable)
	st, err := hc.Watch(WithResult(ctx, &res), &healthpb.HealthCheckRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		if _, err := st.Recv(); err != nil {
			t.Fatalf("message %d: %v", i, err)
		}
	}
	if len(res.Attempts) != 1 || res.Attempts[0].Kind() != verdict.OK {
		t.Errorf("establishment log %v", res.Attempts)
	}
	md, _ := metadata.FromIncomingContext(h.handlerCtx(0))
	if got := md.Get(criticalityKey); !slices.Equal(got, []string{"Sheddable"}) {
		t.Errorf("server saw criticality %q (no server interceptor here), want Sheddable", got)
	}
}

// A stream that cannot be established is retried, then fails with its
// status.
func TestStreamEstablishmentRetried(t *testing.T) { synctest.Test(t, testStreamEstablishmentRetried) }

func testStreamEstablishmentRetried(t *testing.T) {
	// Nothing listens there: every dial is refused.
	hc := dial(t, "nobody.test:443", newClient(ClientOptions{Policy: testPolicy(2)}))
	var res Result
	_, err := hc.Watch(WithResult(context.Background(), &res), &healthpb.HealthCheckRequest{})
	if status.Code(err) != codes.Unavailable || !errors.Is(err, sdk.ErrAttemptsExhausted) {
		t.Fatalf("Watch: %v, want UNAVAILABLE after the attempts ran out", err)
	}
	if got := log(res); !slices.Equal(got, []string{"Transient", "Transient"}) {
		t.Errorf("attempt log %q", got)
	}
}

// The first Check stalls; the hedge answers, and the stalled call is
// cancelled at the server. A method not marked idempotent is never hedged.
func TestHedging(t *testing.T) { synctest.Test(t, testHedging) }

func testHedging(t *testing.T) {
	for _, idempotent := range []bool{true, false} {
		// The hedge waits in Admit until the first call has reached the
		// server, so that the first attempt's is the call that stalls,
		// however late the loaded machine runs it.
		reached := make(chan struct{})
		first := func(ctx context.Context) (*healthpb.HealthCheckResponse, error) {
			close(reached)
			return stall(ctx)
		}
		h := &healthServer{steps: []step{first, serving}}
		p := testPolicy(3)
		p.Hedge = sdk.NewHedge(sdk.HedgeOptions{Delay: hedgeDelay})
		p.Admit = func(ctx context.Context, next sdk.NextAttempt) verdict.Verdict {
			if next.Hedge {
				select {
				case <-reached:
				case <-ctx.Done():
				}
			}
			return verdict.Verdict{}
		}
		hc := dial(t, listen(t, h), newClient(ClientOptions{Policy: p, Idempotent: func(m string) bool { return idempotent && m == checkMethod }}))
		// Not hedged, the call stalls until its deadline: a short one.
		timeout := time.Minute
		if !idempotent {
			timeout = 5 * hedgeDelay
		}
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		resp, res, err := check(t, hc, ctx)
		cancel()
		if !idempotent {
			if status.Code(err) != codes.DeadlineExceeded || h.calls.Load() != 1 {
				t.Errorf("not idempotent: %v after %d calls; want the deadline after one", err, h.calls.Load())
			}
			continue
		}
		if err != nil || resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			t.Fatalf("hedged Check: %v, %v", resp, err)
		}
		if len(res.Attempts) != 2 || !res.Attempts[0].Lost() || !res.Attempts[1].Hedge() {
			t.Errorf("attempt log %v, want the first lost and the hedge", res.Attempts)
		}
		select {
		case <-h.handlerCtx(0).Done():
		case <-time.After(5 * time.Second):
			t.Error("the stalled call was not cancelled at the server")
		}
	}
}

// An EPERM from the dial, which gRPC reports as UNAVAILABLE: attributed,
// it is a self-imposed refusal naming the rule; unattributed, Permanent.
func TestKernelRefusalAttributed(t *testing.T) {
	refuse := func(context.Context, string) (net.Conn, error) { return nil, eperm() }
	for _, attributed := range []bool{true, false} {
		p := testPolicy(2)
		p.Classifier = sdk.DefaultClassifier().WithAttributor(func(_ context.Context, err error) (*sdk.RateLimitedError, bool) {
			return &sdk.RateLimitedError{Limiter: "payments-egress", RetryAfter: time.Millisecond}, attributed
		})
		hc := dial(t, "127.0.0.1:9", NewClient(ClientOptions{Policy: p, Dial: refuse}))
		_, res, err := check(t, hc, context.Background())
		if status.Code(err) != codes.Unavailable {
			t.Errorf("attributed %v: status %v, want UNAVAILABLE kept", attributed, err)
		}
		want := []string{"Permanent"}
		if attributed {
			want = []string{"Throttled(self-imposed, retry after 1ms)", "Throttled(self-imposed, retry after 1ms)"}
			if rl, ok := sdk.AsRateLimited(err); !ok || rl.Limiter != "payments-egress" {
				t.Errorf("error %v does not name the rule", err)
			}
		}
		if got := log(res); !slices.Equal(got, want) {
			t.Errorf("attributed %v: attempt log %q, want %q", attributed, got, want)
		}
	}
}

// The connection's dial to another backend is refused with EPERM, after
// this one connected; this one answers UNAVAILABLE itself. That
// UNAVAILABLE reached a server, and is Transient, retried: the refused
// dial is not what it says.
func TestServersUnavailableBesideARefusedDial(t *testing.T) {
	h := &healthServer{steps: []step{serving, fail(codes.Unavailable, ""), serving}}
	good, blocked := listen(t, h), "127.0.0.1:9"
	p := testPolicy(3)
	p.Classifier = sdk.DefaultClassifier().WithAttributor(func(context.Context, error) (*sdk.RateLimitedError, bool) {
		return &sdk.RateLimitedError{Limiter: "payments-egress"}, true
	})
	c := NewClient(ClientOptions{Policy: p, Dial: func(ctx context.Context, addr string) (net.Conn, error) {
		if addr == blocked {
			return nil, eperm()
		}
		return network.DialContext(ctx, "tcp", addr)
	}})
	hc := dial(t, good, c)
	if _, _, err := check(t, hc, context.Background()); err != nil {
		t.Fatal(err) // connected: steps[0]
	}
	// What gRPC does for the other address of a round-robin connection.
	if _, err := c.dialContext(context.Background(), blocked); !errors.Is(err, syscall.EPERM) {
		t.Fatalf("dial %s: %v, want EPERM", blocked, err)
	}

	_, res, err := check(t, hc, context.Background())
	if want := []string{"Transient", "OK"}; err != nil || !slices.Equal(log(res), want) {
		t.Errorf("err %v, attempt log %q; want %q", err, log(res), want)
	}
}

// A refused dial stays behind the UNAVAILABLE of calls that reach no
// transport until that address is dialled again, whatever other addresses'
// dials do; a call that reached a transport never carries it.
func TestDialRefusalsByAddress(t *testing.T) {
	up := make(map[string]bool)
	c := NewClient(ClientOptions{Dial: func(_ context.Context, addr string) (net.Conn, error) {
		if up[addr] {
			client, server := net.Pipe()
			server.Close()
			return client, nil
		}
		return nil, eperm()
	}})
	unavailable := status.Error(codes.Unavailable, "x")
	attached := func(reached bool) bool {
		return errors.Is(c.wrap(unavailable, nil, reached), syscall.EPERM)
	}
	for _, step := range []struct {
		addr string
		up   bool
		want bool
	}{
		{"a:1", false, true},
		{"b:1", true, true}, // another address connecting clears nothing
		{"a:1", true, false},
	} {
		up[step.addr] = step.up
		if conn, err := c.dialContext(context.Background(), step.addr); err == nil {
			conn.Close()
		}
		if got := attached(false); got != step.want {
			t.Errorf("after dialling %s (up %v): EPERM attached %v, want %v", step.addr, step.up, got, step.want)
		}
		if attached(true) {
			t.Errorf("after dialling %s: EPERM attached to a call that reached a transport", step.addr)
		}
	}
}

// eperm is the error a dial refused by the kernel returns.
func eperm() error {
	return &net.OpError{Op: "dial", Net: "tcp", Addr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 9}, Err: os.NewSyscallError("connect", syscall.EPERM)}
}
