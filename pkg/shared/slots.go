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
	name   string
	keys   []string // the set, the demands, their expiries
	client redis.Scripter
	holder string
	args   []any // slotsLua's ARGV: permits, lease µs, prefix; Resize appends the rest
}

// NewSlots returns a holder's slots over client (as [New]'s), or an
// [*OptionsError] listing every problem with opts. It holds nothing until
// Resize.
func NewSlots(client redis.Scripter, opts SlotsOptions) (*Slots, error) {
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	lease := opts.LeaseDuration
	if lease == 0 {
		lease = DefaultLeaseDuration
	}
	return &Slots{
		name:   opts.Key,
		keys:   []string{opts.Key, companion(opts.Key, ":demand"), companion(opts.Key, ":demand-expiry")},
		client: client,
		holder: opts.Holder,
		args:   []any{opts.Permits, lease.Microseconds(), opts.Holder + ":"},
	}, nil
}

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

// Resize makes this holder hold want slots, or as many as its fair share
// and the budget's room allow, and renews every one it keeps for
// LeaseDuration; it returns how many it holds and its fair share. One
// atomic script drops expired leases, records demand (how many slots the
// holder could use now; below want counts as want), removes this holder's
// extras or adds slots while it is under its share and the budget has
// room, and renews. Resize(held, demand) is the renewal, and Resize(0, 0)
// releases every slot and withdraws the demand. It gives up slots only
// when want is below what it holds, never for lack of room: a holder above
// its fair share (others demanded more since it grew) should stop taking
// work beyond the share and Resize down as its work drains.
//
// The fair share divides the Permits that Limiters' leases leave among the
// holders with a demand recorded in the last LeaseDuration, max-min: a
// holder demanding less than an equal part gets all it demands, and the
// rest is split equally among the others.
//
// want and demand must not be negative. A failure is a [*StoreError]
// (retryable Redis replies are retried first), or ctx's error once ctx is
// done; either way the slots held are unknown until a Resize succeeds.
func (s *Slots) Resize(ctx context.Context, want, demand int) (held, fair int, err error) {
	if want < 0 || demand < 0 {
		return 0, 0, fmt.Errorf("shared slots %s resize: want %d and demand %d must not be negative", s.name, want, demand)
	}
	if err := ctx.Err(); err != nil {
		return 0, 0, err
	}
	args := append(s.args[:len(s.args):len(s.args)], want, max(want, demand), s.holder)
	vals, err := runScript(ctx, s.client, slotsLua, s.name, "resize", s.keys, 2, args...)
	if err != nil {
		return 0, 0, err
	}
	return int(vals[0]), int(vals[1]), nil
}
