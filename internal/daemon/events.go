package daemon

import (
	"context"
	"errors"
	"net/netip"
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
	// followKeepalive is how often a follower waiting for refusals is
	// sent an empty line: a failed write is how one that left is found.
	followKeepalive = 10 * time.Second
)

// eventLog keeps recent refusals and hands new ones to followers.
type eventLog struct {
	mu        sync.Mutex
	ring      []loader.Refusal
	next      int
	full      bool
	followers map[chan loader.Refusal]struct{}
	closed    bool
}

func newEventLog() *eventLog {
	return &eventLog{ring: make([]loader.Refusal, eventsKept), followers: map[chan loader.Refusal]struct{}{}}
}

func (l *eventLog) add(r loader.Refusal) {
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

// recent returns the kept refusals, oldest first.
func (l *eventLog) recent() []loader.Refusal {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.full {
		return append([]loader.Refusal(nil), l.ring[:l.next]...)
	}
	return append(append([]loader.Refusal(nil), l.ring[l.next:]...), l.ring[:l.next]...)
}

// follow subscribes to new refusals until cancel is called; with
// maxFollowers subscribed already, it refuses (ok is false).
func (l *eventLog) follow() (_ <-chan loader.Refusal, cancel func(), ok bool) {
	ch := make(chan loader.Refusal, 256)
	l.mu.Lock()
	switch {
	case l.closed:
		close(ch)
	case len(l.followers) >= maxFollowers:
		l.mu.Unlock()
		return nil, nil, false
	default:
		l.followers[ch] = struct{}{}
	}
	l.mu.Unlock()
	return ch, func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		if _, ok := l.followers[ch]; ok {
			delete(l.followers, ch)
			close(ch)
		}
	}, true
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

// attribute answers whether pid's connect() to dest was refused just now.
// The kernel notes each (process, destination) pair's latest refusal
// before connect() returns, so the answer needs no event and no wait.
func (d *Daemon) attribute(pid uint32, dest netip.AddrPort) (loader.Refusal, bool) {
	r, ok, err := d.dp.LastRefusal(pid, dest)
	if err != nil {
		d.log.Error("refusal attribution", "err", err)
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
			d.constrained(r.Rule)
		}
		d.events.add(r)
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
		d.mu.Lock()
		e := d.entries[s.Rule]
		var want loader.SampleKind
		if e != nil && e.ctrl != nil {
			want = e.kernelSampleKind()
		}
		d.mu.Unlock()
		if e != nil && e.ctrl != nil && s.Kind == want {
			// The kernel's time: samples arrive in batches.
			e.ctrl.Sample(s.Time, s.Latency)
		}
	}
}

func (e *entry) kernelSampleKind() loader.SampleKind {
	if e.kernel.Requests {
		return loader.SampleRequest
	}
	return loader.SampleConnect
}

// saturationTick is how often watchSaturation looks at adaptive rules'
// live connections.
const saturationTick = 50 * time.Millisecond

// watchSaturation marks adaptive rules constrained when their live
// connections reach the limit: in-flight at the limit is the other way a
// limit holds callers back. It ticks only while there are adaptive rules:
// a daemon without one does not wake twenty times a second for nothing.
func (d *Daemon) watchSaturation(ctx context.Context) {
	t := time.NewTicker(saturationTick)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		d.mu.Lock()
		adaptive := d.adaptive
		d.mu.Unlock()
		if len(adaptive) == 0 {
			t.Stop()
			select {
			case <-ctx.Done():
				return
			case <-d.adaptiveAdded:
			}
			t.Reset(saturationTick)
			continue
		}
		for _, e := range adaptive {
			live, err := d.dp.Live(e.spec.Name)
			if err == nil && live >= int64(e.ctrl.Limit()) {
				e.ctrl.Constrained()
			}
		}
	}
}
