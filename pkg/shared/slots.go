package shared

import (
	"context"
	"fmt"
	"strings"
	"time"
	"unicode"

	"github.com/redis/go-redis/v9"
)

// SlotsOptions configure [Slots]. Every holder and every Concurrency
// [Limiter] on Key must use the same Permits and LeaseDuration.
type SlotsOptions struct {
	// Key is the Redis key of the concurrency budget: a Limiter's
	// Concurrency Key, when in-process users share it. Required.
	Key string
	// Permits is the whole budget, every holder's and Limiter's leases
	// together, at least 1.
	Permits int
	// Holder is this holder's stable id, such as the host's name and the
	// rule's: non-empty, printable, without whitespace. Its slots are the
	// leases Holder + ":" + a number, so a holder restarted with the same
	// Holder takes back its own unexpired slots instead of competing with
	// them. Two live holders with one Holder are one holder: each Resize
	// undoes the other's.
	Holder string
	// LeaseDuration is how long a slot outlives the holder's latest Resize:
	// at least MinLeaseDuration; zero means DefaultLeaseDuration. Limiters
	// on Key set the key's expiry to their own LeaseDuration, so a longer
	// one here could lose its slots with the key.
	LeaseDuration time.Duration
	// Durability says whether Redis may lose the budget's state (see
	// [Durability]); it decides what a budget Redis has no record of
	// means. Every holder on Key must say the same.
	Durability Durability
	// Replicas, when above 0, makes each Resize wait (Redis's WAIT, up to
	// ReplicaWait) until that many replicas have its writes, and say
	// whether they did: slots a failover could still lose are not to be
	// used. It needs a client that pipelines (*redis.Client, a Sentinel
	// failover client, or *redis.ClusterClient).
	Replicas int
	// ReplicaWait bounds Replicas' wait; zero means DefaultReplicaWait.
	ReplicaWait time.Duration
}

// Validate reports every problem with o at once, as an [*OptionsError].
func (o *SlotsOptions) Validate() error {
	if o == nil {
		o = &SlotsOptions{}
	}
	var problems []string
	add := func(format string, args ...any) { problems = append(problems, fmt.Sprintf(format, args...)) }

	if o.Key == "" {
		add("Key is required")
	}
	if o.Permits < 1 {
		add("Permits %d must be at least 1", o.Permits)
	}
	switch {
	case o.Holder == "":
		add("Holder is required")
	case strings.ContainsFunc(o.Holder, func(r rune) bool { return unicode.IsSpace(r) || !unicode.IsPrint(r) }):
		add("Holder %q must not contain whitespace or control characters", o.Holder)
	}
	if o.LeaseDuration != 0 && o.LeaseDuration < MinLeaseDuration {
		add("LeaseDuration %v must be at least %v (0 means %v)", o.LeaseDuration, MinLeaseDuration, DefaultLeaseDuration)
	}
	problems = append(problems, replication(o.Durability, o.Replicas, o.ReplicaWait)...)
	if len(problems) == 0 {
		return nil
	}
	return &OptionsError{Problems: problems}
}

// Slots is one holder's part of a shared concurrency budget, held as a
// number of leases ("slots") in the sorted set a Concurrency [Limiter]
// keeps: a daemon holds its host's slots and enforces them there (in the
// kernel), while Limiters in other processes take leases from the same
// Permits. Holding many leases under one Holder, rather than a Lease each,
// lets the holder grow, shrink and renew them all in one call, and find them
// again after a restart.
//
// It is safe for concurrent use and keeps no goroutine: the caller renews by
// calling Resize with what it holds, more often than LeaseDuration (every
// third of it, as a Lease does). A holder that stops renewing loses its
// slots once they expire; its next Resize says how many it has again, so
// unlike a Lease it learns of the loss.
type Slots struct {
	name       string
	keys       []string // the set, the demands, their expiries, the epoch, the counts, the holders above the level
	client     redis.Scripter
	holder     string
	args       []any // slotsLua's ARGV: permits, lease µs, prefix; Resize appends the rest
	persistent string
	wait       replicaWait
}

// NewSlots returns a holder's slots over client (as [New]'s), or an
// [*OptionsError] listing every problem with opts. It holds nothing until
// Resize.
func NewSlots(client redis.Scripter, opts SlotsOptions) (*Slots, error) {
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	wait, err := newReplicaWait(client, opts.Replicas, opts.ReplicaWait)
	if err != nil {
		return nil, err
	}
	lease := opts.LeaseDuration
	if lease == 0 {
		lease = DefaultLeaseDuration
	}
	return &Slots{
		name:       opts.Key,
		keys:       budgetKeys(opts.Key),
		client:     client,
		holder:     opts.Holder,
		args:       []any{opts.Permits, lease.Microseconds(), opts.Holder + ":"},
		persistent: flag(opts.Durability == Persistent),
		wait:       wait,
	}, nil
}

// budgetKeys names a concurrency budget's keys, as slotsLua and
// concurrencyLua take them: the set, the demands, their expiries, the
// epoch, the counts, the holders above the level.
func budgetKeys(key string) []string {
	return []string{key, companion(key, ":demand"), companion(key, ":demand-expiry"), epochKey(key),
		companion(key, ":held"), companion(key, ":above")}
}

// epochKey names the key of a concurrency budget's epoch (see slotsLua).
func epochKey(key string) string { return companion(key, ":epoch") }

// companion names a key kept beside key, in the same Redis Cluster hash
// slot: key's own hash tag if it has one, else key as the tag.
func companion(key, suffix string) string {
	if i := strings.IndexByte(key, '{'); i >= 0 {
		if j := strings.IndexByte(key[i+1:], '}'); j > 0 {
			return key + suffix
		}
	}
	return "{" + key + "}" + suffix
}

// SlotsRequest is what a holder asks of [Slots.Resize].
type SlotsRequest struct {
	// Want is the slots to hold: fewer than held hands the extras back,
	// more grows the holding as far as its fair share and the budget's
	// room allow. Every slot kept is renewed for LeaseDuration.
	Want int
	// Demand is how many slots the holder could use now (below Want
	// counts as Want), recorded for the fair shares of the last
	// LeaseDuration.
	Demand int
	// Prior is how many slots the holder may still have connections on
	// (work admitted under slots Redis may have lost): all it may take
	// back while the budget's growth is frozen. At most what Redis last
	// confirmed to it.
	Prior int
	// HadState says the holder held slots of this budget before (in this
	// process or a previous one), so that a budget Redis has no record
	// of is one whose state it lost.
	HadState bool
}

// SlotsReply is what a holder holds after a Resize.
type SlotsReply struct {
	// Held is the slots the holder holds, Fair its fair share.
	Held, Fair int
	// Epoch names the budget's state in Redis: it changes only when
	// Redis lost the state and the budget began anew.
	Epoch int64
	// Frozen is how much longer the budget's growth is frozen (see
	// [Durability]); 0 when it is not.
	Frozen time.Duration
	// Confirmed is true when the Replicas asked for have the Resize's
	// writes, or none were asked for. False, a failover could still lose
	// slots it added: do not admit on those yet.
	Confirmed bool
}

// Resize makes this holder hold r.Want slots, or as many as its fair
// share and the budget's room allow, and renews every one it keeps for
// LeaseDuration. One atomic script drops expired leases, records demand,
// removes this holder's extras or adds slots while it is under its share
// and the budget has room, and renews. A Resize of what is held is the
// renewal, and a zero request releases every slot and withdraws the
// demand. It gives up slots only when Want is below what it holds, never
// for lack of room: a holder above its fair share (others demanded more
// since it grew) should stop taking work beyond the share and Resize down
// as its work drains.
//
// The fair share divides the Permits that Limiters' leases leave among the
// holders with a demand recorded in the last LeaseDuration, max-min: a
// holder demanding less than an equal part gets all it demands, and the
// rest is split equally among the others.
//
// While the budget's growth is frozen (Redis lost its state; see
// [Durability]) a holder only takes back up to r.Prior slots, whatever its
// fair share, and nothing grows beyond that.
//
// Want, Demand and Prior must not be negative. A failure is a
// [*StoreError] (retryable Redis replies are retried first), or ctx's
// error once ctx is done; either way the slots held are unknown until a
// Resize succeeds.
func (s *Slots) Resize(ctx context.Context, r SlotsRequest) (SlotsReply, error) {
	if r.Want < 0 || r.Demand < 0 || r.Prior < 0 {
		return SlotsReply{}, fmt.Errorf("shared slots %s resize: want %d, demand %d and prior %d must not be negative", s.name, r.Want, r.Demand, r.Prior)
	}
	if err := ctx.Err(); err != nil {
		return SlotsReply{}, err
	}
	args := append(s.args[:len(s.args):len(s.args)], r.Want, max(r.Want, r.Demand), s.holder, r.Prior, flag(r.HadState), s.persistent)
	vals, confirmed, err := s.wait.run(ctx, s.client, slotsLua, s.name, "resize", s.keys, 4, args...)
	if err != nil {
		return SlotsReply{}, err
	}
	return SlotsReply{Held: int(vals[0]), Fair: int(vals[1]), Epoch: vals[2], Frozen: time.Duration(vals[3]) * time.Microsecond, Confirmed: confirmed}, nil
}

// flag is a script's boolean argument.
func flag(b bool) string {
	if b {
		return "1"
	}
	return "0"
}
