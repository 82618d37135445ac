package limit_test

import (
	"context"
	"fmt"
	"runtime"
	"time"

	"github.com/egressd/egressd/pkg/limit"
	"github.com/egressd/egressd/pkg/sdk"
)

// The limiter goes inside the callback, so each attempt takes a permit, and
// a refusal is an attempt the executor retries on the throttled curve at the
// limiter's hint, without charging the retry budget or the breaker.
func Example() {
	bulkhead, _ := limit.New(limit.Options{Name: "payments", Concurrency: 1})
	p := sdk.Defaults()
	p.MaxAttempts = 1 // show one attempt

	held, _ := bulkhead.Acquire(context.Background()) // someone else's call

	r := sdk.Try(context.Background(), p, func(ctx context.Context) (string, error) {
		lease, err := bulkhead.Acquire(ctx) // ctx is the attempt's
		if err != nil {
			return "", err
		}
		defer lease.Release()
		return "paid", nil
	})
	fmt.Println(r.Attempts[0].Kind(), r.Attempts[0].SelfImposed(), r.Err)

	held.Release()
	v, err := sdk.Run(context.Background(), p, func(ctx context.Context) (string, error) {
		lease, err := bulkhead.Acquire(ctx)
		if err != nil {
			return "", err
		}
		defer lease.Release()
		return "paid", nil
	})
	fmt.Println(v, err)
	// Output:
	// Throttled true attempts exhausted (1 attempt): rate limited by "payments"
	// paid <nil>
}

// A per-second limiter says when to come back: the time to the next token.
func ExamplePerSecond() {
	l := limit.PerSecond(2) // one second of burst: two permits at once
	ctx := context.Background()
	for range 3 {
		_, err := l.Acquire(ctx)
		if rl, ok := sdk.AsRateLimited(err); ok {
			fmt.Println(rl.Limiter, "refused; retry after about", rl.RetryAfter.Round(100*time.Millisecond))
			continue
		}
		fmt.Println("acquired")
	}
	// Output:
	// acquired
	// acquired
	// perSecond refused; retry after about 500ms
}

// With a queue, a caller waits for its turn, bounded by its context. One that
// finds the queue full is refused; one whose context ends first gets the
// context's error, not a refusal.
func ExampleOptions_queue() {
	l, _ := limit.New(limit.Options{Name: "db", Concurrency: 1, QueueLimit: 1})
	held, _ := l.Acquire(context.Background())
	defer held.Release()

	ctx, cancel := context.WithCancel(context.Background())
	waited := make(chan error)
	go func() {
		_, err := l.Acquire(ctx) // waits: the permit is held
		waited <- err
	}()
	for l.Queued() == 0 {
		runtime.Gosched()
	}

	_, err := l.Acquire(context.Background()) // the queue is full
	fmt.Println(err)
	cancel()
	err = <-waited
	fmt.Println(err, sdk.IsRateLimited(err))
	// Output:
	// rate limited by "db": queue full
	// context canceled false
}
