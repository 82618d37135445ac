package limit

import (
	"context"
	"time"

	"github.com/egressd/egressd/pkg/verdict"
)

// waiter is one caller in the queue.
type waiter struct {
	prev, next *waiter
	ready      chan struct{} // closed once done
	done       bool          // granted or refused; under mu
	err        error         // the refusal, when it was pushed out
	seg        int64         // the window segment a granted permit counts in
}

// queue is a list of waiters, oldest at head.
type queue struct {
	head, tail *waiter
	len        int
}

func (q *queue) push(w *waiter) {
	w.prev, w.next = q.tail, nil
	if q.tail != nil {
		q.tail.next = w
	} else {
		q.head = w
	}
	q.tail = w
	q.len++
}

func (q *queue) remove(w *waiter) {
	if w.prev != nil {
		w.prev.next = w.next
	} else {
		q.head = w.next
	}
	if w.next != nil {
		w.next.prev = w.prev
	} else {
		q.tail = w.prev
	}
	w.prev, w.next = nil, nil
	q.len--
}

// timer is the one pending wake-up of a rate limiter with waiters: the
// instant the waiter next in line may be served.
type timer struct {
	t     *time.Timer
	at    int64 // tick
	armed bool
	gen   uint64 // tells the current timer's call from a stopped one's
}

// acquireQueued is Acquire on a limiter with a queue.
func (l *Local) acquireQueued(ctx context.Context) (Lease, error) {
	start := l.tick()
	l.mu.Lock()
	// Waiters first, with whatever is free now: a newcomer never takes a
	// permit past someone already waiting for it.
	var wait time.Duration
	if l.queue.len > 0 {
		wait = l.dispatch(start)
	}
	if l.queue.len == 0 {
		ok, w := l.take(start)
		if ok {
			seg := l.window.taken
			l.mu.Unlock()
			lease := l.lease(start)
			l.observeQueued(lease, nil, 0, seg)
			return lease, nil
		}
		wait = w
	}
	if err := ctx.Err(); err != nil {
		l.mu.Unlock()
		l.observeQueued(Lease{}, err, 0, 0)
		return Lease{}, err
	}
	if l.queue.len >= l.queueLimit {
		refusal := l.refusal(wait, true)
		if !l.newest {
			l.mu.Unlock()
			l.observeQueued(Lease{}, refusal, 0, 0)
			return Lease{}, refusal
		}
		oldest := l.queue.head
		l.queue.remove(oldest)
		oldest.done, oldest.err = true, refusal
		close(oldest.ready)
	}
	w := &waiter{ready: make(chan struct{})}
	l.queue.push(w)
	l.arm(start, wait)
	l.mu.Unlock()

	select {
	case <-w.ready:
	case <-ctx.Done():
		l.mu.Lock()
		if !w.done {
			l.queue.remove(w)
			w.done = true
		} else if w.err == nil {
			// Granted as the context ended: pass the permit on.
			l.giveBack(w)
		}
		l.mu.Unlock()
		err := ctx.Err()
		l.observeQueued(Lease{}, err, time.Duration(l.tick()-start), 0)
		return Lease{}, err
	}
	end := l.tick()
	if w.err != nil {
		l.observeQueued(Lease{}, w.err, time.Duration(end-start), 0)
		return Lease{}, w.err
	}
	lease := l.lease(end)
	l.observeQueued(lease, nil, time.Duration(end-start), w.seg)
	return lease, nil
}

func (l *Local) observeQueued(lease Lease, err error, waited time.Duration, seg int64) {
	if l.obs != nil {
		l.observeHeld(lease, err, waited, true, seg)
	}
}

// take takes a permit at now (a tick) if one is free; when none is, a rate
// shape says how long until one is. Call with mu held.
func (l *Local) take(now int64) (bool, time.Duration) {
	if l.inFlightShape() {
		return l.tryInFlight(), 0
	}
	wait := l.takeRate(now)
	return wait == 0, wait
}

// lease is the lease for a permit handed over at at.
func (l *Local) lease(at int64) Lease {
	if l.inFlightShape() {
		return Lease{l: l, at: at}
	}
	return Lease{}
}

// refusal is the error for a caller refused with the hint wait, because no
// permit was free, or (full) because it could not wait for one.
func (l *Local) refusal(wait time.Duration, full bool) error {
	if l.inFlightShape() {
		if full {
			return l.queueFull
		}
		return l.refused
	}
	rl := &verdict.RateLimitedError{Limiter: l.name, RetryAfter: wait}
	if full {
		rl.Err = ErrQueueFull
	}
	return rl
}

// dispatch hands the permits free at now to waiters, in queue order, and
// returns how long a rate shape says the next one in line must wait (zero
// once the queue is empty, and always for the concurrency shapes, whose
// permits come back through Release). A concurrency shape ignores now. Call
// with mu held.
func (l *Local) dispatch(now int64) time.Duration {
	for l.queue.len > 0 {
		w := l.queue.head
		if l.newest {
			w = l.queue.tail
		}
		ok, wait := l.take(now)
		if !ok {
			return wait
		}
		l.queue.remove(w)
		w.done, w.seg = true, l.window.taken
		close(w.ready)
	}
	return 0
}

// giveBack returns a permit granted to a waiter that left without it, and
// passes it on. Call with mu held.
func (l *Local) giveBack(w *waiter) {
	switch l.shape {
	case perSecond:
		l.bucket.refund()
	case perWindow:
		l.window.refund(w.seg)
	default:
		l.inFlight.Add(-1)
	}
	if l.queue.len > 0 {
		now := l.tick()
		if wait := l.dispatch(now); l.queue.len > 0 {
			l.arm(now, wait)
		}
	}
}

// refundRate gives back a rate permit taken in window segment seg that its
// caller never got.
func (l *Local) refundRate(seg int64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.giveBack(&waiter{seg: seg})
}

// arm makes sure a rate limiter wakes its queue wait after now, unless a
// wake-up at or before that is already pending. Call with mu held.
func (l *Local) arm(now int64, wait time.Duration) {
	if wait <= 0 {
		return
	}
	at := now + int64(wait)
	t := &l.timer
	if t.armed && t.at <= at {
		return
	}
	if t.t != nil {
		t.t.Stop()
	}
	t.gen++
	gen := t.gen
	t.at, t.armed = at, true
	t.t = time.AfterFunc(wait, func() { l.fire(gen) })
}

// fire is the timer's call: serve whoever can be served now, and wait for
// the next.
func (l *Local) fire(gen uint64) {
	now := l.tick()
	l.mu.Lock()
	defer l.mu.Unlock()
	if gen == l.timer.gen {
		l.timer.armed = false
	}
	if l.queue.len == 0 {
		return
	}
	if wait := l.dispatch(now); l.queue.len > 0 {
		l.arm(now, wait)
	}
}
