package decide

import (
	"errors"
	"testing"
	"time"

	"github.com/egressd/egressd/pkg/shared"
)

var t0 = time.Unix(1_750_000_000, 0)

func at(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }

var errDown = errors.New("dial tcp: connection refused")

// slotsTick is one tick of a Slots share, at fixed instants: what the
// kernel showed, the live count after Plan's limit, Redis's answer (or
// errDown when err), and what the share must have done.
type slotsTick struct {
	ms    int
	obs   SlotsObs
	live  int
	reply shared.SlotsReply
	err   bool
	skip  bool // nothing to ask Redis: the tick ends at planLimit

	planLimit int                 // the kernel limit before asking Redis
	req       shared.SlotsRequest // what it asked
	limit     int                 // the kernel limit after the answer
	ev        Event
}

func TestSlotsTicks(t *testing.T) {
	const lease = 10 * time.Second
	cfg := SlotsConfig{Budget: 10, Lease: lease, Margin: time.Second, Idle: time.Second, Renew: time.Second}
	ok := func(held, fair int) shared.SlotsReply {
		return shared.SlotsReply{Held: held, Fair: fair, Epoch: 1, Confirmed: true}
	}
	tests := []struct {
		name  string
		mode  Mode
		adopt *SlotsObs
		// adoptUntil is the adopted rule's deadline, in ms; 0 for none.
		adoptUntil int
		ticks      []slotsTick
	}{{
		name: "grows with demand, never before Redis confirms",
		ticks: []slotsTick{
			{ms: 0, obs: SlotsObs{}, reply: ok(1, 10), req: shared.SlotsRequest{Want: 1, Demand: 1}, limit: 1},
			// 5 refused since: it asks for 1 + 5, keeps the kernel at 1
			// until Redis says 6.
			{ms: 50, obs: SlotsObs{Limit: 1, Live: 1, Refused: 5}, live: 1, reply: ok(6, 10), planLimit: 1,
				req: shared.SlotsRequest{Want: 6, Demand: 6, Prior: 1, HadState: true}, limit: 6},
			// Redis grants less than asked: the kernel gets what it got.
			{ms: 100, obs: SlotsObs{Limit: 6, Live: 6, Refused: 25}, live: 6, reply: ok(8, 8), planLimit: 6,
				req: shared.SlotsRequest{Want: 10, Demand: 10, Prior: 6, HadState: true}, limit: 8},
		},
	}, {
		name: "above its fair share: lowers the kernel first, hands back as connections close",
		ticks: []slotsTick{
			{ms: 0, obs: SlotsObs{Refused: 10}, reply: ok(10, 10), req: shared.SlotsRequest{Want: 10, Demand: 10}, limit: 10},
			// At the renewal Redis says the fair share fell to 3 (others
			// came).
			{ms: 1000, obs: SlotsObs{Limit: 10, Live: 10, Refused: 10}, live: 10, reply: ok(10, 3), planLimit: 10,
				req: shared.SlotsRequest{Want: 10, Demand: 10, Prior: 10, HadState: true}, limit: 3},
			// Kernel to 3 now; the 9 still open keep their slots.
			{ms: 1050, obs: SlotsObs{Limit: 3, Live: 9, Refused: 10}, live: 9, reply: ok(9, 3), planLimit: 3,
				req: shared.SlotsRequest{Want: 9, Demand: 10, Prior: 9, HadState: true}, limit: 3},
			// A connection admitted between the lowering and the read
			// keeps its slot too: the read is after the limit took effect.
			{ms: 1100, obs: SlotsObs{Limit: 3, Live: 2, Refused: 10}, live: 3, reply: ok(3, 3), planLimit: 3,
				req: shared.SlotsRequest{Want: 3, Demand: 3, Prior: 3, HadState: true}, limit: 3},
		},
	}, {
		name: "holds what it wants: asks Redis only to renew, every Renew",
		ticks: []slotsTick{
			{ms: 0, obs: SlotsObs{Refused: 9}, reply: ok(4, 4), req: shared.SlotsRequest{Want: 9, Demand: 9}, limit: 4},
			{ms: 50, obs: SlotsObs{Limit: 4, Live: 4, Refused: 20}, live: 4, planLimit: 4, skip: true},
			{ms: 999, obs: SlotsObs{Limit: 4, Live: 4, Refused: 30}, live: 4, planLimit: 4, skip: true},
			{ms: 1000, obs: SlotsObs{Limit: 4, Live: 4, Refused: 40}, live: 4, reply: ok(4, 6), planLimit: 4,
				req: shared.SlotsRequest{Want: 4, Demand: 10, Prior: 4, HadState: true}, limit: 4},
			// Its fair share rose: it wants more, and asks at once.
			{ms: 1050, obs: SlotsObs{Limit: 4, Live: 4, Refused: 50}, live: 4, reply: ok(6, 6), planLimit: 4,
				req: shared.SlotsRequest{Want: 6, Demand: 10, Prior: 4, HadState: true}, limit: 6},
		},
	}, {
		name: "a fair share that is its demand: more demand is told Redis at once, not at the renewal",
		ticks: []slotsTick{
			{ms: 0, obs: SlotsObs{}, reply: ok(1, 1), req: shared.SlotsRequest{Want: 1, Demand: 1}, limit: 1},
			{ms: 50, obs: SlotsObs{Limit: 1, Live: 1, Refused: 6}, live: 1, reply: ok(1, 7), planLimit: 1,
				req: shared.SlotsRequest{Want: 1, Demand: 7, Prior: 1, HadState: true}, limit: 1},
			{ms: 100, obs: SlotsObs{Limit: 1, Live: 1, Refused: 12}, live: 1, reply: ok(7, 7), planLimit: 1,
				req: shared.SlotsRequest{Want: 7, Demand: 7, Prior: 1, HadState: true}, limit: 7},
			// Told, and held: nothing to ask until the renewal.
			{ms: 150, obs: SlotsObs{Limit: 7, Live: 6, Refused: 12}, live: 6, planLimit: 7, skip: true},
		},
	}, {
		name: "idle: keeps only what is live, then nothing",
		ticks: []slotsTick{
			{ms: 0, obs: SlotsObs{Live: 0, Refused: 3}, reply: ok(3, 10), req: shared.SlotsRequest{Want: 3, Demand: 3}, limit: 3},
			{ms: 500, obs: SlotsObs{Limit: 3, Live: 1, Refused: 3}, live: 1, reply: ok(2, 10), planLimit: 2,
				req: shared.SlotsRequest{Want: 2, Demand: 2, Prior: 2, HadState: true}, limit: 2},
			{ms: 1600, obs: SlotsObs{Limit: 2, Refused: 3}, reply: ok(0, 0), planLimit: 0,
				req: shared.SlotsRequest{HadState: true}, limit: 0},
		},
	}, {
		name: "growth the replicas have not confirmed is not used",
		ticks: []slotsTick{
			{ms: 0, obs: SlotsObs{Refused: 2}, reply: ok(2, 10), req: shared.SlotsRequest{Want: 2, Demand: 2}, limit: 2},
			{ms: 50, obs: SlotsObs{Limit: 2, Live: 2, Refused: 9}, live: 2, reply: shared.SlotsReply{Held: 9, Fair: 10, Epoch: 1}, planLimit: 2,
				req: shared.SlotsRequest{Want: 9, Demand: 9, Prior: 2, HadState: true}, limit: 2, ev: Unconfirmed},
			{ms: 100, obs: SlotsObs{Limit: 2, Live: 2, Refused: 20}, live: 2, reply: ok(9, 10), planLimit: 2,
				req: shared.SlotsRequest{Want: 10, Demand: 10, Prior: 2, HadState: true}, limit: 9},
		},
	}, {
		name: "throw: keeps the share until its lease could run out in Redis",
		ticks: []slotsTick{
			{ms: 0, obs: SlotsObs{Refused: 5}, reply: ok(5, 10), req: shared.SlotsRequest{Want: 5, Demand: 5}, limit: 5},
			{ms: 50, obs: SlotsObs{Limit: 5, Live: 5, Refused: 5}, live: 5, err: true, planLimit: 5,
				req: shared.SlotsRequest{Want: 6, Demand: 6, Prior: 5, HadState: true}, limit: 5, ev: Failed},
			// While failing: no lowering, and it asks to keep all it holds.
			{ms: 600, obs: SlotsObs{Limit: 5, Live: 2, Refused: 5}, live: 2, err: true, planLimit: 5,
				req: shared.SlotsRequest{Want: 5, Demand: 5, Prior: 5, HadState: true}, limit: 5},
			// Confirmed at 0 (when that Resize was sent): lease 10 s, margin 1 s.
			{ms: 8999, obs: SlotsObs{Limit: 5, Live: 2, Refused: 5}, live: 2, err: true, planLimit: 5,
				req: shared.SlotsRequest{Want: 5, Demand: 5, Prior: 5, HadState: true}, limit: 5},
			{ms: 9000, obs: SlotsObs{Limit: 5, Live: 2, Refused: 5}, live: 2, err: true, planLimit: 5,
				req: shared.SlotsRequest{Want: 5, Demand: 5, Prior: 5, HadState: true}, limit: 0, ev: Expired},
			// Back: it asks to keep what its kernel holds, and grows from
			// there at the next tick.
			{ms: 9500, obs: SlotsObs{Limit: 0, Live: 1, Refused: 30}, live: 1, reply: ok(1, 10), planLimit: 0,
				req: shared.SlotsRequest{Want: 1, Demand: 10, Prior: 1, HadState: true}, limit: 1, ev: Recovered},
		},
	}, {
		name: "throw: the lease counts from the last confirmed Resize, not an unconfirmed renewal",
		ticks: []slotsTick{
			{ms: 0, obs: SlotsObs{Refused: 5}, reply: ok(5, 10), req: shared.SlotsRequest{Want: 5, Demand: 5}, limit: 5},
			// The renewal at 1000: replicas do not confirm it, so a
			// failover could lose it and the lease still runs from 0.
			{ms: 1000, obs: SlotsObs{Limit: 5, Live: 5, Refused: 6}, live: 5, reply: shared.SlotsReply{Held: 6, Fair: 10, Epoch: 1}, planLimit: 5,
				req: shared.SlotsRequest{Want: 6, Demand: 6, Prior: 5, HadState: true}, limit: 5, ev: Unconfirmed},
			{ms: 2000, obs: SlotsObs{Limit: 5, Live: 5, Refused: 6}, live: 5, err: true, planLimit: 5,
				req: shared.SlotsRequest{Want: 6, Demand: 6, Prior: 5, HadState: true}, limit: 5, ev: Failed},
			{ms: 9000, obs: SlotsObs{Limit: 5, Live: 2, Refused: 6}, live: 2, err: true, planLimit: 5,
				req: shared.SlotsRequest{Want: 5, Demand: 5, Prior: 5, HadState: true}, limit: 0, ev: Expired},
		},
	}, {
		name: "allow: the whole budget while Redis is away",
		mode: Allow,
		ticks: []slotsTick{
			{ms: 0, obs: SlotsObs{Refused: 3}, reply: ok(3, 10), req: shared.SlotsRequest{Want: 3, Demand: 3}, limit: 3},
			{ms: 50, obs: SlotsObs{Limit: 3, Live: 3, Refused: 3}, live: 3, err: true, planLimit: 3,
				req: shared.SlotsRequest{Want: 4, Demand: 4, Prior: 3, HadState: true}, limit: 10, ev: Failed},
			// Prior stays within what Redis confirmed, but for the live
			// connections allow admitted.
			{ms: 100, obs: SlotsObs{Limit: 10, Live: 7, Refused: 3}, live: 7, reply: ok(7, 4), planLimit: 10,
				req: shared.SlotsRequest{Want: 7, Demand: 8, Prior: 7, HadState: true}, limit: 4, ev: Recovered},
		},
	}, {
		name: "deny: nothing new while Redis is away",
		mode: Deny,
		ticks: []slotsTick{
			{ms: 0, obs: SlotsObs{Refused: 3}, reply: ok(3, 10), req: shared.SlotsRequest{Want: 3, Demand: 3}, limit: 3},
			{ms: 50, obs: SlotsObs{Limit: 3, Live: 3, Refused: 3}, live: 3, err: true, planLimit: 3,
				req: shared.SlotsRequest{Want: 4, Demand: 4, Prior: 3, HadState: true}, limit: 0, ev: Failed},
		},
	}, {
		name: "Redis lost the state: a new epoch, frozen; the share takes back what its kernel holds",
		ticks: []slotsTick{
			{ms: 0, obs: SlotsObs{Refused: 4}, reply: ok(4, 10), req: shared.SlotsRequest{Want: 4, Demand: 4}, limit: 4},
			{ms: 50, obs: SlotsObs{Limit: 4, Live: 4, Refused: 14}, live: 4, reply: shared.SlotsReply{Held: 4, Fair: 10, Epoch: 2, Frozen: lease, Confirmed: true}, planLimit: 4,
				req: shared.SlotsRequest{Want: 10, Demand: 10, Prior: 4, HadState: true}, limit: 4, ev: StateLost},
		},
	}, {
		name:  "adopted from a previous daemon: starts from the kernel's limit",
		adopt: &SlotsObs{Limit: 4, Live: 3, Refused: 100},
		ticks: []slotsTick{
			{ms: 0, obs: SlotsObs{Limit: 4, Live: 3, Refused: 100}, live: 3, reply: ok(4, 10), planLimit: 4,
				req: shared.SlotsRequest{Want: 4, Demand: 4, Prior: 4, HadState: true}, limit: 4},
		},
	}, {
		name:  "adopted, Redis unreachable: when the slots were renewed is unknown, so nothing new",
		adopt: &SlotsObs{Limit: 4, Live: 3},
		ticks: []slotsTick{
			{ms: 0, obs: SlotsObs{Limit: 4, Live: 3}, live: 3, err: true, planLimit: 4,
				req: shared.SlotsRequest{Want: 4, Demand: 4, Prior: 4, HadState: true}, limit: 0, ev: Failed | Expired},
		},
	}, {
		name:  "adopted with a deadline ahead, Redis unreachable: the slots hold until it",
		adopt: &SlotsObs{Limit: 4, Live: 3}, adoptUntil: 2000,
		ticks: []slotsTick{
			{ms: 0, obs: SlotsObs{Limit: 4, Live: 3}, live: 3, err: true, planLimit: 4,
				req: shared.SlotsRequest{Want: 4, Demand: 4, Prior: 4, HadState: true}, limit: 4, ev: Failed},
			{ms: 2000, obs: SlotsObs{Limit: 4, Live: 3}, live: 3, err: true, planLimit: 4,
				req: shared.SlotsRequest{Want: 4, Demand: 4, Prior: 4, HadState: true}, limit: 0, ev: Expired},
		},
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := cfg
			c.Mode = tt.mode
			s := NewSlots(c, t0)
			if tt.adopt != nil {
				var until time.Time
				if tt.adoptUntil != 0 {
					until = at(tt.adoptUntil)
				}
				s.Adopt(*tt.adopt, until)
			}
			for i, tk := range tt.ticks {
				now := at(tk.ms)
				p := s.Plan(tk.obs, now)
				req, ask := s.Request(p, tk.live, now)
				if ask == tk.skip {
					t.Fatalf("tick %d (+%dms): asks Redis %v, want %v", i, tk.ms, ask, !tk.skip)
				}
				if !ask {
					if p.Limit != tk.planLimit {
						t.Fatalf("tick %d (+%dms): limit %d, want %d", i, tk.ms, p.Limit, tk.planLimit)
					}
					continue
				}
				var err error
				if tk.err {
					err = errDown
				}
				limit, ev := s.Reply(p, req, tk.reply, err, now, now)
				if p.Limit != tk.planLimit || req != tk.req || limit != tk.limit || ev != tk.ev {
					t.Fatalf("tick %d (+%dms): plan limit %d, asked %+v, limit %d, events %b; want %d, %+v, %d, %b",
						i, tk.ms, p.Limit, req, limit, ev, tk.planLimit, tk.req, tk.limit, tk.ev)
				}
				if tk.err != s.View().Outage.Failing() {
					t.Fatalf("tick %d: failing %v after an error %v", i, s.View().Outage.Failing(), tk.err)
				}
			}
		})
	}
}

// TestSlotsNeverAboveConfirmed checks, over random ticks, the promise the
// simulations rely on: a limit Plan sets is never above the one observed,
// and one Reply sets is never above what Redis confirmed (but under
// FailureMode allow), nor above the last confirmed limit when the replicas
// did not confirm.
func TestSlotsNeverAboveConfirmed(t *testing.T) {
	for _, mode := range []Mode{KeepShare, Deny} {
		s := NewSlots(SlotsConfig{Budget: 8, Lease: time.Second, Margin: 200 * time.Millisecond, Idle: 300 * time.Millisecond, Mode: mode}, t0)
		limit, live, refused := 0, 0, uint64(0)
		confirmed := 0
		for i := range 5000 {
			now := at(i * 37)
			live = min(live+int(uint(i*7919)%3)-1, limit)
			live = max(live, 0)
			refused += uint64(i % 4)
			p := s.Plan(SlotsObs{Limit: limit, Live: live, Refused: refused}, now)
			if p.Limit > limit {
				t.Fatalf("mode %v tick %d: Plan raised the limit %d to %d", mode, i, limit, p.Limit)
			}
			limit = p.Limit
			req, _ := s.Request(p, live, now)
			r := shared.SlotsReply{Held: min(req.Want, int(uint(i*31)%9)), Fair: int(uint(i*17) % 9), Epoch: 1, Confirmed: i%5 != 0}
			var err error
			if i%11 == 0 {
				err = errDown
			}
			next, _ := s.Reply(p, req, r, err, now, now)
			switch {
			case err != nil:
				if next > confirmed {
					t.Fatalf("mode %v tick %d: limit %d in an outage, above the %d Redis last confirmed", mode, i, next, confirmed)
				}
			case !r.Confirmed:
				if next > max(limit, 0) && next > min(r.Held, limit) {
					t.Fatalf("mode %v tick %d: limit %d from an unconfirmed reply, was %d", mode, i, next, limit)
				}
			default:
				if next > r.Held {
					t.Fatalf("mode %v tick %d: limit %d above the %d Redis confirmed", mode, i, next, r.Held)
				}
				confirmed = r.Held
			}
			limit = next
		}
	}
}

// TestSlotsUntil: the kernel may enforce a share's limit until its slots'
// lease could run out in Redis, less the margin, from the last Resize
// Redis confirmed; then what the failure mode allows past the lease. An
// unconfirmed renewal or a failed one does not move it on.
func TestSlotsUntil(t *testing.T) {
	const lease = 10 * time.Second
	for _, tc := range []struct {
		mode  Mode
		after int
	}{{KeepShare, 0}, {Deny, 0}, {Allow, 10}} {
		s := NewSlots(SlotsConfig{Budget: 10, Lease: lease, Margin: time.Second, Idle: time.Second, Renew: time.Second, Mode: tc.mode}, t0)
		if until, _ := s.Until(); !until.IsZero() {
			t.Errorf("%v: until %v before Redis confirmed anything, want none", tc.mode, until)
		}
		tick := func(ms int, r shared.SlotsReply, err error) {
			p := s.Plan(SlotsObs{Limit: s.Limit(), Refused: 3}, at(ms))
			req, _ := s.Request(p, 0, at(ms))
			s.Reply(p, req, r, err, at(ms), at(ms+5))
		}
		for _, step := range []struct {
			ms     int
			reply  shared.SlotsReply
			err    error
			wantMs int
		}{
			{0, shared.SlotsReply{Held: 3, Fair: 10, Epoch: 1, Confirmed: true}, nil, 9000},
			{1000, shared.SlotsReply{Held: 3, Fair: 10, Epoch: 1, Confirmed: false}, nil, 9000},
			{2000, shared.SlotsReply{}, errDown, 9000},
			{3000, shared.SlotsReply{Held: 3, Fair: 10, Epoch: 1, Confirmed: true}, nil, 12000},
		} {
			tick(step.ms, step.reply, step.err)
			until, after := s.Until()
			if !until.Equal(at(step.wantMs)) || after != tc.after {
				t.Errorf("%v at %d ms: until %v, then %d; want %v, then %d", tc.mode, step.ms, until.Sub(t0), after, at(step.wantMs).Sub(t0), tc.after)
			}
		}
	}
}

// An adopted rule's deadline stays the share's until Redis confirms: a
// daemon restarted after it passed writes it back as it was, so the
// kernel's fallback holds while the first Resize is out. A rule without
// one gives none.
func TestSlotsAdoptKeepsDeadline(t *testing.T) {
	const lease = 10 * time.Second
	cfg := SlotsConfig{Budget: 10, Lease: lease, Margin: time.Second, Idle: time.Second, Renew: time.Second}
	s := NewSlots(cfg, at(20000))
	s.Adopt(SlotsObs{Limit: 5, Live: 0}, at(3000))
	if until, after := s.Until(); !until.Equal(at(3000)) || after != 0 {
		t.Fatalf("adopted a rule past its deadline: until %v, then %d; want %v, then 0", until.Sub(t0), after, at(3000).Sub(t0))
	}
	p := s.Plan(SlotsObs{Limit: 5}, at(20000))
	req, _ := s.Request(p, 0, at(20000))
	if limit, _ := s.Reply(p, req, shared.SlotsReply{Held: 0, Fair: 5, Epoch: 1, Confirmed: true}, nil, at(20000), at(20005)); limit != 0 {
		t.Errorf("Redis gave the slots away meanwhile, limit %d; want 0", limit)
	}
	if until, _ := s.Until(); !until.Equal(at(29000)) {
		t.Errorf("after Redis confirmed at 20 s: until %v, want 29s", until.Sub(t0))
	}

	s = NewSlots(cfg, t0)
	s.Adopt(SlotsObs{Limit: 5}, time.Time{})
	if until, _ := s.Until(); !until.IsZero() {
		t.Errorf("adopted a rule without a deadline: until %v, want none", until.Sub(t0))
	}
}

// Modes are named as the policy names failure modes (pkg/policy's
// FailureThrow…).
func TestModeNames(t *testing.T) {
	tests := []struct {
		m    Mode
		want string
	}{
		{KeepShare, "throw"},
		{Allow, "allow"},
		{Deny, "deny"},
		{Mode(modeLen), "Mode(3)"},
	}
	for _, tt := range tests {
		if got := tt.m.String(); got != tt.want {
			t.Errorf("Mode(%d).String() = %q, want %q", uint8(tt.m), got, tt.want)
		}
	}
}
