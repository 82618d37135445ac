package sdkgrpc

import (
	"context"
	"errors"
	"net"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/egressd/egressd/pkg/sdk"
	"github.com/egressd/egressd/pkg/verdict"
)

// ClientOptions configure a Client.
type ClientOptions struct {
	// Policy runs every call; nil means Defaults(). It is copied, its
	// classifier extended by Classifier; its Budget, Breaker and Hedge are
	// shared, as between copies: give each dependency its own.
	Policy *sdk.Policy
	// Idempotent reports whether the method (its full name,
	// "/package.Service/Method") may run more than once at the same time:
	// only such unary methods are hedged, when Policy has a Hedge. Nil
	// means none is.
	Idempotent func(fullMethod string) bool
	// Propagate sends the caller's criticality (when its context carries
	// one, see sdk.LookupCriticality) and the attempt's remaining time in
	// the metadata keys egressd-criticality and egressd-timeout-ms, which a
	// servegrpc.Server on the other side reads. Off unless set: a third
	// party has no use for them.
	Propagate bool
	// Dial makes the connections, when set (a custom dialer, a unix
	// socket); nil dials TCP. The Client watches what it returns, so that
	// an EPERM from egressd's kernel rules can be attributed.
	Dial func(ctx context.Context, addr string) (net.Conn, error)
}

// Client runs the calls of one connection through an sdk.Policy: a unary
// call is a sdk.Run (sdk.RunHedged when it may be hedged), each attempt an
// invocation; a streaming call's establishment is retried the same way. Give each grpc.ClientConn its own
// Client (DialOptions installs it).
type Client struct {
	policy, plain sdk.Policy
	idempotent    func(string) bool
	propagate     bool
	dial          func(context.Context, string) (net.Conn, error)

	mu      sync.Mutex
	refused map[string]refusal // by address: a dial refused with EPERM, until the next dial there
	dials   uint64
}

// refusal is a dial refused with EPERM, the n-th the Client made, begun
// at started.
type refusal struct {
	err     error
	n       uint64
	started time.Time
}

// NewClient returns a Client.
func NewClient(o ClientOptions) *Client {
	p := o.Policy
	if p == nil {
		p = Defaults()
	}
	c := &Client{policy: *p, idempotent: o.Idempotent, propagate: o.Propagate, dial: o.Dial, refused: map[string]refusal{}}
	c.policy.Classifier = Classifier(c.policy.Classifier)
	c.plain = c.policy
	c.plain.Hedge = nil
	if c.dial == nil {
		var d net.Dialer
		c.dial = func(ctx context.Context, addr string) (net.Conn, error) { return d.DialContext(ctx, "tcp", addr) }
	}
	return c
}

// DialOptions installs the client on a connection: its unary and stream
// interceptors, and its dialer.
//
//	conn, err := grpc.NewClient(target, append(c.DialOptions(), grpc.WithTransportCredentials(creds))...)
func (c *Client) DialOptions() []grpc.DialOption {
	return []grpc.DialOption{
		grpc.WithChainUnaryInterceptor(c.Unary),
		grpc.WithChainStreamInterceptor(c.Stream),
		grpc.WithContextDialer(c.dialContext),
	}
}

// Result is what the interceptors know about one call: the attempt log, why
// it stopped, why a hedge was held back, and the executor's error.
type Result struct {
	Attempts   []verdict.Attempt
	Stop       sdk.StopReason
	Suppressed verdict.Suppression
	Err        error
}

type resultKey struct{}

// WithResult returns a context that has the interceptors fill r for the call
// it is given to. Use one Result per call.
func WithResult(ctx context.Context, r *Result) context.Context {
	return context.WithValue(ctx, resultKey{}, r)
}

// call runs fn under p - hedged, when p has a Hedge - filling the caller's
// Result if it asked for one.
func call[T any](ctx context.Context, p *sdk.Policy, fn func(context.Context) (T, error)) (T, error) {
	run, try := sdk.Run[T], sdk.Try[T]
	if p.Hedge != nil {
		run, try = sdk.RunHedged[T], sdk.TryHedged[T]
	}
	res, _ := ctx.Value(resultKey{}).(*Result)
	if res == nil {
		return run(ctx, p, fn)
	}
	r := try(ctx, p, fn)
	*res = Result{Attempts: r.Attempts, Stop: r.Stop, Suppressed: r.Suppressed, Err: r.Err}
	return r.Value, r.Err
}

// Unary is the unary client interceptor. A hedged call (an idempotent
// method, a policy with a Hedge, a protobuf reply) gives each attempt a
// reply of its own and copies the winner's into reply.
func (c *Client) Unary(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	p := &c.plain
	msg, isProto := reply.(proto.Message)
	if c.policy.Hedge != nil && isProto && c.idempotent != nil && c.idempotent(method) {
		p = &c.policy
	}
	hedged := p.Hedge != nil
	won, err := call(ctx, p, func(actx context.Context) (any, error) {
		out := reply
		if hedged {
			out = msg.ProtoReflect().New().Interface()
		}
		var trailer metadata.MD
		var pr peer.Peer
		err := invoker(c.outgoing(actx), method, req, out, cc, append(opts[:len(opts):len(opts)], grpc.Trailer(&trailer), grpc.Peer(&pr))...)
		if err != nil {
			return nil, c.wrap(err, trailer, pr.Addr != nil)
		}
		return out, nil
	})
	if err == nil && hedged {
		proto.Reset(msg)
		proto.Merge(msg, won.(proto.Message))
	}
	return err
}

// Stream is the stream client interceptor: it retries the stream's
// establishment (never hedges it: a stream has no answer to race for when
// it is established). The attempt's deadline bounds the establishment
// only; the stream then runs on the caller's context.
func (c *Client) Stream(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	return call(ctx, &c.plain, func(actx context.Context) (grpc.ClientStream, error) {
		sctx, cancel := context.WithCancel(ctx)
		stop := context.AfterFunc(actx, cancel)
		var pr peer.Peer
		cs, err := streamer(c.outgoing(sctx), desc, cc, method, append(opts[:len(opts):len(opts)], grpc.Peer(&pr))...)
		if !stop() || err != nil {
			cancel()
			if err == nil {
				err = actx.Err()
			}
			return nil, c.wrap(err, nil, pr.Addr != nil)
		}
		return &clientStream{ClientStream: cs, cancel: cancel}, nil
	})
}

// clientStream lets go of its context once the stream has ended.
type clientStream struct {
	grpc.ClientStream
	cancel context.CancelFunc
}

func (s *clientStream) RecvMsg(m any) error {
	err := s.ClientStream.RecvMsg(m)
	if err != nil {
		s.cancel()
	}
	return err
}

// outgoing adds the edge metadata to an attempt's context, when asked to
// and the caller did not set it.
func (c *Client) outgoing(ctx context.Context) context.Context {
	if !c.propagate {
		return ctx
	}
	md, _ := metadata.FromOutgoingContext(ctx)
	var kv []string
	if crit, ok := sdk.LookupCriticality(ctx); ok && len(md.Get(criticalityKey)) == 0 {
		if _, named := sdk.ParseCriticality(crit.String()); named {
			kv = append(kv, criticalityKey, crit.String())
		}
	}
	if d, ok := ctx.Deadline(); ok && len(md.Get(timeoutKey)) == 0 {
		kv = append(kv, timeoutKey, sdk.FormatTimeout(time.Until(d)))
	}
	if len(kv) == 0 {
		return ctx
	}
	return metadata.AppendToOutgoingContext(ctx, kv...)
}

// wrap makes a failed invocation's error a *StatusError. reached says the
// call got a transport - gRPC set its peer - so that its UNAVAILABLE came
// from the server or that connection, not from a dial.
func (c *Client) wrap(err error, trailer metadata.MD, reached bool) error {
	if _, ok := status.FromError(err); !ok {
		return err // a context's error: the executor reads those itself
	}
	se := &StatusError{Err: err}
	if v := trailer.Get(PushbackKey); len(v) > 0 {
		se.Pushback = v[0]
	}
	if status.Code(err) == codes.Unavailable && !reached {
		se.dial = c.lastRefusal()
	}
	return se
}

// lastRefusal returns the latest EPERM among the addresses whose last dial
// was refused, if any. A call that reached no transport cannot say which
// address its pick would have been: when every address failed, a refused
// one is among the causes, and the Attributor asks the daemon about the
// address the error names.
func (c *Client) lastRefusal() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	var last refusal
	for _, r := range c.refused {
		if r.n > last.n {
			last = r
		}
	}
	// The call may have begun after that dial (failed fast while the
	// channel backs off): the dial's start is what the refusal follows.
	return sdk.WithDialStart(last.err, last.started)
}

// dialContext dials, remembering an EPERM for addr until the next dial
// there: behind the UNAVAILABLE of calls that reach no transport
// meanwhile, that is what egressd's refusal looks like.
func (c *Client) dialContext(ctx context.Context, addr string) (net.Conn, error) {
	started := time.Now()
	conn, err := c.dial(ctx, addr)
	c.mu.Lock()
	defer c.mu.Unlock()
	c.dials++
	if errors.Is(err, syscall.EPERM) {
		c.refused[addr] = refusal{err: err, n: c.dials, started: started}
	} else {
		delete(c.refused, addr)
	}
	return conn, err
}
