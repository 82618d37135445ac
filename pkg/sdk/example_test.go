package sdk_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/egressd/egressd/pkg/sdk"
	"github.com/egressd/egressd/pkg/verdict"
)

// A refusal by a limiter in this process is Throttled and SelfImposed: it
// takes the throttled curve, honours the limiter's hint, and costs neither
// the retry budget nor the breaker anything.
func ExampleTry() {
	p := sdk.Defaults()
	p.MaxAttempts = 1 // show one attempt; a real policy would retry after 2s

	r := sdk.Try(context.Background(), p, func(ctx context.Context) (string, error) {
		return "", &sdk.RateLimitedError{Limiter: "payments", RetryAfter: 2 * time.Second}
	})

	refused := r.Attempts[0]
	fmt.Println(refused.Kind(), refused.SelfImposed())
	fmt.Println(r.Stop)
	rl, _ := sdk.AsRateLimited(r.Err)
	fmt.Println(rl.Limiter, rl.RetryAfter)
	fmt.Println(errors.Is(r.Err, sdk.ErrAttemptsExhausted))
	// Output:
	// Throttled true
	// attempts exhausted
	// payments 2s
	// true
}

// Admit guards each attempt with a decision rather than an error; here it
// sheds work nobody is waiting for.
func ExamplePolicy_admit() {
	overloaded := true
	p := sdk.Defaults()
	p.MaxAttempts = 1
	p.Admit = func(ctx context.Context, next sdk.NextAttempt) verdict.Verdict {
		if next.Criticality < sdk.Critical && overloaded {
			return verdict.Refused(time.Second)
		}
		return verdict.Verdict{} // OK: go ahead
	}
	call := func(ctx context.Context) (string, error) { return "done", nil }

	v, err := sdk.Run(context.Background(), p, call)
	fmt.Println(v, err)
	_, err = sdk.Run(sdk.WithCriticality(context.Background(), sdk.Sheddable), p, call)
	fmt.Println(err)
	// Output:
	// done <nil>
	// attempts exhausted (1 attempt): not admitted: Throttled(self-imposed, retry after 1s)
}

// hedges holds, for ExampleTryHedged, which attempt contexts are hedges'.
var hedges sync.Map

// A hedge races a copy of an attempt that runs past the hedge's delay; the
// first answer wins and the other attempt is cancelled. Hedged calls go
// through RunHedged or TryHedged: Run refuses a policy with a Hedge.
func ExampleTryHedged() {
	p := sdk.Defaults()
	p.Hedge = sdk.NewHedge(sdk.HedgeOptions{Delay: time.Millisecond})
	call := func(ctx context.Context) (string, error) {
		if hedge, _ := hedges.Load(ctx); hedge != true {
			<-ctx.Done() // the first attempt hangs until the hedge answers
			return "", ctx.Err()
		}
		return "from the hedge", nil
	}
	// Admit is asked about each attempt, on the attempt's own context:
	// here, to tell the callback which attempts are hedges.
	p.Admit = func(ctx context.Context, next sdk.NextAttempt) verdict.Verdict {
		hedges.Store(ctx, next.Hedge)
		return verdict.Verdict{}
	}

	r := sdk.TryHedged(context.Background(), p, call)
	fmt.Println(r.Value)
	for _, a := range r.Attempts {
		fmt.Println(a.Hedge(), a.Lost())
	}
	_, err := sdk.Run(context.Background(), p, call)
	fmt.Println(errors.Is(err, sdk.ErrHedgeNeedsRunHedged))
	// Output:
	// from the hedge
	// false true
	// true false
	// true
}
