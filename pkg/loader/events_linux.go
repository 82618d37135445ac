//go:build linux

package loader

import (
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"sync"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/ringbuf"
)

// ErrClosed is returned by a reader's Read after Close.
var ErrClosed = errors.New("reader closed")

// ErrDeadline is returned by a reader's Read when its deadline passes.
var ErrDeadline = os.ErrDeadlineExceeded

// pollEvery is how often a reader looks for records: the kernel wakes it
// only once wakeBytes of them are waiting, so that a burst of records costs
// no wakeup each.
const pollEvery = 100 * time.Millisecond

// quietPollEvery is how seldom a refusal reader reads the runs once none
// came for an event interval, between the rings of its bell: its reads
// were nearly all an idle daemon's CPU (the runtime's wakeups for each).
const quietPollEvery = time.Second

// ringReader reads records from a ring buffer, polling between wakeups
// while records come. The kernel wakes it for a record unless another
// woke it less than wakeEvery before; those are found by the next poll.
// Once a wait of wakeEvery or more ends with nothing to read, the next
// record will wake the reader: it then waits without polling, so that an
// idle daemon does not wake ten times a second for nothing.
type ringReader struct {
	rd       *ringbuf.Reader
	rec      ringbuf.Record
	deadline time.Time
	quiet    bool // a wait of wakeEvery or more found nothing: no polling
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
		start := time.Now()
		var wake time.Time // zero: no deadline
		if !r.quiet {
			wake = start.Add(pollEvery)
		}
		if !r.deadline.IsZero() && (wake.IsZero() || r.deadline.Before(wake)) {
			wake = r.deadline
		}
		r.rd.SetDeadline(wake)
		err := r.rd.ReadInto(&r.rec)
		switch {
		case err == nil:
			r.quiet = false
			if len(r.rec.RawSample) < size {
				return nil, fmt.Errorf("record of %d bytes, want %d", len(r.rec.RawSample), size)
			}
			return r.rec.RawSample, nil
		case errors.Is(err, os.ErrDeadlineExceeded):
			if !r.deadline.IsZero() && !time.Now().Before(r.deadline) {
				return nil, ErrDeadline
			}
			// Nothing woke a wait of wakeEvery or more, and the ring is
			// read to its end: the next record will wake the reader.
			r.quiet = r.quiet || time.Since(start) >= wakeEvery
		case errors.Is(err, ringbuf.ErrClosed), errors.Is(err, os.ErrClosed):
			return nil, ErrClosed
		default:
			return nil, err
		}
	}
}

// RefusalReader reads refusal events. The kernel notes refusals per CPU,
// each record a run of one process's refusals to one destination: the run
// in progress, then a log of the last logSlots. The reader reads them every
// pollEvery (a tenth of that while they come fast); once no process has
// been refused for an event interval, the reads come twice as far apart
// each time up to quietPollEvery, and between them the reader sleeps
// until the kernel rings its bell at the next refusal. It sends an event per
// process and rule at most once per Config.EventInterval: the latest
// refusal, with Count the refusals since the last event, to whatever
// destination of the rule. A pair's last counts go out once the interval
// has passed. Refusals from before the reader opened are not sent. Runs the
// kernel overwrote before the reader got to them are counted in Lost.
type RefusalReader struct {
	d        *Datapath
	deadline time.Time
	closed   chan struct{}
	once     sync.Once

	seen    []logPos // per CPU, the newest run read and its count
	pairs   map[refusalPair]*pairState
	pending []Refusal     // read, not yet returned
	read    time.Time     // when the runs were last read
	every   time.Duration // from one read to the next
	busy    bool          // the last read found many runs: read again soon
	asleep  bool          // the bell is armed: wait on it
	bell    *ringbuf.Reader
	rang    ringbuf.Record
	armed   *ebpf.Memory // bell_armed
	log     []egressdRefusalNote
}

// logPos is how far a reader has read one CPU's runs.
type logPos struct {
	seq   uint32 // the newest run read
	count uint32 // its refusals read
}

// refusalPair is what an event is sent for: a process and the rule (slot
// and generation) that refused it, in shadow mode or not.
type refusalPair struct {
	pid    uint32
	rule   [2]uint32
	shadow uint8
}

type pairState struct {
	sent   time.Time // the last event
	latest egressdRefusalNote
	unsent uint64 // refusals since the last event
}

// Refusals opens a reader of refusal events. Only one reader should run at
// a time.
func (d *Datapath) Refusals() (*RefusalReader, error) {
	runs, err := d.refusalRuns()
	if err != nil {
		return nil, fmt.Errorf("refusal reader: %w", err)
	}
	m := d.maps()
	armed, err := m.BellArmed.Memory()
	if err != nil {
		return nil, fmt.Errorf("refusal reader: map bell: %w", err)
	}
	bell, err := ringbuf.NewReader(m.RefusalBell)
	if err != nil {
		return nil, fmt.Errorf("refusal reader: bell: %w", err)
	}
	r := &RefusalReader{d: d, closed: make(chan struct{}), pairs: map[refusalPair]*pairState{}, seen: make([]logPos, len(runs)),
		read: time.Now(), every: pollEvery, bell: bell, armed: armed}
	for cpu, run := range runs {
		r.seen[cpu] = logPos{seq: run.Cur.Seq, count: run.Cur.Count}
	}
	return r, nil
}

// SetDeadline makes Read return ErrDeadline once t has passed and a read of
// the runs then found no event; the zero time blocks.
func (r *RefusalReader) SetDeadline(t time.Time) { r.deadline = t }

// Close unblocks a pending Read.
func (r *RefusalReader) Close() error {
	r.once.Do(func() {
		close(r.closed)
		r.bell.Close()
	})
	return nil
}

// Read blocks for the next refusal event.
func (r *RefusalReader) Read() (Refusal, error) {
	for len(r.pending) == 0 {
		due := r.read.Add(r.every)
		last := !r.deadline.IsZero() && r.deadline.Before(due)
		if last {
			due = r.deadline
		}
		if wait := time.Until(due); wait > 0 && r.asleep {
			r.bell.SetDeadline(due)
			switch err := r.bell.ReadInto(&r.rang); {
			case err == nil, errors.Is(err, os.ErrDeadlineExceeded):
			case errors.Is(err, ringbuf.ErrClosed), errors.Is(err, os.ErrClosed):
				return Refusal{}, ErrClosed
			default:
				return Refusal{}, fmt.Errorf("refusal bell: %w", err)
			}
		} else if wait > 0 {
			t := time.NewTimer(wait)
			select {
			case <-r.closed:
				t.Stop()
				return Refusal{}, ErrClosed
			case <-t.C:
			}
		}
		if err := r.scan(); err != nil {
			return Refusal{}, err
		}
		if last && len(r.pending) == 0 {
			return Refusal{}, ErrDeadline
		}
	}
	e := r.pending[0]
	r.pending = r.pending[1:]
	return e, nil
}

// scan reads what the runs gained since the last scan and queues the
// events that are due.
func (r *RefusalReader) scan() error {
	r.read = time.Now()
	select {
	case <-r.closed:
		return ErrClosed
	default:
	}
	runs, err := r.d.refusalRuns()
	if err != nil {
		return err
	}
	if err := r.readFinished(runs); err != nil {
		return err
	}
	for cpu, run := range runs {
		pos := r.seen[cpu]
		cur := run.Cur.Seq
		if cur == 0 {
			continue
		}
		from := pos.seq
		if cur-from > logSlots {
			// Overwritten before we read them.
			r.d.lostRefusals.Add(uint64(cur - from - logSlots))
			from, pos.count = cur-logSlots, 0
		}
		for seq := max(from, 1); seq <= cur; seq++ {
			n := &run.Cur
			if seq != cur {
				n = &r.log[cpu*logSlots+int(logIndex(seq))]
			}
			if n.Seq != seq {
				continue // rewritten meanwhile: lost with the others
			}
			done := uint32(0)
			if seq == pos.seq {
				done = pos.count
			}
			if n.Count > done {
				r.add(n, n.Count-done)
			}
			pos = logPos{seq: seq, count: n.Count}
		}
		r.seen[cpu] = pos
	}
	for key, p := range r.pairs {
		if r.read.Sub(p.sent) < r.d.cfg.EventInterval {
			continue
		}
		if p.unsent == 0 {
			delete(r.pairs, key) // quiet for an interval: forgotten
			continue
		}
		r.emit(&p.latest, p.unsent)
		p.sent, p.unsent = r.read, 0
	}
	switch {
	case r.busy, r.asleep && len(r.pairs) > 0:
		// Many runs, or the first refusals after a sleep: read again
		// soon, before a storm's runs can fill the log.
		r.every = pollEvery / 10
	case len(r.pairs) > 0:
		r.every = pollEvery
	default:
		r.every = min(2*r.every, quietPollEvery)
	}
	r.asleep = false
	if r.every > pollEvery {
		return r.arm(runs)
	}
	return nil
}

// arm asks the kernel to ring the bell at the next refusal, and then puts
// the reader to sleep unless a refusal came since runs were read (it rang
// no bell).
func (r *RefusalReader) arm(runs []egressdRefusalRun) error {
	var one [4]byte
	binary.NativeEndian.PutUint32(one[:], 1)
	if _, err := r.armed.WriteAt(one[:], 0); err != nil {
		return fmt.Errorf("arm the refusal bell: %w", err)
	}
	now, err := r.d.refusalRuns()
	if err != nil {
		return err
	}
	for cpu := range now {
		if now[cpu].Cur != runs[cpu].Cur {
			r.every = pollEvery
			return nil
		}
	}
	r.asleep = true
	return nil
}

// readFinished copies into r.log the runs finished since the last scan.
func (r *RefusalReader) readFinished(runs []egressdRefusalRun) error {
	if len(r.log) != logSlots*r.d.ncpu {
		r.log = make([]egressdRefusalNote, logSlots*r.d.ncpu)
	}
	r.busy = false
	for cpu, run := range runs {
		seen := r.seen[cpu].seq
		if run.Cur.Seq-seen > logSlots/32 {
			r.busy = true
		}
		from := max(seen, run.Cur.Seq-min(run.Cur.Seq, logSlots)+1, 1)
		// Slots from from to run.Done, wrapping at the end of the log.
		for from <= uint32(run.Done) {
			i := logIndex(from)
			n := min(uint32(run.Done)-from+1, logSlots-i)
			part := r.log[cpu*logSlots+int(i) : cpu*logSlots+int(i+n)]
			if err := r.d.readLogRange(cpu, i, part); err != nil {
				return err
			}
			from += n
		}
	}
	return nil
}

// add takes count more refusals of a run.
func (r *RefusalReader) add(n *egressdRefusalNote, count uint32) {
	key := refusalPair{pid: n.Pid, rule: [2]uint32{n.Rule, n.Gen}, shadow: n.Shadow}
	p := r.pairs[key]
	if p == nil {
		// A new pair's first refusals go out at once.
		r.pairs[key] = &pairState{sent: r.read}
		r.emit(n, uint64(count))
		return
	}
	p.latest = *n
	p.unsent += uint64(count)
}

func (r *RefusalReader) emit(n *egressdRefusalNote, count uint64) {
	e := r.d.refusal(n)
	e.Count = count
	r.pending = append(r.pending, e)
}

// refusal turns a run into a Refusal counting one refusal.
func (d *Datapath) refusal(n *egressdRefusalNote) Refusal {
	return Refusal{
		Time:       monotonicToWall(n.TimeNs),
		PID:        n.Pid,
		Cgroup:     n.Cgroup,
		Rule:       d.ruleName(n.Rule, n.Gen),
		Dest:       netip.AddrPortFrom(netip.AddrFrom16(n.Addr).Unmap(), n.Port),
		Shape:      Shape(n.Shape),
		Shadow:     n.Shadow&noteShadow != 0,
		Protocol:   notedProtocol(n.Shadow),
		RetryAfter: time.Duration(n.RetryAfterNs),
		Count:      1,
	}
}

// Bits of refusal_note.shadow; they mirror NOTE_* in egressd.c.
const (
	noteShadow = 2
	noteUDP    = 4
)

// notedProtocol is the protocol a refusal note says it refused.
func notedProtocol(bits uint8) Protocols {
	if bits&noteUDP != 0 {
		return ProtoUDP
	}
	return ProtoTCP
}

// logSlots is LOG_SLOTS of egressd.c: finished runs kept per CPU.
const logSlots = 2048

func logIndex(seq uint32) uint32 { return (seq - 1) % logSlots }

// The refusal runs and log are mapped into memory: they are read with a
// copy, not a system call. A record whose seq reads the same before and
// after the copy was not being written meanwhile.
var (
	runSize  = int(unsafe.Sizeof(egressdRefusalRun{}))
	noteSize = int(unsafe.Sizeof(egressdRefusalNote{}))
	seqOff   = int(unsafe.Offsetof(egressdRefusalNote{}.Seq))
)

// refusalRuns reads every CPU's run in progress; a run being rewritten
// reads with Seq 0.
func (d *Datapath) refusalRuns() ([]egressdRefusalRun, error) {
	mem, err := d.maps().RefusalRuns.Memory()
	if err != nil {
		return nil, fmt.Errorf("map refusal runs: %w", err)
	}
	runs := make([]egressdRefusalRun, d.ncpu)
	buf := unsafe.Slice((*byte)(unsafe.Pointer(&runs[0])), runSize*d.ncpu)
	if _, err := mem.ReadAt(buf, 0); err != nil {
		return nil, fmt.Errorf("read refusal runs: %w", err)
	}
	for cpu := range runs {
		if !stillSeq(mem, cpu*runSize+seqOff, runs[cpu].Cur.Seq) {
			runs[cpu].Cur.Seq = 0
		}
	}
	return runs, nil
}

// readLogRange copies the log records of one CPU from slot i on into out;
// a record being rewritten reads with Seq 0.
func (d *Datapath) readLogRange(cpu int, i uint32, out []egressdRefusalNote) error {
	mem, err := d.maps().RefusalLog.Memory()
	if err != nil {
		return fmt.Errorf("map refusal log: %w", err)
	}
	if len(out) == 0 {
		return nil
	}
	off := (cpu*logSlots + int(i)) * noteSize
	buf := unsafe.Slice((*byte)(unsafe.Pointer(&out[0])), noteSize*len(out))
	if _, err := mem.ReadAt(buf, int64(off)); err != nil {
		return fmt.Errorf("read refusal log: %w", err)
	}
	for j := range out {
		if !stillSeq(mem, off+j*noteSize+seqOff, out[j].Seq) {
			out[j].Seq = 0
		}
	}
	return nil
}

func stillSeq(mem *ebpf.Memory, off int, seq uint32) bool {
	var b [4]byte
	if _, err := mem.ReadAt(b[:], int64(off)); err != nil {
		return false
	}
	return *(*uint32)(unsafe.Pointer(&b[0])) == seq
}

// logPool holds one CPU's log of finished runs, as LastRefusal copies it:
// a question each refused caller may ask must not allocate the log's size.
var logPool = sync.Pool{New: func() any { return new([logSlots]egressdRefusalNote) }}

// LastRefusal returns the latest refusal of process pid's connect() to
// dest, or for proto ProtoUDP of its UDP flow to dest, that the kernel
// still holds: the run in progress and the last 2048
// finished runs of each CPU, a run being one process's refusals to one
// destination in a row. The kernel notes a refusal before connect()
// returns, so a caller asking after its EPERM finds it at once.
//
// Each CPU's log is copied whole and only the notes that match are checked
// for a rewrite during the copy (their seq read again), newest first: the
// check of every note was most of a question's cost.
func (d *Datapath) LastRefusal(pid uint32, proto Protocols, dest netip.AddrPort) (Refusal, bool, error) {
	runs, err := d.refusalRuns()
	if err != nil {
		return Refusal{}, false, err
	}
	mem, err := d.maps().RefusalLog.Memory()
	if err != nil {
		return Refusal{}, false, fmt.Errorf("map refusal log: %w", err)
	}
	addr := dest.Addr().As16()
	match := func(n *egressdRefusalNote) bool {
		return n.Seq != 0 && n.Pid == pid && n.Port == dest.Port() && n.Addr == addr && notedProtocol(n.Shadow) == proto
	}
	type candidate struct {
		note egressdRefusalNote
		off  int // of the note in the log; -1 for a run in progress (checked already)
	}
	var found []candidate
	for i := range runs {
		if match(&runs[i].Cur) {
			found = append(found, candidate{runs[i].Cur, -1})
		}
	}
	log := logPool.Get().(*[logSlots]egressdRefusalNote)
	defer logPool.Put(log)
	buf := unsafe.Slice((*byte)(unsafe.Pointer(&log[0])), noteSize*logSlots)
	for cpu := range d.ncpu {
		off := cpu * logSlots * noteSize
		if _, err := mem.ReadAt(buf, int64(off)); err != nil {
			return Refusal{}, false, fmt.Errorf("read refusal log: %w", err)
		}
		for j := range log {
			if match(&log[j]) {
				found = append(found, candidate{log[j], off + j*noteSize})
			}
		}
	}
	slices.SortFunc(found, func(a, b candidate) int { return cmp.Compare(b.note.TimeNs, a.note.TimeNs) })
	for _, c := range found {
		if c.off < 0 || stillSeq(mem, c.off+seqOff, c.note.Seq) {
			return d.refusal(&c.note), true, nil
		}
	}
	return Refusal{}, false, nil
}

// SampleReader reads latency samples of rules with Samples set.
type SampleReader struct {
	d  *Datapath
	rd *ringReader
}

// Samples opens a reader of latency samples. Only one reader should run at
// a time. Samples reach it within a tenth of a second, in batches.
func (d *Datapath) Samples() (*SampleReader, error) {
	rd, err := newRingReader(d.maps().Samples)
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
