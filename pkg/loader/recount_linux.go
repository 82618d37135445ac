//go:build linux

package loader

import (
	"fmt"
	"io"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
)

// Recount counts the states holding a slot of each rule, by walking the
// socket table and socket storage, sets that beside the kernel's counters,
// and gives back what no socket holds. A state counts only while its
// socket lives, in whatever network namespace; one whose socket was freed
// without giving its slot back (a close that ran no sock_release) is given
// back by the walk itself (Recount.Freed). The walk is not an atomic
// snapshot, so the rule's counters are read before and after it: what was
// admitted and released meanwhile bounds what the walk may have seen
// (Recount.Drift). A rule created or replaced during the walk is left
// out; the next pass counts it.
//
// A slot the kernel counts that no state holds at all (socket storage is
// freed with its socket) is a drift that lasts: it is given back once two
// recounts in a row see it, no more than the smaller drift of the two
// (Recount.GivenBack). A connect() or a release caught between its change
// of the count and of its state reads as such a drift for a moment, so a
// rule with a drift is walked again after a pause, and the smallest drift
// is kept: a leak shows in every walk, a program in passing in one.
//
// Recount also puts back the marks another program took off a socket
// holding a slot (Recount.Remarked), for the TCP sockets of the calling
// process's network namespace.
func (d *Datapath) Recount() (map[string]Recount, error) {
	remarked, err := d.remark()
	if err != nil {
		return nil, err
	}
	out, err := d.recount()
	if err != nil {
		return nil, err
	}
	for _, pause := range recountPauses {
		leak := false
		for _, r := range out {
			leak = leak || r.Drift() > 0
		}
		if !leak {
			break
		}
		time.Sleep(pause)
		again, err := d.recount()
		if err != nil {
			break // the walks so far stand
		}
		for name, r := range out {
			a, ok := again[name]
			if !ok {
				continue
			}
			a.Freed += r.Freed
			a.Expired += r.Expired
			if r.Drift() > 0 && abs(a.Drift()) < r.Drift() {
				r = a
			}
			r.Freed, r.Expired = a.Freed, a.Expired
			out[name] = r
		}
	}
	for name, n := range remarked {
		if r, ok := out[name]; ok {
			r.Remarked = n
			out[name] = r
		}
	}
	return out, d.giveBackDrift(out)
}

// recountPauses are how long Recount waits before each walk after the
// first: many times what a program takes from its change of a count to
// its change of a state (a loaded machine may stop one in between), then
// longer.
var recountPauses = []time.Duration{20 * time.Millisecond, 200 * time.Millisecond}

func abs(n int64) int64 { return max(n, -n) }

// giveBack is how many slots a recount gives back of a rule whose drift
// was before at the recount before and is now at this one: only what both
// saw, which neither churn nor a program in passing explains twice.
func giveBack(before, now int64) int64 { return max(0, min(before, now)) }

// seenDrift is a rule's drift at a recount, what is left of it once given
// back, for the next recount to compare with.
type seenDrift struct {
	gen   uint32
	drift int64
}

// giveBackDrift gives back, rule by rule, the drift this recount and the
// one before it saw, and keeps what is left for the next. Not on a
// datapath where a build before kept states in socket storage: the
// recount cannot count those, and would take their slots for drift.
func (d *Datapath) giveBackDrift(out map[string]Recount) error {
	if used, err := d.StorageUsed(); used || err != nil {
		return err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	seen := map[uint32]seenDrift{}
	for name, r := range out {
		idx, ok := d.t.byName[name]
		if !ok {
			continue
		}
		gen, drift := d.t.slots[idx].gen, r.Drift()
		before := d.drift[idx]
		if before.gen != gen {
			before = seenDrift{}
		}
		if n := giveBack(before.drift, drift); n > 0 {
			a := egressdMergeArgs{Slot: idx, Epoch: noEpoch, Live: -n}
			a.Counters[egressdCounterCOUNTER_RELEASED] = uint64(n)
			if err := merge(&d.objs, &a); err != nil {
				return fmt.Errorf("give back %d slots of %s: %w", n, name, err)
			}
			r.GivenBack = n
			out[name] = r
			drift -= n
		}
		seen[idx] = seenDrift{gen: gen, drift: drift}
	}
	d.drift = seen
	return nil
}

// noEpoch is an epoch no rule has: a merge with it leaves the rate state
// alone.
const noEpoch = ^uint32(0)

// recount is one walk of Recount.
func (d *Datapath) recount() (map[string]Recount, error) {
	type before struct {
		gen                uint32
		live               int64
		admitted, released uint64
	}
	d.mu.Lock()
	was := map[uint32]before{}
	err := d.eachActive(readResponses, func(idx uint32, state *egressdRuleState, _ []egressdHist) {
		st := statsOf(state, nil)
		was[idx] = before{gen: d.t.slots[idx].gen, live: st.Live, admitted: st.Admitted, released: st.Released}
	})
	d.mu.Unlock()
	if err != nil {
		return nil, err
	}
	type tally struct{ live, inFlight, freed, expired int64 }
	counted := map[uint32]tally{}
	err = d.sweepStates(func(it *egressdSweepItem) {
		if d.slotGen(it.Rule) != it.Gen {
			return // a retired generation's: nothing of the rule now in its slot
		}
		t := counted[it.Rule]
		what := egressdRecWhat(it.What)
		switch {
		case what&egressdRecWhatREC_FREED != 0:
			t.freed++
		case what&egressdRecWhatREC_EXPIRED != 0:
			t.expired++
		case what&egressdRecWhatREC_HELD != 0:
			t.live++
			if what&egressdRecWhatREC_AWAITING != 0 {
				t.inFlight++
			}
		}
		counted[it.Rule] = t
	})
	if err != nil {
		return nil, err
	}

	d.mu.Lock()
	defer d.mu.Unlock()
	out := map[string]Recount{}
	err = d.eachActive(readResponses, func(idx uint32, state *egressdRuleState, _ []egressdHist) {
		b, ok := was[idx]
		if !ok || b.gen != d.t.slots[idx].gen {
			return
		}
		st, t := statsOf(state, nil), counted[idx]
		out[d.t.slots[idx].rule.Name] = Recount{
			Live: b.live, Counted: t.live, InFlight: st.InFlight, CountedInFlight: t.inFlight,
			Admitted: int64(st.Admitted - b.admitted), Released: int64(st.Released - b.released),
			Freed: t.freed, Expired: t.expired,
		}
	})
	return out, err
}

var (
	sockStateSize = int(unsafe.Sizeof(egressdSockState{}))
	udpEntrySize  = int(unsafe.Sizeof(egressdUdpEntry{}))
	sweepItemSize = int(unsafe.Sizeof(egressdSweepItem{}))
)

// tableChunk is how many socket table entries sweepStates copies at a time.
const tableChunk = 8192

// sweepStates hands fn what the sweep found of each state that held a slot
// when it was read, of the socket table (read from mapped memory), and of
// each entry of the overflow table; the sweep looks at them a batch at a
// time.
func (d *Datapath) sweepStates(fn func(*egressdSweepItem)) error {
	d.recountMu.Lock()
	defer d.recountMu.Unlock()
	m := d.maps()
	table, err := m.SockTable.Memory()
	if err != nil {
		return fmt.Errorf("map socket table: %w", err)
	}
	items, err := m.Sweep.Memory()
	if err != nil {
		return fmt.Errorf("map sweep: %w", err)
	}
	batch := make([]egressdSweepItem, 0, m.Sweep.MaxEntries())
	flush := func() error {
		if len(batch) == 0 {
			return nil
		}
		buf := unsafe.Slice((*byte)(unsafe.Pointer(&batch[0])), len(batch)*sweepItemSize)
		if _, err := items.WriteAt(buf, 0); err != nil {
			return fmt.Errorf("write sweep: %w", err)
		}
		args := egressdSweepArgs{N: uint32(len(batch))}
		ctx := unsafe.Slice((*byte)(unsafe.Pointer(&args)), unsafe.Sizeof(args))
		if _, err := d.objs.EgressdSweep.Run(&ebpf.RunOptions{Context: ctx}); err != nil {
			return fmt.Errorf("sweep: %w", err)
		}
		if _, err := items.ReadAt(buf, 0); err != nil {
			return fmt.Errorf("read sweep: %w", err)
		}
		for i := range batch {
			fn(&batch[i])
		}
		batch = batch[:0]
		return nil
	}
	add := func(cookie uint64, idx uint32, idle time.Duration) error {
		batch = append(batch, egressdSweepItem{Cookie: cookie, Idx: idx, IdleNs: uint64(idle)})
		if len(batch) == cap(batch) {
			return flush()
		}
		return nil
	}
	entries := make([]egressdSockState, tableChunk)
	raw := unsafe.Slice((*byte)(unsafe.Pointer(&entries[0])), len(entries)*sockStateSize)
	n := int(table.Size()) / sockStateSize
	for from := 0; from < n; from += tableChunk {
		k := min(tableChunk, n-from)
		if _, err := table.ReadAt(raw[:k*sockStateSize], int64(from*sockStateSize)); err != nil {
			return fmt.Errorf("read socket table: %w", err)
		}
		for i, e := range entries[:k] {
			if e.Word&ssHeld == 0 {
				continue
			}
			if err := add(e.Word>>2, uint32(from+i), 0); err != nil {
				return err
			}
		}
	}
	// The overflow table's entries that hold nothing too: the sweep
	// removes those of sockets freed without their sock_release.
	var cookie uint64
	var state egressdSockState
	it := m.SockOverflow.Iterate()
	for it.Next(&cookie, &state) {
		if err := add(cookie, sweepOverflow, 0); err != nil {
			return err
		}
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("read overflow table: %w", err)
	}
	// Each UDP socket's flows holding a slot, with their rule's idle
	// time, and then the socket's state, which goes if it was freed: in
	// the UDP table (read from mapped memory), and in the hash of the
	// others.
	idle := d.flowIdles()
	flows := func(cookie uint64, us *egressdUdpSock, idx uint32) error {
		for i, f := range us.Flows {
			if f.Word != cookie<<2|ssHeld {
				continue
			}
			if err := add(cookie, idx|uint32(i), idle[slotGen{f.Rule, f.Gen}]); err != nil {
				return err
			}
		}
		return add(cookie, idx|uint32(len(us.Flows)), 0)
	}
	udpTable, err := m.UdpTable.Memory()
	if err != nil {
		return fmt.Errorf("map UDP table: %w", err)
	}
	udpEntries := make([]egressdUdpEntry, int(udpTable.Size())/udpEntrySize)
	if _, err := udpTable.ReadAt(unsafe.Slice((*byte)(unsafe.Pointer(&udpEntries[0])), len(udpEntries)*udpEntrySize), 0); err != nil {
		return fmt.Errorf("read UDP table: %w", err)
	}
	for k, e := range udpEntries {
		if e.Cookie == 0 {
			continue
		}
		if err := flows(e.Cookie, &e.Us, sweepUDP|sweepUDPTable|uint32(k)<<4); err != nil {
			return err
		}
	}
	var us egressdUdpSock
	it = m.UdpSocks.Iterate()
	for it.Next(&cookie, &us) {
		if err := flows(cookie, &us, sweepUDP); err != nil {
			return err
		}
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("read UDP sockets: %w", err)
	}
	return flush()
}

// slotGen names a rule's slot in one of its generations.
type slotGen struct{ slot, gen uint32 }

// flowIdles are the idle times of the UDP flows of each active rule that
// counts them.
func (d *Datapath) flowIdles() map[slotGen]time.Duration {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := map[slotGen]time.Duration{}
	for i, s := range d.t.slots {
		if s.active && s.rule.Protocols.Has(ProtoUDP) {
			out[slotGen{uint32(i), s.gen}] = s.rule.FlowIdle
		}
	}
	return out
}

// Mirrors of egressd.c: a state's held bit, and the sweep's index of a
// state in the overflow table and of a UDP flow (with sweepUDPTable, of one
// in the UDP table).
const (
	ssHeld        = 1
	sweepOverflow = ^uint32(0)
	sweepUDP      = 1 << 31
	sweepUDPTable = 1 << 30
)

// walk runs an iterator program and hands fn each record of a state of a
// rule slot's current generation.
func (d *Datapath) walk(prog *ebpf.Program, fn func(*egressdIterRec)) error {
	it, err := link.AttachIter(link.IterOptions{Program: prog})
	if err != nil {
		return fmt.Errorf("attach %s: %w", prog, err)
	}
	defer it.Close()
	rd, err := it.Open()
	if err != nil {
		return fmt.Errorf("open %s: %w", prog, err)
	}
	defer rd.Close()
	raw, err := io.ReadAll(rd)
	if err != nil {
		return fmt.Errorf("read %s: %w", prog, err)
	}
	size := int(unsafe.Sizeof(egressdIterRec{}))
	if len(raw)%size != 0 {
		return fmt.Errorf("%s: %d bytes is not a whole number of records", prog, len(raw))
	}
	for off := 0; off < len(raw); off += size {
		rec := (*egressdIterRec)(unsafe.Pointer(&raw[off]))
		if d.slotGen(rec.Rule) == rec.Gen {
			fn(rec)
		}
	}
	return nil
}

// remark puts back the marks of the TCP sockets holding a slot that
// another program took off, and counts them by rule.
func (d *Datapath) remark() (map[string]int64, error) {
	d.mu.Lock()
	prog := d.objs.EgressdRemark
	d.mu.Unlock()
	bySlot := map[uint32]int64{}
	if err := d.walk(prog, func(rec *egressdIterRec) { bySlot[rec.Rule]++ }); err != nil {
		return nil, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	out := map[string]int64{}
	for idx, n := range bySlot {
		if int(idx) < len(d.t.slots) && d.t.slots[idx].active {
			out[d.t.slots[idx].rule.Name] = n
		}
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
