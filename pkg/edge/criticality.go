// Package edge is what crosses a process's edge with a request: how much
// the caller needs the work done (Criticality) and how long it will still
// wait, carried in two headers; and, from a gRPC server that refused the
// call, when to retry (PushbackKey). The SDK sends the headers and the
// serving side (pkg/serve, servegrpc) reads them; both use this package,
// which depends on nothing of egressd's, so that a server links neither the
// SDK nor the control API. Package sdk re-exports the criticality and the
// headers under the same names, package sdkgrpc the pushback.
package edge

import "context"

//go:generate go tool stringer -type=Criticality

// Criticality says how much the caller needs a piece of work done. It is
// carried in the context (WithCriticality), read by Admit hooks, and
// honoured by the retry budget, which will not hand its last half to work
// below Critical.
//
// The zero value is Critical, so work nobody labelled is treated as work
// somebody is waiting for; the order is Sheddable < SheddablePlus < Critical
// < CriticalPlus. Its String, the constant's name, is the value of
// CriticalityHeader.
type Criticality int8

const (
	// Sheddable: nobody is waiting; drop it first under load.
	Sheddable Criticality = -2
	// SheddablePlus: tolerates loss, e.g. batch work with retries of its own.
	SheddablePlus Criticality = -1
	// Critical: somebody is waiting. The default.
	Critical Criticality = 0
	// CriticalPlus: the most important work; shed last.
	CriticalPlus Criticality = 1
)

type criticalityKey struct{}

// WithCriticality returns a context carrying c.
func WithCriticality(ctx context.Context, c Criticality) context.Context {
	return context.WithValue(ctx, criticalityKey{}, c)
}

// CriticalityFrom returns the criticality carried by ctx, or Critical.
func CriticalityFrom(ctx context.Context) Criticality {
	if c, ok := ctx.Value(criticalityKey{}).(Criticality); ok {
		return c
	}
	return Critical
}
