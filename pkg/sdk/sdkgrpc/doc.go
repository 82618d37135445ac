// Package sdkgrpc is the SDK for gRPC: client interceptors that run each
// call through an sdk.Policy, the gRPC side of what package sdkhttp does
// for HTTP. The server interceptors are package servegrpc's: a client links
// neither them nor the limiters and Redis client they bring.
//
//	c := sdkgrpc.NewClient(sdkgrpc.ClientOptions{
//		Policy:     p, // e.g. sdkgrpc.Defaults(), with a Hedge
//		Idempotent: func(m string) bool { return m == "/search.Search/Query" },
//		Propagate:  true,
//	})
//	conn, err := grpc.NewClient(target, append(c.DialOptions(), creds)...)
//
// A unary call is one sdk.Run, each attempt an invocation on the attempt's
// context, its status classified by [Classifier]; a failed call returns the
// executor's *sdk.StopError, whose chain keeps the last status for
// status.Code. A stream's establishment is retried the same way, and the
// stream then runs on the caller's context. Only the unary methods
// Idempotent names, with protobuf replies, are hedged. Leave gRPC's own
// retries off: they would run inside each attempt. The dialer DialOptions
// installs lets sdk.DaemonAttributor tell egressd's refusals behind an
// UNAVAILABLE. docs/sdk.md ("gRPC: sdkgrpc") has the status table and the
// details.
package sdkgrpc
