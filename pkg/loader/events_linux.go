//go:build linux

package loader

import (
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/cilium/ebpf/ringbuf"
	"golang.org/x/sys/unix"
)

// ErrClosed is returned by a reader's Read after Close.
var ErrClosed = errors.New("reader closed")

// ErrDeadline is returned by a reader's Read when its deadline passes.
var ErrDeadline = os.ErrDeadlineExceeded

// pollEvery is how often a reader looks for records: the kernel wakes it
// only once wakeBytes of them are waiting, so that a burst of records costs
// no wakeup each.
const pollEvery = 100 * time.Millisecond

// ringReader reads records from a ring buffer, polling between wakeups.
type ringReader struct {
	rd       *ringbuf.Reader
	rec      ringbuf.Record
	deadline time.Time
}

func newRingReader(m *ebpf.Map) (*ringReader, error) {
	rd, err := ringbuf.NewReader(m)
	if err != nil {
		return nil, err
	}
	return &ringReader{rd: rd}, nil
}

// next returns the next record's bytes, valid until the next call.
func (r *ringReader) next(size int) ([]byte, error) {
	for {
		wake := time.Now().Add(pollEvery)
		if !r.deadline.IsZero() && r.deadline.Before(wake) {
			wake = r.deadline
		}
		r.rd.SetDeadline(wake)
		err := r.rd.ReadInto(&r.rec)
		switch {
		case err == nil:
			if len(r.rec.RawSample) < size {
				return nil, fmt.Errorf("record of %d bytes, want %d", len(r.rec.RawSample), size)
			}
			return r.rec.RawSample, nil
		case errors.Is(err, os.ErrDeadlineExceeded):
			if !r.deadline.IsZero() && !time.Now().Before(r.deadline) {
				return nil, ErrDeadline
			}
		case errors.Is(err, ringbuf.ErrClosed), errors.Is(err, os.ErrClosed):
			return nil, ErrClosed
		default:
			return nil, err
		}
	}
}

// RefusalReader reads refusal events in the order the kernel wrote them.
// Events written while no reader runs wait in the pinned ring buffer, up to
// its size; what does not fit is counted in Lost. An event may stand for
// many refusals (Refusal.Count), and reaches the reader within a tenth of a
// second.
type RefusalReader struct {
	d  *Datapath
	rd *ringReader
}

// Refusals opens a reader of refusal events. Only one reader should run at
// a time: each event is delivered once.
func (d *Datapath) Refusals() (*RefusalReader, error) {
	rd, err := newRingReader(d.objs.Refusals)
	if err != nil {
		return nil, fmt.Errorf("refusal reader: %w", err)
	}
	return &RefusalReader{d: d, rd: rd}, nil
}

// SetDeadline makes Read return ErrDeadline once t has passed; the zero
// time blocks.
func (r *RefusalReader) SetDeadline(t time.Time) { r.rd.deadline = t }

// Read blocks for the next refusal event.
func (r *RefusalReader) Read() (Refusal, error) {
	raw, err := r.rd.next(int(unsafe.Sizeof(egressdRefusal{})))
	if err != nil {
		return Refusal{}, err
	}
	e := (*egressdRefusal)(unsafe.Pointer(&raw[0]))
	return Refusal{
		Time:       monotonicToWall(e.TimeNs),
		PID:        e.Pid,
		Cgroup:     e.Cgroup,
		Rule:       r.d.ruleName(e.Rule, e.Gen),
		Dest:       netip.AddrPortFrom(netip.AddrFrom16(e.Addr).Unmap(), e.Port),
		Shape:      Shape(e.Shape),
		Shadow:     e.Shadow != 0,
		RetryAfter: time.Duration(e.RetryAfterNs),
		Count:      e.Count,
	}, nil
}

// Close unblocks a pending Read.
func (r *RefusalReader) Close() error { return r.rd.rd.Close() }

// LastRefusal returns the latest refusal of process pid's connect() to
// dest, if the kernel still remembers one: it keeps the latest of each
// (process, destination) pair, forgetting the least recently refused
// pairs beyond 16,384. It is written before connect() returns, so a
// caller asking after its EPERM finds it at once. Shape and Cgroup are
// not kept.
func (d *Datapath) LastRefusal(pid uint32, dest netip.AddrPort) (Refusal, bool, error) {
	key := egressdRefusalKey{Pid: pid, Port: dest.Port(), Addr: dest.Addr().As16()}
	var n egressdRefusalNote
	err := d.objs.RefusalNotes.Lookup(&key, &n)
	if errors.Is(err, ebpf.ErrKeyNotExist) {
		return Refusal{}, false, nil
	}
	if err != nil {
		return Refusal{}, false, fmt.Errorf("read refusal note: %w", err)
	}
	return Refusal{
		Time:       monotonicToWall(n.TimeNs),
		PID:        pid,
		Rule:       d.ruleName(n.Rule, n.Gen),
		Dest:       dest,
		Shadow:     n.Shadow != 0,
		RetryAfter: time.Duration(n.RetryAfterNs),
		Count:      1,
	}, true, nil
}

// SampleReader reads latency samples of rules with Samples set.
type SampleReader struct {
	d  *Datapath
	rd *ringReader
}

// Samples opens a reader of latency samples. Only one reader should run at
// a time. Samples reach it within a tenth of a second, in batches.
func (d *Datapath) Samples() (*SampleReader, error) {
	rd, err := newRingReader(d.objs.Samples)
	if err != nil {
		return nil, fmt.Errorf("sample reader: %w", err)
	}
	return &SampleReader{d: d, rd: rd}, nil
}

// SetDeadline makes Read return ErrDeadline once t has passed.
func (r *SampleReader) SetDeadline(t time.Time) { r.rd.deadline = t }

// Read blocks for the next sample. A sample of a rule deleted since has an
// empty Rule.
func (r *SampleReader) Read() (Sample, error) {
	raw, err := r.rd.next(int(unsafe.Sizeof(egressdSample{})))
	if err != nil {
		return Sample{}, err
	}
	s := (*egressdSample)(unsafe.Pointer(&raw[0]))
	return Sample{
		Time:    monotonicToWall(s.TimeNs),
		Rule:    r.d.ruleName(s.Rule, s.Gen),
		Kind:    SampleKind(s.Kind),
		Latency: time.Duration(s.LatencyNs),
	}, nil
}

// Close unblocks a pending Read.
func (r *SampleReader) Close() error { return r.rd.rd.Close() }

// monotonicToWall converts a bpf_ktime_get_ns() stamp to wall time.
func monotonicToWall(ns uint64) time.Time {
	var ts unix.Timespec
	now := time.Now()
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		return now
	}
	return now.Add(-time.Duration(uint64(ts.Nano()) - ns))
}

// Recount counts the sockets holding a slot of each rule, by walking the
// kernel's TCP sockets, and sets that beside the kernel's counters. It sees
// the sockets of the calling process's network namespace only, and it is
// not an atomic snapshot: connections that open or close during the walk
// show as drift that the next pass does not repeat.
func (d *Datapath) Recount() (map[string]Recount, error) {
	it, err := link.AttachIter(link.IterOptions{Program: d.objs.EgressdRecount})
	if err != nil {
		return nil, fmt.Errorf("attach recount: %w", err)
	}
	defer it.Close()
	rd, err := it.Open()
	if err != nil {
		return nil, fmt.Errorf("open recount: %w", err)
	}
	defer rd.Close()
	raw, err := io.ReadAll(rd)
	if err != nil {
		return nil, fmt.Errorf("read recount: %w", err)
	}
	size := int(unsafe.Sizeof(egressdIterRec{}))
	if len(raw)%size != 0 {
		return nil, fmt.Errorf("recount: %d bytes is not a whole number of records", len(raw))
	}
	type tally struct{ live, inFlight int64 }
	counted := map[uint32]tally{}
	for off := 0; off < len(raw); off += size {
		rec := (*egressdIterRec)(unsafe.Pointer(&raw[off]))
		t := counted[rec.Rule]
		// A socket of a retired generation holds nothing of the rule
		// now in its slot.
		if d.slotGen(rec.Rule) != rec.Gen {
			continue
		}
		t.live++
		if rec.Awaiting != 0 {
			t.inFlight++
		}
		counted[rec.Rule] = t
	}

	d.mu.Lock()
	defer d.mu.Unlock()
	out := map[string]Recount{}
	for i, s := range d.t.slots {
		if !s.active {
			continue
		}
		st, err := d.stats(uint32(i))
		if err != nil {
			return nil, err
		}
		t := counted[uint32(i)]
		out[s.rule.Name] = Recount{Live: st.Live, Counted: t.live, InFlight: st.InFlight, CountedInFlight: t.inFlight}
	}
	return out, nil
}

func (d *Datapath) slotGen(idx uint32) uint32 {
	d.mu.Lock()
	defer d.mu.Unlock()
	if int(idx) >= len(d.t.slots) {
		return 0
	}
	return d.t.slots[idx].gen
}
