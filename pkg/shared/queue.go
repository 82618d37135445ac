package shared

import (
	"context"
	"time"

	"github.com/egressd/egressd/pkg/limit"
	"github.com/egressd/egressd/pkg/verdict"
)

// waiter is one caller queued in this process. Only the one at the front
// (the oldest, or the newest under NewestFirst) asks Redis; the others wait
// to be woken.
type waiter struct {
	prev, next *waiter
	wake       chan struct{} // buffered 1: became front, or was pushed out
	err        error         // the refusal, once pushed out; under mu
	out        bool          // no longer queued; under mu
}

func (l *Limiter) front() *waiter {
	if l.newest {
		return l.tail
	}
	return l.head
}

// remove takes w out of the queue and wakes the new front. Call with mu
// held.
func (l *Limiter) remove(w *waiter) {
	if w.out {
		return
	}
	w.out = true
	if w.prev != nil {
		w.prev.next = w.next
	} else {
		l.head = w.next
	}
	if w.next != nil {
		w.next.prev = w.prev
	} else {
		l.tail = w.prev
	}
	w.prev, w.next = nil, nil
	l.queued--
	l.wakeFrontLocked()
}

func (l *Limiter) wakeFrontLocked() {
	if f := l.front(); f != nil {
		select {
		case f.wake <- struct{}{}:
		default:
		}
	}
}

// wakeFront tells the first waiter to ask again: a local lease was released
// or lost.
func (l *Limiter) wakeFront() {
	if l.queueLimit == 0 {
		return
	}
	l.mu.Lock()
	l.wakeFrontLocked()
	l.mu.Unlock()
}

// acquireQueued is Acquire on a limiter with a queue.
func (l *Limiter) acquireQueued(ctx context.Context) (Lease, result, error) {
	l.mu.Lock()
	empty := l.head == nil
	l.mu.Unlock()
	wait := time.Duration(0)
	if empty {
		// Nobody waits: ask at once.
		lease, res, oc, err := l.try(ctx)
		if oc == admitted || oc == failed {
			return lease, res, err
		}
		wait = l.pause(res, oc)
	}

	w := &waiter{wake: make(chan struct{}, 1)}
	l.mu.Lock()
	if l.queued >= l.queueLimit {
		full := l.fullRefusal(wait)
		if !l.newest || l.head == nil {
			l.mu.Unlock()
			return Lease{}, result{}, full
		}
		oldest := l.head
		oldest.err = full
		l.remove(oldest)
		select {
		case oldest.wake <- struct{}{}:
		default:
		}
	}
	w.prev = l.tail
	if l.tail != nil {
		l.tail.next = w
	} else {
		l.head = w
	}
	l.tail = w
	l.queued++
	l.mu.Unlock()

	timer := time.NewTimer(wait)
	defer timer.Stop()
	timerC := timer.C
	for {
		select {
		case <-ctx.Done():
			l.mu.Lock()
			l.remove(w)
			l.mu.Unlock()
			return Lease{}, result{}, ctx.Err()
		case <-w.wake:
		case <-timerC:
			timerC = nil
		}
		l.mu.Lock()
		if w.err != nil {
			l.mu.Unlock()
			return Lease{}, result{}, w.err
		}
		front := l.front() == w
		l.mu.Unlock()
		if !front {
			continue
		}
		if timerC != nil {
			// Woken as front before our own pause is up (a release, or
			// the previous front left): ask now all the same.
			timer.Stop()
			timerC = nil
		}
		lease, res, oc, err := l.try(ctx)
		if oc == admitted || oc == failed {
			l.mu.Lock()
			l.remove(w)
			l.mu.Unlock()
			return lease, res, err
		}
		timer.Reset(l.pause(res, oc))
		timerC = timer.C
	}
}

// pause is how long the front waiter waits after a refusal before asking
// again: the refusal's RetryAfter, or the poll interval without one.
func (l *Limiter) pause(res result, oc outcome) time.Duration {
	if oc == refused && res.retry > 0 {
		return res.retry
	}
	return l.poll
}

// fullRefusal is the refusal of a caller that could not wait.
func (l *Limiter) fullRefusal(wait time.Duration) error {
	if l.conc {
		return l.queueFull
	}
	return &verdict.RateLimitedError{Limiter: l.name, RetryAfter: wait, Err: limit.ErrQueueFull}
}
