package limit_test

import (
	"context"
	"errors"
	"slices"
	"testing"
	"testing/synctest"
	"time"

	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/pkg/adaptive"
	"github.com/egressd/egressd/pkg/limit"
	"github.com/egressd/egressd/pkg/sdk"
)

type result struct {
	id    int
	lease limit.Lease
	err   error
}

// The queue's tests run in synctest bubbles: a waiter is queued once the
// bubble is idle, and the limiter's wake-ups fire on its fake clock.

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

// queued waits until every other goroutine of the bubble is blocked, and
// checks that n callers are queued then.
func queued(t *testing.T, l *limit.Local, n int) {
	t.Helper()
	synctest.Wait()
	if got := l.Queued(); got != n {
		t.Fatalf("%d queued; want %d", got, n)
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

func TestQueueOldestFirst(t *testing.T) { synctest.Test(t, testQueueOldestFirst) }

func testQueueOldestFirst(t *testing.T) {
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

func TestQueueNewestFirst(t *testing.T) { synctest.Test(t, testQueueNewestFirst) }

func testQueueNewestFirst(t *testing.T) {
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
func TestQueueCancellation(t *testing.T) { synctest.Test(t, testQueueCancellation) }

func testQueueCancellation(t *testing.T) {
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
func TestQueueDeadline(t *testing.T) { synctest.Test(t, testQueueDeadline) }

func testQueueDeadline(t *testing.T) {
	l := mustNew(t, limit.Options{Concurrency: 1, QueueLimit: 1})
	held, _ := l.Acquire(context.Background())
	defer held.Release()
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	out := waiters(t, l, ctx, 1)
	if r := <-out; !errors.Is(r.err, context.DeadlineExceeded) || l.Queued() != 0 || time.Since(start) != time.Second {
		t.Fatalf("acquire past its deadline: %v after %v with %d queued; want DeadlineExceeded after 1s and none",
			r.err, time.Since(start), l.Queued())
	}
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
// in order, woken by the limiter's timer.
func TestQueuePerSecond(t *testing.T) { synctest.Test(t, testQueuePerSecond) }

func testQueuePerSecond(t *testing.T) {
	rec := &recorder{}
	l := mustNew(t, limit.Options{PerSecond: &limit.PerSecondOptions{Permits: 2, Burst: 1}, QueueLimit: 2, Observer: rec})
	ctx := context.Background()
	if _, err := l.Acquire(ctx); err != nil {
		t.Fatal(err)
	}
	out := waiters(t, l, ctx, 1, 2)
	_, err := l.Acquire(ctx)
	if rl, ok := sdk.AsRateLimited(err); !ok || rl.RetryAfter != 500*time.Millisecond || !errors.Is(err, limit.ErrQueueFull) {
		t.Fatalf("acquire on a full queue: %v; want a queue-full refusal, retry after 500ms", err)
	}
	clocktest.Advance(499 * time.Millisecond)
	if l.Queued() != 2 {
		t.Fatalf("1ms before the token: %d queued; want 2", l.Queued())
	}
	clocktest.Advance(time.Millisecond)
	if r := <-out; r.id != 1 || r.err != nil {
		t.Fatalf("waiter %d: %v; want waiter 1 served at 500ms", r.id, r.err)
	}
	none(t, out)
	clocktest.Advance(500 * time.Millisecond)
	if r := <-out; r.id != 2 || r.err != nil {
		t.Fatalf("waiter %d: %v; want waiter 2 served at 1s", r.id, r.err)
	}
	if rec.leases != [2]int{3, 1} || !slices.Equal(rec.waits, []time.Duration{0, 0, 500 * time.Millisecond, time.Second}) {
		t.Fatalf("observed leases %v, waits %v; want 3 acquired, 1 denied; waits 0, 0 (the refusal), 500ms, 1s", rec.leases, rec.waits)
	}
	if l.WakeupArmed() {
		t.Fatal("a wake-up is armed with an empty queue")
	}
}

func TestQueuePerWindow(t *testing.T) { synctest.Test(t, testQueuePerWindow) }

func testQueuePerWindow(t *testing.T) {
	l := mustNew(t, limit.Options{PerWindow: &limit.PerWindowOptions{Permits: 2, Window: 4 * time.Second, Segments: 4}, QueueLimit: 4})
	ctx := context.Background()
	l.Acquire(ctx)
	clocktest.Advance(time.Second)
	l.Acquire(ctx)
	out := waiters(t, l, ctx, 1, 2, 3)
	clocktest.Advance(3*time.Second - 1)
	if l.Queued() != 3 {
		t.Fatalf("1ns before the first segment leaves: %d queued", l.Queued())
	}
	clocktest.Advance(1) // 4s: segment 0 leaves, one permit
	if r := <-out; r.id != 1 {
		t.Fatalf("waiter %d served at 4s; want 1", r.id)
	}
	clocktest.Advance(time.Second) // 5s: segment 1 leaves
	if r := <-out; r.id != 2 {
		t.Fatalf("waiter %d served at 5s; want 2", r.id)
	}
	none(t, out)
	clocktest.Advance(3 * time.Second) // 8s: segment 4 (waiter 1's) leaves
	if r := <-out; r.id != 3 {
		t.Fatalf("waiter %d served at 8s; want 3", r.id)
	}
}

// TestQueueAdaptive: a queued adaptive limiter serves waiters as leases come
// back, and its lease's hold time starts when the waiter is served.
func TestQueueAdaptive(t *testing.T) { synctest.Test(t, testQueueAdaptive) }

func testQueueAdaptive(t *testing.T) {
	t0 := time.Now()
	l := mustNew(t, limit.Options{Adaptive: &adaptive.Options{Minimum: 1, Initial: 1, Maximum: 4}, QueueLimit: 1})
	ctx := context.Background()
	held, _ := l.Acquire(ctx)
	out := waiters(t, l, ctx, 1)
	clocktest.Advance(time.Hour) // queued for an hour
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
