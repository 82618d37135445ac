//go:build linux

package loader

import (
	"fmt"
	"time"

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
	err := d.eachActive(true, func(idx uint32, state *egressdRuleState, hists []egressdHist) {
		out = append(out, RuleStatus{Rule: d.t.slots[idx].rule, Stats: statsOf(state, hists)})
	})
	return out, err
}

func (d *Datapath) stats(idx uint32) (Stats, error) {
	state, hists, err := d.readSlot(idx, true)
	if err != nil {
		return Stats{}, err
	}
	return statsOf(&state, hists), nil
}

// readSlot reads one slot's state and, with hists, its latency
// histograms, a lookup each.
func (d *Datapath) readSlot(idx uint32, hists bool) (egressdRuleState, []egressdHist, error) {
	var state egressdRuleState
	if err := d.objs.RuleStates.Lookup(idx, &state); err != nil {
		return state, nil, fmt.Errorf("read rule state: %w", err)
	}
	var responses egressdResponseCount
	if err := d.objs.RuleResponses.Lookup(idx, &responses); err != nil {
		return state, nil, fmt.Errorf("read responses: %w", err)
	}
	addResponses(&state, &responses)
	if !hists {
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
const statsChunk = 4096

// eachActive calls fn with the state of each active slot, in slot order,
// and with hists its latency histograms. Dense tables are read in batches
// of statsChunk slots; a table whose few rules sit among many free slots,
// one lookup at a time. Call with d.mu held.
func (d *Datapath) eachActive(hists bool, fn func(idx uint32, state *egressdRuleState, hists []egressdHist)) error {
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
			state, h, err := d.readSlot(uint32(i), hists)
			if err != nil {
				return err
			}
			fn(uint32(i), &state, h)
		}
		return nil
	}
	states := newBatches[egressdRuleState](d.objs.RuleStates, min(top, statsChunk))
	responses := newBatches[egressdResponseCount](d.objs.RuleResponses, min(top, statsChunk))
	var latency *batches[egressdHist]
	if hists {
		latency = newBatches[egressdHist](d.objs.Latency, min(top, statsChunk)*kinds)
	}
	for base := 0; base < top; base += statsChunk {
		n := min(statsChunk, top-base)
		st, err := states.next(n)
		if err != nil {
			return fmt.Errorf("read rule states: %w", err)
		}
		rs, err := responses.next(n)
		if err != nil {
			return fmt.Errorf("read responses: %w", err)
		}
		for i := range st {
			addResponses(&st[i], &rs[i])
		}
		var hs []egressdHist
		if hists {
			if hs, err = latency.next(n * kinds); err != nil {
				return fmt.Errorf("read latency: %w", err)
			}
		}
		for i := range n {
			if !d.t.slots[base+i].active {
				continue
			}
			var h []egressdHist
			if hists {
				h = hs[i*kinds : (i+1)*kinds]
			}
			fn(uint32(base+i), &st[i], h)
		}
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
	c := state.Counters
	s := Stats{
		Live:          state.Live,
		Spent:         state.Spent,
		Admitted:      c[egressdCounterCOUNTER_ADMITTED],
		Refused:       c[egressdCounterCOUNTER_REFUSED],
		ShadowRefused: c[egressdCounterCOUNTER_SHADOW_REFUSED],
		Released:      c[egressdCounterCOUNTER_RELEASED],
		Established:   c[egressdCounterCOUNTER_ESTABLISHED],
		ConnectFailed: c[egressdCounterCOUNTER_CONNECT_FAILED],
		Untracked:     c[egressdCounterCOUNTER_UNTRACKED],
		Requests:      c[egressdCounterCOUNTER_REQUESTS],
		Responses:     c[egressdCounterCOUNTER_RESPONSES],
		Aborted:       c[egressdCounterCOUNTER_ABORTED],
		// Every request ends once: in a response or an abort.
		InFlight: int64(c[egressdCounterCOUNTER_REQUESTS] - c[egressdCounterCOUNTER_RESPONSES] - c[egressdCounterCOUNTER_ABORTED]),
	}
	for kind, kh := range hists {
		h := [...]*Histogram{&s.ConnectLatency, &s.RequestLatency}[kind]
		*h = Histogram{Sum: time.Duration(kh.SumNs), Buckets: kh.Buckets}
		for _, n := range kh.Buckets {
			h.Count += n
		}
	}
	return s
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
