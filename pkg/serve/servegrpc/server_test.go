package servegrpc

import (
	"context"
	"errors"
	"net"
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/egressd/egressd/pkg/edge"
	"github.com/egressd/egressd/pkg/limit"
	"github.com/egressd/egressd/pkg/partition"
	"github.com/egressd/egressd/pkg/serve"
	"github.com/egressd/egressd/pkg/verdict"
)

// The interceptors are tested here without a connection; package sdkgrpc's
// tests run them against its client over one.

const watchMethod = "/grpc.health.v1.Health/Watch"

// stream is a grpc.ServerStream with a context, keeping the trailer it is
// given.
type stream struct {
	grpc.ServerStream
	ctx     context.Context
	trailer metadata.MD
}

func (s *stream) Context() context.Context  { return s.ctx }
func (s *stream) SetTrailer(md metadata.MD) { s.trailer = metadata.Join(s.trailer, md) }

// A stream holds its permit until its handler returns; the next is refused
// with RESOURCE_EXHAUSTED and a pushback, its handler never run. A method
// no policy names is not limited.
func TestStreamAdmission(t *testing.T) {
	s, err := New(Options{Policies: []Policy{{
		Name: "watch", Methods: []string{"/grpc.health.v1.Health/"},
		Limiter: partition.Options{Local: &limit.Options{PerWindow: &limit.PerWindowOptions{Permits: 1, Window: time.Minute}}},
	}}})
	if err != nil {
		t.Fatal(err)
	}
	var ran []string
	call := func(method string) (*stream, error) {
		ss := &stream{ctx: context.Background()}
		return ss, s.Stream(nil, ss, &grpc.StreamServerInfo{FullMethod: method}, func(any, grpc.ServerStream) error {
			ran = append(ran, method)
			return nil
		})
	}
	if _, err := call(watchMethod); err != nil {
		t.Fatalf("first stream: %v", err)
	}
	refused, err := call(watchMethod)
	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("second stream: %v, want RESOURCE_EXHAUSTED", err)
	}
	if d, ok := edge.ParsePushback(firstValue(refused.trailer, edge.PushbackKey)); !ok || d <= 0 || d > time.Minute {
		t.Errorf("pushback %q, want up to the minute's window", refused.trailer.Get(edge.PushbackKey))
	}
	if _, err := call("/other.Service/Watch"); err != nil {
		t.Errorf("a method no policy names: %v", err)
	}
	if want := []string{watchMethod, "/other.Service/Watch"}; !slices.Equal(ran, want) {
		t.Errorf("handlers ran for %q, want %q", ran, want)
	}
}

func firstValue(md metadata.MD, key string) string {
	if vs := md.Get(key); len(vs) > 0 {
		return vs[0]
	}
	return ""
}

// The handler's context has the criticality within the ceiling and the
// sooner deadline; its metadata has the other keys, not the edge's.
func TestEdgeMetadata(t *testing.T) {
	s, err := New(Options{Criticality: serve.CriticalityOptions{Default: edge.Critical, Ceiling: edge.Critical}})
	if err != nil {
		t.Fatal(err)
	}
	md := metadata.Pairs(criticalityKey, "CriticalPlus", timeoutKey, "5000", "x-tenant", "acme")
	ctx := metadata.NewIncomingContext(context.Background(), md)
	var seen context.Context
	_, err = s.Unary(ctx, nil, &grpc.UnaryServerInfo{FullMethod: "/search.Search/Query"}, func(ctx context.Context, _ any) (any, error) {
		seen = ctx
		return nil, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if got := edge.CriticalityFrom(seen); got != edge.Critical {
		t.Errorf("criticality %v, want Critical (the ceiling)", got)
	}
	if d, ok := seen.Deadline(); !ok || time.Until(d) > 5*time.Second {
		t.Errorf("deadline %v, %v; want within 5s", d, ok)
	}
	got, _ := metadata.FromIncomingContext(seen)
	if len(got.Get(criticalityKey)) > 0 || len(got.Get(timeoutKey)) > 0 || firstValue(got, "x-tenant") != "acme" {
		t.Errorf("handler's metadata %v, want x-tenant only", got)
	}
}

func TestReject(t *testing.T) {
	tests := []struct {
		name     string
		err      error
		outcome  serve.Outcome
		code     codes.Code
		pushback string
	}{
		{"refused with a hint", &verdict.RateLimitedError{Limiter: "api", RetryAfter: 1500 * time.Microsecond}, serve.Refused, codes.ResourceExhausted, "2"},
		{"refused without one", &verdict.RateLimitedError{Limiter: "api"}, serve.Refused, codes.ResourceExhausted, ""},
		{"queued past the deadline", context.DeadlineExceeded, serve.Cancelled, codes.ResourceExhausted, ""},
		{"no decision", errors.New("redis: connection refused"), serve.Failed, codes.Unavailable, ""},
	}
	for _, tt := range tests {
		outcome, md, err := reject(context.Background(), "api", tt.err)
		if outcome != tt.outcome || status.Code(err) != tt.code || firstValue(md, edge.PushbackKey) != tt.pushback {
			t.Errorf("%s: %v, %v, pushback %q; want %v, %v, %q", tt.name, outcome, status.Code(err), firstValue(md, edge.PushbackKey), tt.outcome, tt.code, tt.pushback)
		}
	}
}

func TestSelectors(t *testing.T) {
	in := func(pairs ...string) context.Context {
		return metadata.NewIncomingContext(context.Background(), metadata.Pairs(pairs...))
	}
	from := func(addr net.Addr) context.Context {
		return peer.NewContext(context.Background(), &peer.Peer{Addr: addr})
	}
	tests := []struct {
		name string
		by   func(context.Context) string
		ctx  context.Context
		want string
	}{
		{"metadata", ByMetadata("X-Tenant"), in("x-tenant", "acme", "x-tenant", "other"), "acme"},
		{"no metadata", ByMetadata("X-Tenant"), in("x-user", "bob"), ""},
		{"IPv4 peer", ByPeer, from(&net.TCPAddr{IP: net.IPv4(10, 0, 0, 1), Port: 5}), "10.0.0.1"},
		{"IPv6 peer", ByPeer, from(&net.TCPAddr{IP: net.ParseIP("2001:db8::1"), Port: 5}), "2001:db8::/64"},
		{"no peer", ByPeer, context.Background(), ""},
	}
	for _, tt := range tests {
		if got := tt.by(tt.ctx); got != tt.want {
			t.Errorf("%s: %q, want %q", tt.name, got, tt.want)
		}
	}
}
