// Package serve is the serving side: net/http middleware that limits the
// requests a service accepts, per route and per partition of its callers,
// and carries the callers' criticality and deadline across the process edge.
//
//	m, err := serve.New(serve.Options{
//		Policies: []serve.Policy{{
//			Name: "per-client", Partition: serve.ByClientIP,
//			Limiter: partition.Options{Local: &limit.Options{Concurrency: 20}},
//		}},
//		Observer: metrics, // servemetrics.New(), registered on your registry
//	})
//	mux.Handle("POST /work", m.Handler("per-client", work))
//	srv := &http.Server{Handler: m.Edge(mux)}
//
// A [Policy] is a name, a partition selector and a partition.Options: any
// shape of package limit, or of package shared for a budget every replica
// spends. An admitted request holds its permit until its handler returns;
// one not admitted is answered by Options.Reject ([DefaultReject]: 429 with
// Retry-After in whole seconds, rounded up, or 503 when the limiter could
// not decide). Handler panics on a policy name New was not given: that is
// a wiring mistake, like a bad ServeMux pattern.
//
// The middleware reads the criticality and timeout headers that sdkhttp's
// Propagate sends into the request's context, the criticality never above
// CriticalityOptions.Ceiling and the deadline never later than the one the
// request has, then removes them. It never sheds by criticality: an Admit
// hook decides that. Metrics go through an [Observer] (package servemetrics);
// this package imports no Prometheus. docs/serving.md is the guide.
package serve
