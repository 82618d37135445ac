package sdk

import (
	"context"
	"time"

	"github.com/egressd/egressd/pkg/edge"
)

// Criticality, the context that carries it and the headers that take it
// and the caller's remaining time across a process's edge are package
// edge's, which the serving side shares without the SDK. They are the
// SDK's too, under the same names; see package edge for each.
type Criticality = edge.Criticality

const (
	Sheddable     = edge.Sheddable
	SheddablePlus = edge.SheddablePlus
	Critical      = edge.Critical
	CriticalPlus  = edge.CriticalPlus

	CriticalityHeader = edge.CriticalityHeader
	TimeoutHeader     = edge.TimeoutHeader
)

// WithCriticality returns a context carrying c.
func WithCriticality(ctx context.Context, c Criticality) context.Context {
	return edge.WithCriticality(ctx, c)
}

// CriticalityFrom returns the criticality carried by ctx, or Critical.
func CriticalityFrom(ctx context.Context) Criticality { return edge.CriticalityFrom(ctx) }

// LookupCriticality returns the criticality ctx carries, and whether it
// carries one (edge.LookupCriticality).
func LookupCriticality(ctx context.Context) (Criticality, bool) { return edge.LookupCriticality(ctx) }

// ParseCriticality reads a CriticalityHeader value (edge.ParseCriticality).
func ParseCriticality(s string) (Criticality, bool) { return edge.ParseCriticality(s) }

// FormatTimeout formats a TimeoutHeader value (edge.FormatTimeout).
func FormatTimeout(d time.Duration) string { return edge.FormatTimeout(d) }

// ParseTimeout reads a TimeoutHeader value (edge.ParseTimeout).
func ParseTimeout(s string) (time.Duration, bool) { return edge.ParseTimeout(s) }
