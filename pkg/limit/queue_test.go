package limit_test

import (
	"context"
	"errors"
	"runtime"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/egressd/egressd/pkg/adaptive"
	"github.com/egressd/egressd/pkg/limit"
	"github.com/egressd/egressd/pkg/sdk"
)

type result struct {
	id    int
	lease limit.Lease
	err   error
}

// waiters starts one Acquire per id, in order, each queued before the next
// starts, and returns where their results arrive.
func waiters(t *testing.T, l *limit.Local, ctx context.Context, ids ...int) chan result {
	t.Helper()
	out := make(chan result, len(ids))
	for _, id := range ids {
		before := l.Queued()
		go func() {
			lease, err := l.Acquire(ctx)
			out <- result{id, lease, err}
		}()
		queued(t, l, before+1)
	}
	return out
}

// queued waits, without sleeping, until n callers are queued.
func queued(t *testing.T, l *limit.Local, n int) {
	t.Helper()
	for i := 0; l.Queued() != n; i++ {
		if i > 10_000_000 {
			t.Fatalf("%d queued; want %d", l.Queued(), n)
		}
		runtime.Gosched()
	}
}

// none checks that no result has arrived. A grant happens inside the Release
// or Advance that makes it, so where it matters the tests check Queued too.
func none(t *testing.T, out chan result) {
	t.Helper()
	select {
	case r := <-out:
		t.Fatalf("waiter %d finished early: %v", r.id, r.err)
	default:
	}
}

func TestQueueOldestFirst(t *testing.T) {
	rec := &recorder{}
	l := mustNew(t, limit.Options{Concurrency: 1, QueueLimit: 3, Observer: rec})
	ctx := context.Background()
	held, err := l.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	out := waiters(t, l, ctx, 1, 2, 3)
	// Full: a fourth caller is refused at once, and says why.
	_, err = l.Acquire(ctx)
	if rl, ok := sdk.AsRateLimited(err); !ok || !errors.Is(err, limit.ErrQueueFull) || rl.RetryAfter != 0 {
		t.Fatalf("acquire on a full queue: %v; want a refusal wrapping ErrQueueFull", err)
	}
	var order []int
	for range 3 {
		held.Release()
		r := <-out
		if r.err != nil {
			t.Fatalf("waiter %d: %v", r.id, r.err)
		}
		order = append(order, r.id)
		held = r.lease
	}
	held.Release()
	if !slices.Equal(order, []int{1, 2, 3}) || l.InFlight() != 0 || l.Queued() != 0 {
		t.Fatalf("served %v, %d in flight, %d queued; want [1 2 3], 0, 0", order, l.InFlight(), l.Queued())
	}
	if rec.leases != [2]int{4, 1} || len(rec.waits) != 5 {
		t.Fatalf("observed leases %v, %d waits; want 4 acquired, 1 denied, a wait for each of the 5", rec.leases, len(rec.waits))
	}
}

func TestQueueNewestFirst(t *testing.T) {
	l := mustNew(t, limit.Options{Concurrency: 1, QueueLimit: 2, QueueOrder: limit.NewestFirst})
	ctx := context.Background()
	held, _ := l.Acquire(ctx)
	out := waiters(t, l, ctx, 1, 2)
	// Full: the newcomer takes the oldest's place, and the oldest is refused.
	late := make(chan result, 1)
	go func() {
		lease, err := l.Acquire(ctx)
		late <- result{3, lease, err}
	}()
	if r := <-out; r.id != 1 || !errors.Is(r.err, limit.ErrQueueFull) || !sdk.IsRateLimited(r.err) {
		t.Fatalf("waiter %d: %v; want waiter 1 pushed out with a queue-full refusal", r.id, r.err)
	}
	queued(t, l, 2)
	held.Release()
	r := <-late
	if r.err != nil {
		t.Fatalf("newest waiter: %v", r.err)
	}
	r.lease.Release()
	if r = <-out; r.id != 2 || r.err != nil {
		t.Fatalf("waiter %d: %v; want waiter 2 served last", r.id, r.err)
	}
	r.lease.Release()
	if l.InFlight() != 0 || l.Queued() != 0 {
		t.Fatalf("%d in flight, %d queued", l.InFlight(), l.Queued())
	}
}

// TestQueueCancellation: a waiter whose context ends gets the context's
// error, not a refusal, and its place is given up.
func TestQueueCancellation(t *testing.T) {
	rec := &recorder{}
	l := mustNew(t, limit.Options{Concurrency: 1, QueueLimit: 2, Observer: rec})
	held, _ := l.Acquire(context.Background())
	ctx, cancel := context.WithCancel(context.Background())
	out := waiters(t, l, ctx, 1)
	cancel()
	r := <-out
	if !errors.Is(r.err, context.Canceled) || sdk.IsRateLimited(r.err) {
		t.Fatalf("cancelled waiter: %v; want context.Canceled", r.err)
	}
	if l.Queued() != 0 {
		t.Fatalf("%d still queued after the waiter left", l.Queued())
	}
	// The permit it waited for is there for the next caller.
	held.Release()
	next, err := l.Acquire(context.Background())
	if err != nil {
		t.Fatalf("after the waiter left: %v", err)
	}
	next.Release()
	if rec.leases != [2]int{2, 1} {
		t.Fatalf("observed %v; want 2 acquired and the cancelled one denied", rec.leases)
	}
}

// TestQueueDeadline: a waiter whose deadline passes gets DeadlineExceeded -
// the attempt's timeout, which is what it is - and gives up its place.
func TestQueueDeadline(t *testing.T) {
	l := mustNew(t, limit.Options{Concurrency: 1, QueueLimit: 1})
	held, _ := l.Acquire(context.Background())
	defer held.Release()
	ctx := &deadlineContext{Context: context.Background(), done: make(chan struct{})}
	out := waiters(t, l, ctx, 1)
	ctx.expire()
	if r := <-out; !errors.Is(r.err, context.DeadlineExceeded) || l.Queued() != 0 {
		t.Fatalf("acquire past its deadline: %v with %d queued; want DeadlineExceeded and none", r.err, l.Queued())
	}
}

// deadlineContext is a context whose deadline passes when the test says, not
// on the real clock.
type deadlineContext struct {
	context.Context
	done    chan struct{}
	expired atomic.Bool
}

func (c *deadlineContext) Done() <-chan struct{} { return c.done }

func (c *deadlineContext) Err() error {
	if c.expired.Load() {
		return context.DeadlineExceeded
	}
	return nil
}

func (c *deadlineContext) expire() {
	c.expired.Store(true)
	close(c.done)
}

func TestQueueDoneContextDoesNotQueue(t *testing.T) {
	l := mustNew(t, limit.Options{Concurrency: 1, QueueLimit: 1})
	held, _ := l.Acquire(context.Background())
	defer held.Release()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := l.Acquire(ctx); !errors.Is(err, context.Canceled) || l.Queued() != 0 {
		t.Fatalf("acquire with a done context: %v, %d queued", err, l.Queued())
	}
}

// TestQueuePerSecond: waiters are served as tokens fall due, one per token,
// in order, woken by the limiter's timer on the injected clock.
func TestQueuePerSecond(t *testing.T) {
	clock := limit.NewFakeClock(t0)
	rec := &recorder{}
	l := mustNew(t, limit.Options{PerSecond: &limit.PerSecondOptions{Permits: 2, Burst: 1}, QueueLimit: 2, Clock: clock, Observer: rec})
	ctx := context.Background()
	if _, err := l.Acquire(ctx); err != nil {
		t.Fatal(err)
	}
	out := waiters(t, l, ctx, 1, 2)
	_, err := l.Acquire(ctx)
	if rl, ok := sdk.AsRateLimited(err); !ok || rl.RetryAfter != 500*time.Millisecond || !errors.Is(err, limit.ErrQueueFull) {
		t.Fatalf("acquire on a full queue: %v; want a queue-full refusal, retry after 500ms", err)
	}
	clock.Advance(499 * time.Millisecond)
	if l.Queued() != 2 {
		t.Fatalf("1ms before the token: %d queued; want 2", l.Queued())
	}
	clock.Advance(time.Millisecond)
	if r := <-out; r.id != 1 || r.err != nil {
		t.Fatalf("waiter %d: %v; want waiter 1 served at 500ms", r.id, r.err)
	}
	none(t, out)
	clock.Advance(500 * time.Millisecond)
	if r := <-out; r.id != 2 || r.err != nil {
		t.Fatalf("waiter %d: %v; want waiter 2 served at 1s", r.id, r.err)
	}
	if rec.leases != [2]int{3, 1} || !slices.Equal(rec.waits, []time.Duration{0, 0, 500 * time.Millisecond, time.Second}) {
		t.Fatalf("observed leases %v, waits %v; want 3 acquired, 1 denied; waits 0, 0 (the refusal), 500ms, 1s", rec.leases, rec.waits)
	}
	if clock.Pending() != 0 {
		t.Fatalf("%d timers pending with an empty queue", clock.Pending())
	}
}

func TestQueuePerWindow(t *testing.T) {
	clock := limit.NewFakeClock(t0)
	l := mustNew(t, limit.Options{PerWindow: &limit.PerWindowOptions{Permits: 2, Window: 4 * time.Second, Segments: 4}, QueueLimit: 4, Clock: clock})
	ctx := context.Background()
	l.Acquire(ctx)
	clock.Advance(time.Second)
	l.Acquire(ctx)
	out := waiters(t, l, ctx, 1, 2, 3)
	clock.Advance(3*time.Second - 1)
	if l.Queued() != 3 {
		t.Fatalf("1ns before the first segment leaves: %d queued", l.Queued())
	}
	clock.Advance(1) // 4s: segment 0 leaves, one permit
	if r := <-out; r.id != 1 {
		t.Fatalf("waiter %d served at 4s; want 1", r.id)
	}
	clock.Advance(time.Second) // 5s: segment 1 leaves
	if r := <-out; r.id != 2 {
		t.Fatalf("waiter %d served at 5s; want 2", r.id)
	}
	none(t, out)
	clock.Advance(3 * time.Second) // 8s: segment 4 (waiter 1's) leaves
	if r := <-out; r.id != 3 {
		t.Fatalf("waiter %d served at 8s; want 3", r.id)
	}
}

// TestQueueNoBarging: a newcomer arriving when a token is due but the wake-up
// has not run yet does not take it from the waiter in front of it.
func TestQueueNoBarging(t *testing.T) {
	clock := limit.NewFakeClock(t0)
	l := mustNew(t, limit.Options{PerSecond: &limit.PerSecondOptions{Permits: 1}, QueueLimit: 1, Clock: clock})
	ctx := context.Background()
	l.Acquire(ctx)
	out := waiters(t, l, ctx, 1)
	clock.Jump(time.Second) // the token is due; the timer has not fired
	late := make(chan result, 1)
	go func() {
		lease, err := l.Acquire(ctx)
		late <- result{2, lease, err}
	}()
	// The newcomer serves the waiter in front of it, then waits itself.
	if r := <-out; r.id != 1 || r.err != nil {
		t.Fatalf("waiter %d: %v; want waiter 1 served by the newcomer's arrival", r.id, r.err)
	}
	queued(t, l, 1)
	none(t, late)
	clock.Advance(time.Second)
	if r := <-late; r.err != nil {
		t.Fatalf("newcomer: %v", r.err)
	}
}

// TestQueueAdaptive: a queued adaptive limiter serves waiters as leases come
// back, and its lease's hold time starts when the waiter is served.
func TestQueueAdaptive(t *testing.T) {
	clock := limit.NewFakeClock(t0)
	l := mustNew(t, limit.Options{Adaptive: &adaptive.Options{Minimum: 1, Initial: 1, Maximum: 4}, QueueLimit: 1, Clock: clock})
	ctx := context.Background()
	held, _ := l.Acquire(ctx)
	out := waiters(t, l, ctx, 1)
	clock.Advance(time.Hour) // queued for an hour
	held.Release()
	r := <-out
	if r.err != nil || l.InFlight() != 1 || !r.lease.HeldSince().Equal(t0.Add(time.Hour)) {
		t.Fatalf("waiter: %v, %d in flight, held since t0%+v; want held from t0+1h, not the hour queued",
			r.err, l.InFlight(), r.lease.HeldSince().Sub(t0))
	}
	r.lease.Release()
	if l.InFlight() != 0 {
		t.Fatalf("%d in flight after every release", l.InFlight())
	}
}
