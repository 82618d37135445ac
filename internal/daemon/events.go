package daemon

import (
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/egressd/egressd/pkg/loader"
)

// What the kernel reports, followed: refusals, kept for `egressd events`
// and to attribute a caller's EPERM; latency samples, fed to adaptive
// rules' loops; and live connections at an adaptive rule's limit, which
// mark it constrained.

const (
	// eventsKept is how many recent refusal events the daemon keeps for
	// `egressd events`. An event stands for a process's refusals by one
	// rule within a second (loader.Refusal.Count).
	eventsKept = 4096
	// attributionWindow is how recent a refusal must be to explain a
	// caller's EPERM.
	attributionWindow = 2 * time.Second
	// burstLogEvery bounds refusal logging to one line per rule per period.
	burstLogEvery = 10 * time.Second
	// maxFollowers bounds `egressd events --follow` streams at once, each
	// a goroutine, a connection and a buffer of events.
	maxFollowers = 64
	// readerFollowers is how many of them peers that may only read may
	// hold between them: with the socket open to every local service,
	// they could otherwise take every slot and keep them (a stream that
	// waits costs its peer nothing), and root's `events --follow` would be
	// refused. The rest are kept for writers.
	readerFollowers = 48
	// uidFollowers is how many of them one uid that may only read may
	// hold, so that one service cannot take the other services' slots.
	uidFollowers = 8
	// followKeepalive is how often a follower waiting for refusals is
	// sent an empty line: a failed write is how one that left is found.
	followKeepalive = 10 * time.Second
)

// event is what `egressd events` lists: a refusal, or the slots of a rule
// a recount gave back.
type event struct {
	loader.Refusal
	// gaveBack, when set, makes the event a recount's, of Refusal.Rule
	// at Refusal.Time; the rest of Refusal is empty.
	gaveBack *loader.Recount
}

// eventLog keeps recent events and hands new ones to followers.
type eventLog struct {
	mu        sync.Mutex
	ring      []event
	next      int
	full      bool
	followers map[chan event]follower
	closed    bool
}

// follower is who follows events: a writer, or a uid that may only read.
type follower struct {
	reader bool
	uid    uint32 // a reader's
}

func newEventLog() *eventLog {
	return &eventLog{ring: make([]event, eventsKept), followers: map[chan event]follower{}}
}

func (l *eventLog) add(r event) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.ring[l.next] = r
	l.next = (l.next + 1) % len(l.ring)
	l.full = l.full || l.next == 0
	for f := range l.followers {
		select {
		case f <- r:
		default: // a follower that does not keep up misses events
		}
	}
}

// recent returns the kept events, oldest first.
func (l *eventLog) recent() []event {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.recentLocked()
}

func (l *eventLog) recentLocked() []event {
	if !l.full {
		return append([]event(nil), l.ring[:l.next]...)
	}
	return append(append([]event(nil), l.ring[l.next:]...), l.ring[:l.next]...)
}

// follow subscribes who to new events until cancel is called, or says
// why it may not (admitFollower). It returns the kept events too, taken
// with the subscription, so that an event added meanwhile is in one of
// the two, never in both or neither.
func (l *eventLog) follow(who follower) (kept []event, _ <-chan event, cancel func(), err error) {
	ch := make(chan event, 256)
	l.mu.Lock()
	if l.closed {
		close(ch)
	} else {
		if err := admitFollower(slices.Collect(maps.Values(l.followers)), who); err != nil {
			l.mu.Unlock()
			return nil, nil, nil, err
		}
		l.followers[ch] = who
	}
	kept = l.recentLocked()
	l.mu.Unlock()
	return kept, ch, func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		if _, ok := l.followers[ch]; ok {
			delete(l.followers, ch)
			close(ch)
		}
	}, nil
}

// admitFollower says why who may not follow events beside following, or
// returns nil: at most maxFollowers in all, of whom readerFollowers may
// only read, uidFollowers of them under one uid.
func admitFollower(following []follower, who follower) error {
	var readers, uid int
	for _, f := range following {
		if f.reader {
			readers++
			if f.uid == who.uid {
				uid++
			}
		}
	}
	const again = "try again when one stops"
	switch {
	case who.reader && uid >= uidFollowers:
		return fmt.Errorf("uid %d follows events %d times already, the most egressd serves one uid without write access; %s", who.uid, uid, again)
	case who.reader && readers >= readerFollowers:
		return fmt.Errorf("%d clients without write access follow events already, the most egressd serves them (the other %d places are kept for writers); %s", readers, maxFollowers-readerFollowers, again)
	case len(following) >= maxFollowers:
		return fmt.Errorf("%d clients follow events already, the most egressd serves; %s", len(following), again)
	}
	return nil
}

func (l *eventLog) close() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.closed = true
	for f := range l.followers {
		delete(l.followers, f)
		close(f)
	}
}

// attribute answers whether pid's connect() to dest, or its UDP flow there
// for proto ProtoUDP, was refused just now. The kernel notes each
// (process, destination) pair's latest refusal before connect() or
// sendmsg() returns, so the answer needs no event and no wait.
func (a *api) attribute(pid uint32, proto loader.Protocols, dest netip.AddrPort) (loader.Refusal, bool) {
	r, ok, err := a.dp.LastRefusal(pid, proto, dest)
	if err != nil {
		a.log.Error("refusal attribution", "err", err)
		return loader.Refusal{}, false
	}
	if !ok || r.Shadow || r.Rule == "" || time.Since(r.Time) > attributionWindow {
		return loader.Refusal{}, false
	}
	return r, true
}

// followRefusals reads refusal events from the kernel until rd is closed:
// it keeps them, tells adaptive rules they were constrained, and logs
// bursts.
func (d *Daemon) followRefusals(rd reader[loader.Refusal]) {
	type burst struct {
		since time.Time
		count int
	}
	bursts := map[string]*burst{}
	for {
		r, err := rd.Read()
		if errors.Is(err, loader.ErrClosed) {
			return
		}
		if err != nil {
			d.log.Error("refusal events", "err", err)
			continue
		}
		// The loop hears of it before anyone can see it listed.
		if !r.Shadow {
			d.table.constrained(r.Rule)
		}
		d.events.add(event{Refusal: r})
		b := bursts[r.Rule]
		if b == nil {
			b = &burst{}
			bursts[r.Rule] = b
		}
		b.count += int(r.Count)
		if now := time.Now(); now.Sub(b.since) >= burstLogEvery {
			d.log.Info("connections refused", "rule", r.Rule, "count", b.count, "shadow", r.Shadow, "last_pid", r.PID, "last_dest", r.Dest.String())
			b.since, b.count = now, 0
		}
	}
}

// followSamples feeds latency samples to the adaptive loops until rd is
// closed.
func (d *Daemon) followSamples(rd reader[loader.Sample]) {
	for {
		s, err := rd.Read()
		if errors.Is(err, loader.ErrClosed) {
			return
		}
		if err != nil {
			d.log.Error("latency samples", "err", err)
			continue
		}
		d.table.sample(s)
	}
}
