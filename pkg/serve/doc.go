// Package serve is the serving side: net/http middleware that limits the
// requests a service accepts, per route and per partition of its callers,
// and carries the callers' criticality and deadline across the process edge.
//
//	m, err := serve.New(serve.Options{
//		Policies: []serve.Policy{
//			{Name: "api", Limiter: partition.Options{
//				Local: &limit.Options{PerSecond: &limit.PerSecondOptions{Permits: 500}},
//			}},
//			{Name: "per-client", Partition: serve.ByClientIP, Limiter: partition.Options{
//				Shared: &shared.Options{TokenBucket: &shared.TokenBucketOptions{
//					TokenLimit: 20, TokensPerPeriod: 5, ReplenishmentPeriod: 10 * time.Second}},
//				Redis: rdb,
//			}},
//		},
//		Observer: metrics, // servemetrics.New(), registered on your registry
//	})
//	mux := http.NewServeMux()
//	mux.Handle("GET /status", m.Handler("api", status))
//	mux.Handle("POST /work", m.Handler("per-client", work))
//	srv := &http.Server{Handler: m.Edge(mux)}
//
// # Policies
//
// A policy is a name, a partition selector and what each partition gets: a
// partition.Options, so every shape of package limit (Local) and package
// shared (Shared, a budget in Redis shared by every replica) works, each
// partition made on first use and evicted once idle without touching its
// Redis state. Without a selector a policy is one budget for all its
// requests.
//
// A request a policy admits runs its handler holding a permit, given back
// when the handler returns: for a concurrency shape the permit is the
// request in flight. Without a queue (QueueLimit 0, the default) a request
// that finds no permit is refused at once; with one it waits in order, no
// longer than its context - the client going away, or the deadline it sent,
// ends the wait.
//
// A request not admitted is answered by the Reject hook, DefaultReject
// unless set: 429 Too Many Requests for a refusal, with Retry-After in
// whole seconds, rounded up, when the limiter knows when a permit will be
// free (rate shapes do, concurrency shapes do not), and for a request whose
// context ended in the queue; 503 Service Unavailable when the limiter
// could not decide (a shared limiter with FailureMode Throw and Redis
// down). A shared limiter with FailureMode Deny refuses instead, Allow
// admits.
//
// # Criticality and deadlines across the edge
//
// A client stack with sdkhttp's Propagate step sends its caller's
// criticality and the time it will still wait in edge.CriticalityHeader and
// edge.TimeoutHeader. The middleware reads them into the request's context
// before any policy decides, so that the handler's own calls - their Admit
// hooks, their retry budgets, and with Propagate the next hop - see the
// level the first caller set, and none of them outlives its deadline:
//
//   - The criticality is the header's, but never above
//     CriticalityOptions.Ceiling (Critical unless raised): a caller cannot
//     promote its work past what the server allows. A missing header, an
//     unknown name or a header sent twice gives CriticalityOptions.Default
//     (Critical unless set); nothing malformed is guessed at.
//   - The timeout becomes a context deadline when it is sooner than the one
//     the request has; it never extends it. A malformed or negative value
//     is ignored.
//
// Both headers are then removed from the request, so that a handler that
// forwards it does not pass the caller's claims on unchecked. The
// middleware itself never sheds by criticality: what Sheddable work should
// cost depends on what a service does, so that decision stays with an Admit
// hook, which reads the level (edge.CriticalityFrom).
//
// # Metrics
//
// State reaches metrics through an [Observer]: requests by policy and
// outcome, the time admission took, partitions held, and what became of
// each edge header. Package servemetrics implements it with Prometheus;
// this package imports no Prometheus, and a test holds it to that.
package serve
