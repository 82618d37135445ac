// Package sdkgrpc is the SDK for gRPC: client interceptors that run each
// call through an sdk.Policy, the gRPC side of what package sdkhttp does
// for HTTP. The server interceptors are package servegrpc's, on the serving
// side: a client links neither them nor the limiters and Redis client they
// bring.
//
//	c := sdkgrpc.NewClient(sdkgrpc.ClientOptions{
//		Policy:     p, // e.g. sdkgrpc.Defaults(), with a Hedge
//		Idempotent: func(m string) bool { return m == "/search.Search/Query" },
//		Propagate:  true,
//	})
//	conn, err := grpc.NewClient(target, append(c.DialOptions(), creds)...)
//
// A unary call is one sdk.Run: each attempt is an invocation on the
// attempt's context, its status classified by Classifier (RESOURCE_EXHAUSTED
// Throttled honouring the grpc-retry-pushback-ms trailer, UNAVAILABLE
// Transient, DEADLINE_EXCEEDED by the attempt timeout rules, the rest
// Permanent). A failed call returns the executor's *sdk.StopError, whose
// chain keeps the last status: status.Code reads it. A streaming call's
// establishment is retried the same way, and the stream then runs on the
// caller's context. gRPC's own retries, if a service config enables them,
// run inside each attempt: leave them off.
//
// Hedging (a Policy with a Hedge) is for the unary methods Idempotent names
// only, with protobuf replies: such a call is one sdk.RunHedged, each
// attempt decodes into a reply of its own, and the winner's is copied into
// the caller's. Every other call goes through sdk.Run with the policy's
// Hedge left out.
//
// A connection egressd's kernel rules refuse fails its dial with EPERM,
// which gRPC reports as UNAVAILABLE without the cause. The Client's dialer
// (DialOptions installs it) remembers the EPERM per address, until that
// address is dialled again, and hands it to the classifier's Attributor
// behind the UNAVAILABLE of a call that reached no connection - not behind
// one a server (or a connection that was up) answered - so that Defaults'
// sdk.DaemonAttributor makes the call a self-imposed refusal naming the
// rule, as in HTTP; unclaimed, it is Permanent. gRPC reconnects on its own
// backoff: a retry sooner than its next dial finds the same UNAVAILABLE.
package sdkgrpc
