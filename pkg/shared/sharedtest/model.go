// Package sharedtest is a model, in Go, of what package shared's Slots
// script does to a concurrency budget in Redis: the same decisions on a
// map instead of a sorted set, on a clock the caller moves. Simulations of
// many holders and of Redis's faults use it where a real Redis would be too
// slow to step through thousands of interleavings; package shared's tests
// check, on a real Redis, that the script and the model agree.
package sharedtest

import (
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/egressd/egressd/pkg/shared"
)

// Budget is one concurrency budget's state, as Redis keeps it.
type Budget struct {
	Permits    int
	Lease      time.Duration
	Persistent bool

	slots   map[string]time.Time // member (holder:N, or a Limiter's lease id) → expiry
	demands map[string]demand
	epoch   int64 // 0: no epoch (never used, or lost)
	frozen  time.Time
}

type demand struct {
	n       int
	expires time.Time
}

// NewBudget returns a budget Redis has no record of.
func NewBudget(permits int, lease time.Duration, persistent bool) *Budget {
	return &Budget{Permits: permits, Lease: lease, Persistent: persistent, slots: map[string]time.Time{}, demands: map[string]demand{}}
}

// Lose forgets everything, as a Redis restarted without persistence does.
func (b *Budget) Lose() {
	b.slots, b.demands, b.epoch, b.frozen = map[string]time.Time{}, map[string]demand{}, 0, time.Time{}
}

// Total returns the slots and leases held at now.
func (b *Budget) Total(now time.Time) int {
	b.expire(now)
	return len(b.slots)
}

// HeldBy returns holder's slots at now.
func (b *Budget) HeldBy(holder string, now time.Time) int {
	b.expire(now)
	return len(b.mine(holder))
}

func (b *Budget) expire(now time.Time) {
	for m, exp := range b.slots {
		if !exp.After(now) {
			delete(b.slots, m)
		}
	}
	for h, d := range b.demands {
		if !d.expires.After(now) {
			delete(b.demands, h)
		}
	}
}

// mine returns holder's members, by number.
func (b *Budget) mine(holder string) []int {
	var out []int
	for m := range b.slots {
		if n, ok := number(m, holder+":"); ok {
			out = append(out, n)
		}
	}
	slices.Sort(out)
	return out
}

// number is the N of prefix+N, when m is that with digits only.
func number(m, prefix string) (int, bool) {
	rest, ok := strings.CutPrefix(m, prefix)
	if !ok || rest == "" || strings.TrimLeft(rest, "0123456789") != "" {
		return 0, false
	}
	n, err := strconv.Atoi(rest)
	return n, err == nil
}

// Resize does what shared.Slots.Resize's script does, at now.
func (b *Budget) Resize(now time.Time, holder string, r shared.SlotsRequest) shared.SlotsReply {
	us := func(t time.Time) int64 { return t.UnixMicro() }
	if b.epoch == 0 {
		b.epoch, b.frozen = us(now), time.Time{}
		if r.HadState || !b.Persistent {
			b.frozen = now.Add(b.Lease)
		}
	}
	freeze := b.frozen.After(now)
	b.expire(now)
	dem := max(r.Want, r.Demand)
	if dem > 0 {
		b.demands[holder] = demand{n: dem, expires: now.Add(b.Lease)}
	} else {
		delete(b.demands, holder)
	}
	mine := b.mine(holder)
	fair := b.fair(holder)
	for len(mine) > r.Want {
		delete(b.slots, fmt.Sprintf("%s:%d", holder, mine[len(mine)-1]))
		mine = mine[:len(mine)-1]
	}
	limit := min(r.Want, fair)
	if freeze {
		limit = min(r.Want, max(len(mine), r.Prior))
	}
	total := len(b.slots)
	had := map[int]bool{}
	for _, n := range mine {
		had[n] = true
	}
	for i := 1; len(mine) < limit && total < b.Permits; i++ {
		if !had[i] {
			mine = append(mine, i)
			b.slots[fmt.Sprintf("%s:%d", holder, i)] = now
			total++
		}
	}
	for _, n := range mine {
		b.slots[fmt.Sprintf("%s:%d", holder, n)] = now.Add(b.Lease)
	}
	var left time.Duration
	if freeze {
		left = b.frozen.Sub(now)
	}
	return shared.SlotsReply{Held: len(mine), Fair: fair, Epoch: b.epoch, Frozen: left, Confirmed: true}
}

// fair is holder's max-min fair share of the room the Limiters' leases
// leave (the set's members that are no holder's slots): the demands are
// water-filled from the smallest, up to a level L; a holder demanding more
// gets L, or L + 1 for the first few by name while a remainder lasts.
func (b *Budget) fair(holder string) int {
	type hd struct {
		h string
		n int
	}
	var list []hd
	for h, d := range b.demands {
		list = append(list, hd{h, d.n})
	}
	slices.SortFunc(list, func(x, y hd) int {
		if x.n != y.n {
			return x.n - y.n
		}
		return strings.Compare(x.h, y.h)
	})
	// A holder's demand and slots are renewed together, so a holder with
	// slots has a demand: the rest are Limiters' leases.
	others := len(b.slots)
	for h := range b.demands {
		others -= len(b.mine(h))
	}
	rem, level, extra := max(0, b.Permits-others), -1, 0
	var above []string
	for i, e := range list {
		if level < 0 {
			share := rem / (len(list) - i)
			if e.n <= share {
				rem -= e.n
				continue
			}
			level, extra = share, rem-share*(len(list)-i)
		}
		above = append(above, e.h)
	}
	d := b.demands[holder].n
	if level < 0 || d <= level {
		return d
	}
	slices.Sort(above)
	if slices.Index(above, holder) < extra {
		return level + 1
	}
	return level
}

// Acquire does what a Concurrency Limiter's script does with lease id at
// now, with Holders and a Durability persistent as b's: true if it took a
// lease.
func (b *Budget) Acquire(now time.Time, id string) bool {
	if b.epoch == 0 {
		b.epoch, b.frozen = now.UnixMicro(), time.Time{}
		if !b.Persistent {
			b.frozen = now.Add(b.Lease)
		}
	}
	if b.frozen.After(now) {
		return false
	}
	b.expire(now)
	if len(b.slots) >= b.Permits {
		return false
	}
	b.slots[id] = now.Add(b.Lease)
	return true
}

// Clone returns a copy of b: what a replica that caught up now holds.
func (b *Budget) Clone() Budget {
	c := *b
	c.slots, c.demands = maps.Clone(b.slots), maps.Clone(b.demands)
	return c
}

// Bucket is a token bucket's state, as the Limiter's and Grants' scripts
// keep it: Limit tokens at most, Per added for each whole Period since the
// latest refill; a missing bucket is full.
type Bucket struct {
	Limit, Per int
	Period     time.Duration

	tokens int
	last   time.Time
	exists bool
}

func (b *Bucket) refill(now time.Time) {
	if !b.exists {
		b.tokens, b.last, b.exists = b.Limit, now, true
	}
	if p := int(now.Sub(b.last) / b.Period); p > 0 {
		b.tokens = min(b.Limit, b.tokens+p*b.Per)
		b.last = b.last.Add(time.Duration(p) * b.Period)
	}
	if b.tokens >= b.Limit {
		b.tokens, b.last = b.Limit, now
	}
}

// Claim takes up to n tokens at now, as Grants.Claim does.
func (b *Bucket) Claim(now time.Time, n int) int {
	b.refill(now)
	got := min(n, b.tokens)
	b.tokens -= got
	return got
}

// Return gives n tokens back at now, never above Limit.
func (b *Bucket) Return(now time.Time, n int) {
	b.refill(now)
	b.tokens = min(b.Limit, b.tokens+n)
	if b.tokens >= b.Limit {
		b.last = now
	}
}

// Lose forgets the bucket: the next call finds it full.
func (b *Bucket) Lose() { b.exists = false }
