// Package servegrpc is the serving side for gRPC: server interceptors that
// admit calls through partitioned limiters and read the callers'
// criticality and deadline, what package serve's middleware does for HTTP.
// Package sdkgrpc is the client side.
//
//	s, err := servegrpc.New(servegrpc.Options{Policies: []servegrpc.Policy{
//		{Name: "per-peer", Partition: servegrpc.ByPeer, Limiter: partition.Options{
//			Local: &limit.Options{PerSecond: &limit.PerSecondOptions{Permits: 100}}}},
//	}})
//	srv := grpc.NewServer(s.ServerOptions()...)
//
// The interceptors read egressd-criticality and egressd-timeout-ms from
// the call's metadata under package serve's rules (the criticality within
// CriticalityOptions.Ceiling, the timeout only when it is sooner than the
// deadline the call has), remove both from the metadata the handler sees,
// then ask every policy naming the method for a permit, held until the
// handler returns. A refusal is RESOURCE_EXHAUSTED with the limiter's hint
// in the grpc-retry-pushback-ms trailer (rounded up to the millisecond); a
// limiter that could not decide, UNAVAILABLE. The Observer is package
// serve's, so servemetrics counts gRPC calls as it counts requests.
//
// Like package serve, it links neither the SDK nor the control API: the
// metadata's names and formats are package edge's, which both sides share.
package servegrpc
