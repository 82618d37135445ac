package sdk

import (
	"context"
	"testing"

	"github.com/egressd/egressd/pkg/verdict"
)

// BenchmarkRunSuccess measures the success path on the real clock. Policies
// without a deadline of their own pass the caller's context through and
// should allocate nothing; HTTPDefaults has an attempt timeout, so each
// attempt derives a context with context.WithDeadline.
func BenchmarkRunSuccess(b *testing.B) {
	admitting := Defaults()
	admitting.Admit = func(context.Context, NextAttempt) verdict.Verdict { return verdict.Verdict{} }
	for _, bm := range []struct {
		name string
		p    *Policy
	}{
		{"zero", &Policy{}},
		{"Defaults", Defaults()},
		{"Defaults+Admit", admitting},
		{"HTTPDefaults", HTTPDefaults()},
	} {
		b.Run(bm.name, func(b *testing.B) {
			ctx := context.Background()
			b.ReportAllocs()
			for b.Loop() {
				if _, err := Run(ctx, bm.p, succeed); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkTrySuccess is the same call returning the full Result; the
// attempt log is one allocation.
func BenchmarkTrySuccess(b *testing.B) {
	p := Defaults()
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		if r := Try(ctx, p, succeed); r.Err != nil {
			b.Fatal(r.Err)
		}
	}
}
