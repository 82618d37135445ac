package shared

import (
	"context"
	"time"
)

// Lease is a permit held, with package limit's contract: Release it once,
// through the variable Acquire returned, however the work ended; Release
// zeroes it, so a second call does nothing. A rate permit is spent when
// taken, and its Release does nothing: a window or bucket permit is never
// refunded. The zero Lease holds nothing; so does one granted under
// FailureMode Allow, which Redis never saw.
//
// A concurrency lease is an entry in Redis that expires LeaseDuration after
// its latest renewal; a goroutine renews it every third of that until
// Release. Renewal is best effort: if Redis is unreachable for a whole
// LeaseDuration the entry expires, another caller may take the capacity,
// and this lease is not told (there is no fencing). A lease found expired is
// not recreated.
type Lease struct {
	h *held
}

// held is a concurrency lease's state.
type held struct {
	l    *Limiter
	id   string
	stop chan struct{}
	done chan struct{}
}

func (l *Limiter) hold(id string) Lease {
	h := &held{l: l, id: id, stop: make(chan struct{}), done: make(chan struct{})}
	go h.renew()
	return Lease{h: h}
}

// Release frees a concurrency permit: it stops the renewal, deletes the
// entry (waiting at most LeaseDuration for Redis; an entry left behind
// expires), then wakes this process's queue. It is safe on the zero Lease
// and on one already released.
func (ls *Lease) Release() {
	h := ls.h
	if h == nil {
		return
	}
	ls.h = nil
	close(h.stop)
	<-h.done
	l := h.l
	ctx, cancel := context.WithTimeout(context.Background(), l.lease)
	_ = releaseLua.Run(ctx, l.client, l.key, h.id).Err() // left to expire on error
	cancel()
	l.wakeFront()
}

func (h *held) renew() {
	defer close(h.done)
	l := h.l
	every := l.lease / 3
	t := time.NewTicker(every)
	defer t.Stop()
	us := l.lease.Microseconds()
	for {
		select {
		case <-h.stop:
			return
		case <-t.C:
		}
		ctx, cancel := context.WithTimeout(context.Background(), every)
		n, err := renewLua.Run(ctx, l.client, l.key, us, h.id).Int()
		cancel()
		if err == nil && n == 0 {
			// Expired or deleted: it is gone for good; its capacity may
			// already be someone else's.
			l.wakeFront()
			return
		}
	}
}
