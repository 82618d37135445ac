//go:build linux

package loader

import (
	"errors"
	"fmt"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// Stats reads a rule's counters.
func (d *Datapath) Stats(name string) (Stats, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	idx, ok := d.t.byName[name]
	if !ok {
		return Stats{}, fmt.Errorf("rule %s: %w", name, ErrUnknownRule)
	}
	return d.stats(idx)
}

// Live reads only a rule's live connections: one map lookup, for callers
// that poll it often (an adaptive loop watching for saturation).
func (d *Datapath) Live(name string) (int64, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	idx, ok := d.t.byName[name]
	if !ok {
		return 0, fmt.Errorf("rule %s: %w", name, ErrUnknownRule)
	}
	var state egressdRuleState
	if err := d.objs.RuleStates.Lookup(idx, &state); err != nil {
		return 0, fmt.Errorf("read rule state: %w", err)
	}
	return state.Live, nil
}

// Spent reads only a granted rule's permits spent since it was created,
// for the loop that tops its grant up.
func (d *Datapath) Spent(name string) (uint64, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	idx, ok := d.t.byName[name]
	if !ok {
		return 0, fmt.Errorf("rule %s: %w", name, ErrUnknownRule)
	}
	return d.spent(idx)
}

func (d *Datapath) spent(idx uint32) (uint64, error) {
	var state egressdRuleState
	if err := d.objs.RuleStates.Lookup(idx, &state); err != nil {
		return 0, fmt.Errorf("read rule state: %w", err)
	}
	return state.Spent, nil
}

// Status reads every rule with its counters.
func (d *Datapath) Status() ([]RuleStatus, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := make([]RuleStatus, 0, len(d.t.byName))
	err := d.eachActive(readResponses|readHists, func(idx uint32, state *egressdRuleState, hists []egressdHist) {
		out = append(out, RuleStatus{Rule: d.t.slots[idx].rule, Stats: statsOf(state, hists)})
	})
	return out, err
}

// Counts calls fn with every rule and its counters, as Status reads them
// but without the latency histograms, which are half of what Status
// reads, and with the responses of only the rules that sent requests (a
// lookup each; the batch of every rule's was a quarter): a caller that
// needs every rule's counts and the histograms of a few asks Stats for
// those. fn runs with the datapath locked and must not call it; r and s
// are valid only during the call.
func (d *Datapath) Counts(fn func(r *Rule, s *Stats)) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	var err error
	// One for all, its histograms left empty: fn's argument would be an
	// allocation each.
	var s Stats
	walk := d.eachActive(0, func(idx uint32, state *egressdRuleState, _ []egressdHist) {
		if err != nil {
			return
		}
		// A rule's responses answer its requests: none without them.
		if state.Counters[egressdCounterCOUNTER_REQUESTS] > 0 {
			var responses egressdResponseCount
			if err = d.objs.RuleResponses.Lookup(idx, &responses); err != nil {
				err = fmt.Errorf("read responses: %w", err)
				return
			}
			addResponses(state, &responses)
		}
		countsOf(&s, state)
		fn(&d.t.slots[idx].rule, &s)
	})
	return errors.Join(walk, err)
}

func (d *Datapath) stats(idx uint32) (Stats, error) {
	state, hists, err := d.readSlot(idx, readResponses|readHists)
	if err != nil {
		return Stats{}, err
	}
	return statsOf(&state, hists), nil
}

// slotReads says what eachActive and readSlot read of a slot beside its
// state.
type slotReads uint8

const (
	// readResponses adds the responses counted apart (rule_responses).
	readResponses slotReads = 1 << iota
	// readHists reads the latency histograms.
	readHists
)

// readSlot reads one slot's state and what reads asks, a lookup each.
func (d *Datapath) readSlot(idx uint32, reads slotReads) (egressdRuleState, []egressdHist, error) {
	var state egressdRuleState
	if err := d.objs.RuleStates.Lookup(idx, &state); err != nil {
		return state, nil, fmt.Errorf("read rule state: %w", err)
	}
	if reads&readResponses != 0 {
		var responses egressdResponseCount
		if err := d.objs.RuleResponses.Lookup(idx, &responses); err != nil {
			return state, nil, fmt.Errorf("read responses: %w", err)
		}
		addResponses(&state, &responses)
	}
	if reads&readHists == 0 {
		return state, nil, nil
	}
	const kinds = uint32(egressdSampleKindSAMPLE_LEN)
	h := make([]egressdHist, kinds)
	for k := range kinds {
		if err := d.objs.Latency.Lookup(idx*kinds+k, &h[k]); err != nil {
			return state, nil, fmt.Errorf("read latency: %w", err)
		}
	}
	return state, h, nil
}

// statsChunk is how many slots eachActive reads with one batch of system
// calls: a table of 100,000 rules costs 25 batches, not 300,000 lookups.
// It is the length of the counts map egressd_counts copies into.
const statsChunk = 4096

// countsSize is the size of a rule's counts in the counts map.
var countsSize = int(unsafe.Sizeof(egressdRuleCounts{}))

// eachActive calls fn with the state of each active slot, in slot order,
// with what reads asks (the histograms nil without readHists). Dense
// tables are read statsChunk slots at a time: of the states only their
// counts (the rest of the state left zero), which egressd_counts copies
// into mapped memory, and the rest in batches. A table whose few rules
// sit among many free slots is read one lookup at a time. Call with d.mu
// held.
func (d *Datapath) eachActive(reads slotReads, fn func(idx uint32, state *egressdRuleState, hists []egressdHist)) error {
	top, active := 0, 0
	for i, s := range d.t.slots {
		if s.active {
			top, active = i+1, active+1
		}
	}
	const kinds = int(egressdSampleKindSAMPLE_LEN)
	if active*8 < top {
		for i := range top {
			if !d.t.slots[i].active {
				continue
			}
			state, h, err := d.readSlot(uint32(i), reads)
			if err != nil {
				return err
			}
			fn(uint32(i), &state, h)
		}
		return nil
	}
	mem, err := d.objs.Counts.Memory()
	if err != nil {
		return fmt.Errorf("map counts: %w", err)
	}
	counts := make([]egressdRuleCounts, min(top, statsChunk))
	st := make([]egressdRuleState, len(counts))
	var responses *batches[egressdResponseCount]
	if reads&readResponses != 0 {
		responses = newBatches[egressdResponseCount](d.objs.RuleResponses, min(top, statsChunk))
	}
	var latency *batches[egressdHist]
	if reads&readHists != 0 {
		latency = newBatches[egressdHist](d.objs.Latency, min(top, statsChunk)*kinds)
	}
	for base := 0; base < top; base += statsChunk {
		n := min(statsChunk, top-base)
		if err := d.readCounts(mem, base, counts[:n]); err != nil {
			return err
		}
		for i := range n {
			st[i].Live, st[i].Spent, st[i].Counters = counts[i].Live, counts[i].Spent, counts[i].Counters
		}
		if responses != nil {
			rs, err := responses.next(n)
			if err != nil {
				return fmt.Errorf("read responses: %w", err)
			}
			for i := range n {
				addResponses(&st[i], &rs[i])
			}
		}
		var hs []egressdHist
		if latency != nil {
			if hs, err = latency.next(n * kinds); err != nil {
				return fmt.Errorf("read latency: %w", err)
			}
		}
		for i := range n {
			if !d.t.slots[base+i].active {
				continue
			}
			var h []egressdHist
			if latency != nil {
				h = hs[i*kinds : (i+1)*kinds]
			}
			fn(uint32(base+i), &st[i], h)
		}
	}
	return nil
}

// readCounts fills out with the counts of the slots from first on: the
// kernel copies them into the counts map, read from mapped memory.
func (d *Datapath) readCounts(mem *ebpf.Memory, first int, out []egressdRuleCounts) error {
	args := egressdCountsArgs{First: uint32(first), N: uint32(len(out))}
	ctx := unsafe.Slice((*byte)(unsafe.Pointer(&args)), unsafe.Sizeof(args))
	if _, err := d.objs.EgressdCounts.Run(&ebpf.RunOptions{Context: ctx}); err != nil {
		return fmt.Errorf("copy counts: %w", err)
	}
	buf := unsafe.Slice((*byte)(unsafe.Pointer(&out[0])), len(out)*countsSize)
	if _, err := mem.ReadAt(buf, 0); err != nil {
		return fmt.Errorf("read counts: %w", err)
	}
	return nil
}

// addResponses adds to a rule state's counters the responses the programs
// count apart (rule_responses); the state's own are what a build before
// that counted.
func addResponses(state *egressdRuleState, r *egressdResponseCount) {
	state.Counters[egressdCounterCOUNTER_RESPONSES] += r.N
}

// statsOf makes a rule's Stats of its state and latency histograms (none:
// no latency).
func statsOf(state *egressdRuleState, hists []egressdHist) Stats {
	var s Stats
	countsOf(&s, state)
	for kind, kh := range hists {
		h := [...]*Histogram{&s.ConnectLatency, &s.RequestLatency}[kind]
		*h = Histogram{Sum: time.Duration(kh.SumNs), Buckets: kh.Buckets}
		for _, n := range kh.Buckets {
			h.Count += n
		}
	}
	return s
}

// countsOf sets s's counters, not its histograms, from a rule's state.
func countsOf(s *Stats, state *egressdRuleState) {
	c := &state.Counters
	s.Live, s.Spent = state.Live, state.Spent
	s.Admitted = c[egressdCounterCOUNTER_ADMITTED]
	s.Refused = c[egressdCounterCOUNTER_REFUSED]
	s.ShadowRefused = c[egressdCounterCOUNTER_SHADOW_REFUSED]
	s.Released = c[egressdCounterCOUNTER_RELEASED]
	s.Established = c[egressdCounterCOUNTER_ESTABLISHED]
	s.ConnectFailed = c[egressdCounterCOUNTER_CONNECT_FAILED]
	s.Untracked = c[egressdCounterCOUNTER_UNTRACKED]
	s.Requests = c[egressdCounterCOUNTER_REQUESTS]
	s.Responses = c[egressdCounterCOUNTER_RESPONSES]
	s.Aborted = c[egressdCounterCOUNTER_ABORTED]
	// Every request ends once: in a response or an abort.
	s.InFlight = int64(s.Requests - s.Responses - s.Aborted)
}

// Lost reads how many events were dropped: latency samples the kernel
// could not queue, and refusal records it overwrote before a reader of
// this Datapath read them.
func (d *Datapath) Lost() (Lost, error) {
	samples, err := d.global(egressdGlobalCounterGLOBAL_SAMPLES_LOST)
	return Lost{Refusals: d.lostRefusals.Load(), Samples: samples}, err
}

// OverflowSockets counts the tracked sockets that keep their state in the
// overflow table now, because the socket table entries their cookie maps
// to were held by other live sockets. Many mean a socket table too small
// for the connections the host keeps open.
func (d *Datapath) OverflowSockets() (int, error) {
	n := 0
	var cookie uint64
	var state egressdSockState
	it := d.maps().SockOverflow.Iterate()
	for it.Next(&cookie, &state) {
		if state.Word&ssHeld != 0 {
			n++
		}
	}
	if err := it.Err(); err != nil {
		return 0, fmt.Errorf("read overflow table: %w", err)
	}
	return n, nil
}

// StorageUsed reports whether a build before this one ever kept a
// socket's state in socket storage on this datapath, where no recount can
// count it: Recount then gives back no drift, as it cannot tell those
// sockets' slots from slots no socket holds.
func (d *Datapath) StorageUsed() (bool, error) {
	n, err := d.global(egressdGlobalCounterGLOBAL_STORAGE)
	return n > 0, err
}

func (d *Datapath) global(i egressdGlobalCounter) (uint64, error) {
	var perCPU []uint64
	if err := d.maps().GlobalCounters.Lookup(uint32(i), &perCPU); err != nil {
		return 0, fmt.Errorf("read global counters: %w", err)
	}
	var sum uint64
	for _, v := range perCPU {
		sum += v
	}
	return sum, nil
}

// ruleName resolves a kernel (slot, generation) pair; "" if the rule is gone.
func (d *Datapath) ruleName(idx, gen uint32) string {
	d.mu.Lock()
	defer d.mu.Unlock()
	if int(idx) >= len(d.t.slots) || d.t.slots[idx].gen != gen || !d.t.slots[idx].active {
		return ""
	}
	return d.t.slots[idx].rule.Name
}

// ProgramStats reads each attached program's run statistics. They count
// only while kernel.bpf_stats_enabled is on (see EnableStats).
func (d *Datapath) ProgramStats() (map[string]ProgramStats, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := map[string]ProgramStats{}
	for _, p := range allPrograms {
		if _, ok := d.links[p.name]; !ok {
			continue
		}
		st, err := p.prog(&d.objs).Stats()
		if err != nil {
			return nil, fmt.Errorf("stats %s: %w", p.name, err)
		}
		out[p.name] = ProgramStats{Runs: st.RunCount, Runtime: st.Runtime}
	}
	return out, nil
}

// EnableStats turns on the kernel's per-program run statistics until the
// returned closer is closed.
func EnableStats() (interface{ Close() error }, error) {
	c, err := ebpf.EnableStats(uint32(unix.BPF_STATS_RUN_TIME))
	if err != nil {
		return nil, fmt.Errorf("enable bpf stats: %w", err)
	}
	return c, nil
}
