package decide

import (
	"time"

	"github.com/egressd/egressd/pkg/shared"
)

// SlotsConfig is a concurrency share's settings.
type SlotsConfig struct {
	// Budget is the whole budget: connections held at once by every host.
	Budget int
	// Lease is how long Redis keeps a slot after the holder's latest
	// Resize.
	Lease time.Duration
	// Margin is how long before a slot's lease could run out in Redis
	// the kernel stops admitting on it while Redis is unreachable: at
	// least the longest a tick can take.
	Margin time.Duration
	// Idle is how long a host goes without a connection or a refusal
	// before it hands its whole share back.
	Idle time.Duration
	// Renew is how often a share that wants what it holds asks Redis all
	// the same: to renew its slots' lease, and to learn its fair share
	// anew (others may have come or gone). A share that wants to grow or
	// shrink asks at once.
	Renew time.Duration
	Mode  Mode
}

// SlotsObs is what the kernel shows of a concurrency share's rule.
type SlotsObs struct {
	Limit   int    // the rule's limit now
	Live    int    // connections holding a slot of it
	Refused uint64 // refusals since the rule was made
}

// Slots is one host's share of a shared concurrency budget: the slots it
// holds in Redis and the kernel limit that enforces them. A tick is three
// calls, with the kernel and Redis between them:
//
//	p := s.Plan(observed, now)             // set the kernel limit to p.Limit
//	req, ask := s.Request(p, liveNow, now) // live read after that took effect
//	limit, ev := s.Reply(p, req, reply, err, sent, now) // if ask; set the kernel limit
//
// Plan only ever lowers the kernel limit, so that no connection is
// admitted on a slot about to go back; Reply raises it only to slots
// Redis confirmed. It is not safe for concurrent use.
type Slots struct {
	cfg SlotsConfig

	held        int       // slots Redis last confirmed to this host
	fair        int       // this host's fair share as Redis last said; -1 before it did
	epoch       int64     // the budget's epoch as Redis last said; 0 before it did
	hadState    bool      // held slots under some epoch, or adopted a rule that did
	confirmed   time.Time // when the Resize Redis last confirmed was sent
	told        int       // the demand Redis last heard from this host
	frozenUntil time.Time
	outage      Outage
	expired     bool // the failure mode dropped the limit to 0 for the lease

	limit       int // the kernel limit this share last asked for
	active      time.Time
	lastRefused uint64
}

// NewSlots returns a share that holds nothing yet.
func NewSlots(cfg SlotsConfig, now time.Time) *Slots {
	return &Slots{cfg: cfg, fair: -1, active: now}
}

// Adopt starts the share from the kernel rule a previous daemon left
// pinned: its limit was within the slots Redis confirmed then, which are
// this holder's still if their lease has not run out (the first Resize
// says). until is the rule's deadline (see Until), which the share keeps
// until Redis confirms again: a daemon restarted after it passed must not
// lift the kernel's fallback while it asks, since Redis may have given the
// slots away. A rule without one (zero) leaves when its slots were renewed
// unknown, so if Redis cannot be reached the share counts their lease as
// run out.
func (s *Slots) Adopt(o SlotsObs, until time.Time) {
	s.held, s.limit, s.hadState = o.Limit, o.Limit, true
	s.lastRefused = o.Refused
	if !until.IsZero() {
		s.confirmed = until.Add(-(s.cfg.Lease - s.cfg.Margin))
	}
}

// Inherit carries on from old, a share of the same budget under the same
// holder (the rule changed, the budget did not): the slots are the same in
// Redis and the kernel enforces them still. The fair share is the
// smaller, until Redis says what it is under the new settings.
func (s *Slots) Inherit(old *Slots) {
	cfg, fair := s.cfg, s.fair
	*s = *old
	s.cfg = cfg
	if fair >= 0 && (s.fair < 0 || fair < s.fair) {
		s.fair = fair
	}
	if s.fair > cfg.Budget {
		s.fair = cfg.Budget
	}
}

// SlotsPlan is a tick's decision before Redis is asked.
type SlotsPlan struct {
	// Limit is the kernel limit to set now: never above the limit
	// observed.
	Limit  int
	need   int // slots this host could use now
	target int // slots it should hold: need, within its fair share
}

// Plan starts a tick from what the kernel shows: the host needs a slot
// per live connection and one spare, or as many more as were refused
// since the last tick (a refusal is a connection that wanted one); idle,
// only its live ones. What it should hold is that, within its fair share.
// A share above it lowers the kernel limit now, before Request hands the
// extras back; while Redis is unreachable the failure mode's limit stays.
func (s *Slots) Plan(o SlotsObs, now time.Time) SlotsPlan {
	refused := o.Refused - min(o.Refused, s.lastRefused)
	s.lastRefused = o.Refused
	if refused > 0 || o.Live > 0 {
		s.active = now
	}
	b := s.cfg.Budget
	need := min(b, o.Live+max(1, int(min(refused, uint64(b)))))
	if now.Sub(s.active) >= s.cfg.Idle {
		need = min(b, o.Live)
	}
	target := need
	if s.fair >= 0 {
		target = min(target, s.fair)
	}
	p := SlotsPlan{Limit: o.Limit, need: need, target: target}
	if !s.outage.Failing() {
		p.Limit = min(o.Limit, target)
	}
	s.limit = p.Limit
	return p
}

// Request is what to ask Redis, given the live connections read after
// p.Limit took effect: a connection admitted before it keeps its slot.
// While Redis is unreachable it asks to keep what the host holds, which
// is how a tick learns that Redis is back. ask is false when there is
// nothing to ask this tick: the share wants what it holds, Redis answered
// lately and growth is not frozen; the tick then ends at p.Limit.
func (s *Slots) Request(p SlotsPlan, live int, now time.Time) (req shared.SlotsRequest, ask bool) {
	// What the kernel may still hold connections on: its limit (never
	// above what Redis confirmed, but under FailureMode allow) and its
	// live connections.
	prior := max(min(p.Limit, s.held), live)
	want := max(p.target, live)
	if s.outage.Failing() {
		want = prior
	}
	req = shared.SlotsRequest{Want: want, Demand: max(p.need, want), Prior: prior, HadState: s.hadState}
	// A fair share below the demand Redis heard is the level others
	// leave: more demand would not raise it. One at that demand may be
	// the demand itself, which more would raise.
	unheard := req.Demand > s.told && s.fair >= s.told
	settled := s.epoch != 0 && want == s.held && !unheard && now.Sub(s.confirmed) < s.cfg.Renew && !now.Before(s.frozenUntil)
	return req, s.outage.Failing() || !settled
}

// Reply takes Redis's answer to req (or the error that stood for it; sent
// is when req was sent) and returns the kernel limit to set, with the
// events worth a log line.
func (s *Slots) Reply(p SlotsPlan, req shared.SlotsRequest, r shared.SlotsReply, err error, sent, now time.Time) (limit int, ev Event) {
	if err != nil {
		return s.fail(p, err, now)
	}
	if s.outage.Failing() {
		ev |= Recovered
	}
	if s.epoch != 0 && r.Epoch != s.epoch {
		ev |= StateLost
	}
	s.outage, s.expired = Outage{}, false
	s.held, s.fair, s.epoch, s.hadState = r.Held, r.Fair, r.Epoch, true
	s.told = req.Demand
	if r.Confirmed {
		// An unconfirmed renewal a failover could lose: the lease still
		// runs from the last confirmed one.
		s.confirmed = sent
	}
	s.frozenUntil = now.Add(r.Frozen)
	// Within the fair share Redis has just said, too: a host above it
	// stops admitting beyond it now, not a tick later.
	limit = min(r.Held, p.target, r.Fair)
	if !r.Confirmed && limit > p.Limit {
		// Growth a failover could still lose: not used until confirmed.
		limit, ev = p.Limit, ev|Unconfirmed
	}
	s.limit = limit
	return limit, ev
}

// fail puts the failure mode in force.
func (s *Slots) fail(p SlotsPlan, err error, now time.Time) (limit int, ev Event) {
	if !s.outage.Failing() {
		s.outage.Since, ev = now, Failed
	}
	s.outage.Err = err
	switch s.cfg.Mode {
	case Allow:
		limit = s.cfg.Budget
	case Deny:
		limit = 0
	default:
		// The share held, until its lease could have run out in Redis:
		// then another host may be given those slots.
		limit = min(p.Limit, s.held)
		if s.confirmed.IsZero() || !now.Before(s.confirmed.Add(s.cfg.Lease-s.cfg.Margin)) {
			if !s.expired {
				ev |= Expired
			}
			limit, s.expired = 0, true
		}
	}
	s.limit = limit
	return limit, ev
}

// SlotsView is what the API and the metrics show of a concurrency share.
type SlotsView struct {
	Held, Fair, Limit int
	Epoch             int64
	FrozenUntil       time.Time
	Outage            Outage
	// Expired says the failure mode dropped the limit to 0: the slots'
	// lease may have run out in Redis.
	Expired bool
}

// Limit is the kernel limit the share asks for now: what Plan, Reply or
// the failure mode last decided.
func (s *Slots) Limit() int { return s.limit }

// Until is until when the kernel may enforce Limit, and the limit after:
// the slots' lease could run out in Redis, less Margin, from the last
// Resize Redis confirmed, and then what the failure mode allows past the
// lease (none, or under Allow the whole budget). Each confirmed Resize
// moves it on; a daemon that stops (killed, paused) leaves its kernel to
// fall back on its own, rather than go on spending slots Redis may have
// given to other hosts since. Zero before Redis confirmed any slots; an
// adopted share keeps its rule's until Redis confirms (see Adopt).
func (s *Slots) Until() (time.Time, int) {
	if s.confirmed.IsZero() {
		return time.Time{}, 0
	}
	after := 0
	if s.cfg.Mode == Allow {
		after = s.cfg.Budget
	}
	return s.confirmed.Add(s.cfg.Lease - s.cfg.Margin), after
}

// View returns the share as it stands.
func (s *Slots) View() SlotsView {
	return SlotsView{Held: s.held, Fair: s.fair, Limit: s.limit, Epoch: s.epoch, FrozenUntil: s.frozenUntil, Outage: s.outage, Expired: s.expired}
}
