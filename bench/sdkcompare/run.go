package main

import (
	"context"
	"testing"
	"time"

	"github.com/failsafe-go/failsafe-go"
	"github.com/failsafe-go/failsafe-go/budget"
	"github.com/failsafe-go/failsafe-go/circuitbreaker"
	"github.com/failsafe-go/failsafe-go/retrypolicy"

	"github.com/egressd/egressd/pkg/sdk"
)

// The target: sdk.Run on the success path allocates nothing and
// takes at most 0.5× the time of failsafe-go's retry policy executor on the
// same callback. Every pair below makes one successful call per iteration.
//
// Each executor and policy is built once, outside the timed loop, and
// shared by every iteration, as a service would share one per dependency:
// only the call is timed. failsafe-go's callback takes no context (Get), so
// it is handed the SDK's callback closed over the caller's context, built
// once too.

// work is the callback both libraries call: a value and no error.
func work(context.Context) (int, error) { return 42, nil }

const workValue = 42

// failsafeWork is work as failsafe-go's Get takes it.
func failsafeWork(ctx context.Context) func() (int, error) {
	return func() (int, error) { return work(ctx) }
}

var runTable = table{
	title:  "sdk.Run vs failsafe-go",
	ours:   "sdk.Run",
	theirs: "failsafe-go",
	pairs:  runPairs,
	target: "every row, 0 allocs/op and ≤ 0.5× failsafe-go",
}

var runPairs = []pair{
	// The target's comparison: everything sdk.Defaults does - retries,
	// budget, breaker - against failsafe-go's retry policy alone.
	{name: "Defaults | retry", ours: sdkRun(sdk.Defaults), theirs: failsafeGet(failsafeRetry), target: 0.5, zeroAllocs: true},
	// The same guards on both sides: a retry policy shaped like Defaults'
	// and a breaker shaped like Defaults'.
	{name: "Defaults | retry+breaker", ours: sdkRun(sdk.Defaults), theirs: failsafeGet(failsafeRetryBreaker), target: 0.5, zeroAllocs: true},
	// ... and failsafe-go's retry budget too (a cap on concurrent retries
	// rather than the SDK's token bucket, but the nearest it has).
	{name: "Defaults | retry+budget+breaker", ours: sdkRun(sdk.Defaults), theirs: failsafeGet(failsafeRetryBudgetBreaker), target: 0.5, zeroAllocs: true},
	// The floor on each side: no guards at all.
	{name: "zero policy | retry", ours: sdkRun(zeroPolicy), theirs: failsafeGet(failsafeRetry), target: 0.5, zeroAllocs: true},
}

func zeroPolicy() *sdk.Policy { return &sdk.Policy{} }

// failsafeRetry is failsafe-go's retry policy with its defaults: three
// attempts, no delay.
func failsafeRetry() failsafe.Executor[int] {
	return failsafe.With[int](retrypolicy.NewWithDefaults[int]())
}

// defaultsRetry is a retry policy shaped like sdk.Defaults' transient
// curve: three attempts, 100ms doubling to at most 30s, half of it jitter.
func defaultsRetry() retrypolicy.Builder[int] {
	return retrypolicy.NewBuilder[int]().
		WithMaxAttempts(3).
		WithBackoff(100*time.Millisecond, 30*time.Second).
		WithJitterFactor(0.5)
}

// defaultsBreaker is a breaker shaped like sdk.Defaults': open after five
// consecutive failures, for five seconds.
func defaultsBreaker() circuitbreaker.CircuitBreaker[int] {
	return circuitbreaker.NewBuilder[int]().
		WithFailureThreshold(5).
		WithDelay(5 * time.Second).
		Build()
}

// failsafeRetryBreaker is Retry(Breaker(fn)): every attempt, retries
// included, goes through the breaker, as in sdk.Run.
func failsafeRetryBreaker() failsafe.Executor[int] {
	return failsafe.With[int](defaultsRetry().Build(), defaultsBreaker())
}

// failsafeRetryBudgetBreaker adds a retry budget of 10% with a floor of ten
// concurrent retries, like sdk.Defaults' 10% with a burst of ten.
func failsafeRetryBudgetBreaker() failsafe.Executor[int] {
	b := budget.NewBuilder().WithMaxRate(0.1).WithMinConcurrency(10).Build()
	return failsafe.With[int](defaultsRetry().WithBudget(b).Build(), defaultsBreaker())
}

func sdkRun(newPolicy func() *sdk.Policy) func(b *testing.B) {
	return func(b *testing.B) {
		p, ctx := newPolicy(), background()
		b.ReportAllocs()
		for b.Loop() {
			if v, err := sdk.Run(ctx, p, work); err != nil || v != workValue {
				b.Fatal(v, err)
			}
		}
	}
}

func failsafeGet(newExecutor func() failsafe.Executor[int]) func(b *testing.B) {
	return func(b *testing.B) {
		ctx := background()
		e, fn := newExecutor().WithContext(ctx), failsafeWork(ctx)
		b.ReportAllocs()
		for b.Loop() {
			if v, err := e.Get(fn); err != nil || v != workValue {
				b.Fatal(v, err)
			}
		}
	}
}
