package servegrpc

import (
	"context"
	"errors"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/egressd/egressd/pkg/edge"
	"github.com/egressd/egressd/pkg/partition"
	"github.com/egressd/egressd/pkg/serve"
	"github.com/egressd/egressd/pkg/verdict"
)

// Edge metadata: edge.CriticalityHeader and edge.TimeoutHeader in the lower
// case gRPC metadata keys are, with the same values.
var (
	criticalityKey = strings.ToLower(edge.CriticalityHeader)
	timeoutKey     = strings.ToLower(edge.TimeoutHeader)
)

// Policy is a named limit on the calls a server accepts: a limiter per
// partition of them, as in package serve.
type Policy struct {
	// Name names the policy in refusals and metrics. Required; unique.
	Name string
	// Methods are the methods the policy applies to: full names
	// ("/package.Service/Method") or a service's prefix ending in "/"
	// ("/package.Service/"). None means every method.
	Methods []string
	// Partition returns the key of a call's partition: its peer (ByPeer),
	// a metadata value (ByMetadata), an identity your authentication
	// interceptor, run before this one, put in the context. Nil puts every
	// call in one partition.
	Partition func(ctx context.Context) string
	// Limiter is what each partition gets, with package serve's defaults:
	// empty names are the policy's, an empty Shared.Key is
	// serve.DefaultKeyPrefix + Name.
	Limiter partition.Options
}

// Options configure a Server.
type Options struct {
	// Policies apply, in order, to the calls whose method they name.
	Policies []Policy
	// Criticality says how far the criticality a caller sends is trusted,
	// as for package serve's middleware.
	Criticality serve.CriticalityOptions
	// Observer, if set, is told what the server does, as package serve's
	// middleware tells it (servemetrics implements it).
	Observer serve.Observer
}

// Server is the serving side for gRPC: interceptors that read the callers'
// criticality and deadline from metadata and admit calls through
// partitioned limiters.
type Server struct {
	policies []*serverPolicy
	crit     serve.CriticalityOptions
	obs      serve.Observer
}

type serverPolicy struct {
	name    string
	methods []string
	by      func(context.Context) string
	limiter *partition.Partitioned
	obs     serve.PolicyObserver
}

// New returns a Server, or a *serve.OptionsError listing every problem
// with o, as serve.New would.
func New(o Options) (*Server, error) {
	so := serve.Options{Criticality: o.Criticality}
	for _, p := range o.Policies {
		so.Policies = append(so.Policies, serve.Policy{Name: p.Name, Limiter: p.Limiter})
	}
	if err := so.Validate(); err != nil {
		return nil, err
	}
	s := &Server{crit: o.Criticality, obs: o.Observer}
	for i, p := range o.Policies {
		l, obs, err := serve.PolicyLimiter(so.Policies[i], s.obs)
		if err != nil { // Validate has seen these options; not reached
			return nil, err
		}
		s.policies = append(s.policies, &serverPolicy{name: p.Name, methods: p.Methods, by: p.Partition, limiter: l, obs: obs})
	}
	return s, nil
}

// ServerOptions returns the interceptors as server options.
//
//	srv := grpc.NewServer(s.ServerOptions()...)
func (s *Server) ServerOptions() []grpc.ServerOption {
	return []grpc.ServerOption{grpc.ChainUnaryInterceptor(s.Unary), grpc.ChainStreamInterceptor(s.Stream)}
}

// Unary is the unary server interceptor.
func (s *Server) Unary(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	ctx, done, err := s.admit(ctx, info.FullMethod, func(md metadata.MD) { _ = grpc.SetTrailer(ctx, md) })
	if err != nil {
		return nil, err
	}
	defer done()
	return handler(ctx, req)
}

// Stream is the stream server interceptor: a stream is admitted when it
// opens and holds its permits until the handler returns.
func (s *Server) Stream(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	ctx, done, err := s.admit(ss.Context(), info.FullMethod, ss.SetTrailer)
	if err != nil {
		return err
	}
	defer done()
	return handler(srv, &serverStream{ServerStream: ss, ctx: ctx})
}

type serverStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (s *serverStream) Context() context.Context { return s.ctx }

// admit reads the edge metadata into ctx and asks every policy that applies
// for a permit. A refusal is a status error, with its pushback given to
// trailer; done releases the permits.
func (s *Server) admit(ctx context.Context, method string, trailer func(metadata.MD)) (_ context.Context, done func(), err error) {
	ctx, cancel := s.edge(ctx)
	var leases []partition.Lease
	done = func() {
		for i := range leases {
			leases[i].Release()
		}
		cancel()
	}
	for _, p := range s.policies {
		if !p.applies(method) {
			continue
		}
		var key string
		if p.by != nil {
			key = p.by(ctx)
		}
		start := time.Now()
		lease, err := p.limiter.Acquire(ctx, key)
		took := time.Since(start)
		if err != nil {
			done()
			out, md, rerr := reject(ctx, p.name, err)
			if p.obs != nil {
				p.obs.OnRequest(out, took)
			}
			if md != nil {
				trailer(md)
			}
			return nil, nil, rerr
		}
		if p.obs != nil {
			p.obs.OnRequest(serve.Admitted, took)
		}
		leases = append(leases, lease)
	}
	return ctx, done, nil
}

func (p *serverPolicy) applies(method string) bool {
	if len(p.methods) == 0 {
		return true
	}
	for _, m := range p.methods {
		if m == method || strings.HasSuffix(m, "/") && strings.HasPrefix(method, m) {
			return true
		}
	}
	return false
}

// reject answers a call a policy did not admit, as package serve's
// DefaultReject answers a request: a refusal, or a wait in the queue that
// outlasted the caller, is RESOURCE_EXHAUSTED (with the limiter's hint as
// the retry pushback, when it has one), which a client reads as Throttled;
// a limiter that could not decide is UNAVAILABLE.
func reject(ctx context.Context, policy string, err error) (serve.Outcome, metadata.MD, error) {
	if rl, ok := verdict.AsRateLimited(err); ok {
		var md metadata.MD
		if rl.RetryAfter > 0 {
			md = metadata.Pairs(edge.PushbackKey, edge.FormatPushback(rl.RetryAfter))
		}
		return serve.Refused, md, status.Error(codes.ResourceExhausted, "refused by "+policy)
	}
	if ctx.Err() != nil || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return serve.Cancelled, nil, status.Error(codes.ResourceExhausted, "no permit from "+policy+" before the deadline")
	}
	return serve.Failed, nil, status.Error(codes.Unavailable, policy+": "+err.Error())
}

// edge reads the caller's criticality and timeout from ctx's metadata under
// package serve's rules - the criticality within the ceiling, the timeout
// only when it is sooner than the deadline the call has - and removes them
// from the metadata the handler sees.
func (s *Server) edge(ctx context.Context) (context.Context, context.CancelFunc) {
	md, _ := metadata.FromIncomingContext(ctx)
	c, cres := s.crit.Level(md.Get(criticalityKey))
	ctx = edge.WithCriticality(ctx, c)
	deadline, bounded := ctx.Deadline()
	d, tres := serve.Timeout(md.Get(timeoutKey), time.Now(), deadline, bounded)
	cancel := context.CancelFunc(func() {})
	if tres == serve.HeaderAccepted {
		ctx, cancel = context.WithTimeout(ctx, d)
	}
	if len(md.Get(criticalityKey)) > 0 || len(md.Get(timeoutKey)) > 0 {
		md = md.Copy()
		delete(md, criticalityKey)
		delete(md, timeoutKey)
		ctx = metadata.NewIncomingContext(ctx, md)
	}
	if s.obs != nil {
		s.obs.OnHeader(serve.HeaderCriticality, cres)
		s.obs.OnHeader(serve.HeaderTimeout, tres)
	}
	return ctx, cancel
}

// ByPeer is a Partition func: the peer's address, as serve.ByClientIP
// keys a request (an IPv6 peer is its /64).
func ByPeer(ctx context.Context) string {
	p, ok := peer.FromContext(ctx)
	if !ok || p.Addr == nil {
		return ""
	}
	return serve.AddrKey(p.Addr.String())
}

// ByMetadata returns a Partition func that reads the first value of the
// metadata key (a tenant, an API key, an address a trusted proxy sets). A
// call without it is in the partition "".
func ByMetadata(key string) func(ctx context.Context) string {
	key = strings.ToLower(key)
	return func(ctx context.Context) string {
		md, _ := metadata.FromIncomingContext(ctx)
		if vs := md.Get(key); len(vs) > 0 {
			return vs[0]
		}
		return ""
	}
}
