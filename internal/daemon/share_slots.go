package daemon

import (
	"context"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/egressd/egressd/internal/daemon/decide"
	"github.com/egressd/egressd/pkg/loader"
	"github.com/egressd/egressd/pkg/policy"
	"github.com/egressd/egressd/pkg/shared"
)

// slotShare is this host's part of a shared concurrency budget: slots it
// holds in Redis, enforced as the kernel rule's limit.
type slotShare struct {
	shareLoop
	slots *decide.Slots // under mu
	store *shared.Slots
}

func newSlotShare(env shareEnv, spec policy.Rule, client redis.UniversalClient, hostID string, budget int, now time.Time) (*slotShare, error) {
	sh := spec.Shared
	lease := sh.Lease
	if lease == 0 {
		lease = policy.DefaultLease
	}
	durability := shared.Ephemeral
	if sh.Durability == policy.DurabilityPersistent {
		durability = shared.Persistent
	}
	store, err := shared.NewSlots(client, shared.SlotsOptions{
		Key: sh.Key, Permits: budget, Holder: hostID + ":" + spec.Name,
		LeaseDuration: lease, Durability: durability, Replicas: sh.Replicas,
	})
	if err != nil {
		return nil, err
	}
	cfg := decide.SlotsConfig{Budget: budget, Lease: lease, Margin: shareMargin, Idle: shareIdle, Renew: min(lease/4, shareRenew), Mode: shareMode(sh.FailureMode)}
	return &slotShare{shareLoop: shareLoop{env: env, rule: spec.Name, spec: spec}, slots: decide.NewSlots(cfg, now), store: store}, nil
}

func (s *slotShare) rate() bool { return false }

func (s *slotShare) shape(r *loader.Rule) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r.Limit = uint32(s.slots.Limit())
	until, after := s.slots.Until()
	r.Until, r.LimitAfter = until, uint32(after)
}

func (s *slotShare) sameBudget(other share) bool {
	o, ok := other.(*slotShare)
	return ok && s.sameRedis(&o.shareLoop)
}

func (s *slotShare) inherit(old share) {
	o := old.(*slotShare)
	o.mu.Lock()
	defer o.mu.Unlock()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.slots.Inherit(o.slots)
	s.answered = o.answered
}

func (s *slotShare) adopt(kr loader.Rule, st loader.Stats) {
	if kr.Shape != loader.ShapeConcurrency {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.slots.Adopt(decide.SlotsObs{Limit: int(kr.Limit), Live: int(st.Live), Refused: st.Refused}, kr.Until)
}

func (s *slotShare) start() { s.run(s.tick) }

func (s *slotShare) end(release bool, live int) {
	if !s.halt() || !release || live < 0 {
		return
	}
	s.mu.Lock()
	keep := min(live, s.slots.View().Held)
	s.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), shareCallTimeout)
	defer cancel()
	if _, err := s.store.Resize(ctx, shared.SlotsRequest{Want: keep}); err != nil {
		s.env.log.Warn("shared budget: slots not handed back; they expire", "rule", s.rule, "err", err)
		return
	}
	if keep > 0 {
		s.env.log.Info("shared budget: slots of open connections kept until their lease runs out", "rule", s.rule, "slots", keep)
	}
}

// tick runs one tick at now: lower the kernel first when shrinking, read
// what is live after that, ask Redis, and raise the kernel only to what
// Redis confirmed.
func (s *slotShare) tick(ctx context.Context, now time.Time) {
	began := time.Now()
	kr, st, err := observe(s.env.dp, s.rule)
	if err != nil {
		return // not in the kernel (pending, or being replaced)
	}
	s.mu.Lock()
	p := s.slots.Plan(decide.SlotsObs{Limit: int(kr.Limit), Live: int(st.Live), Refused: st.Refused}, now)
	s.mu.Unlock()
	live := int(st.Live)
	if p.Limit != int(kr.Limit) {
		if !s.env.write(s) {
			return
		}
		// Connections admitted before the lowering took effect keep
		// their slots.
		n, err := s.env.dp.Live(s.rule)
		if err != nil {
			return
		}
		live = int(n)
	}
	s.mu.Lock()
	req, ask := s.slots.Request(p, live, now)
	s.mu.Unlock()
	if !ask {
		return
	}
	cctx, cancel := context.WithTimeout(ctx, shareCallTimeout)
	reply, err := s.store.Resize(cctx, req)
	cancel()
	if ctx.Err() != nil {
		return // stopping: the answer no longer matters
	}
	s.mu.Lock()
	_, ev := s.slots.Reply(p, req, reply, err, now, after(now, began))
	s.count(ev, err)
	s.mu.Unlock()
	s.env.write(s) // a no-op when the kernel has it already
	s.logEvents(ev, err)
}

func (s *slotShare) view() shareView {
	s.mu.Lock()
	defer s.mu.Unlock()
	v := s.baseView()
	v.slots = s.slots.View()
	v.outage = v.slots.Outage
	v.frozen = time.Now().Before(v.slots.FrozenUntil)
	return v
}

// observe reads a share's kernel rule and its counts.
func observe(dp datapath, rule string) (loader.Rule, loader.Stats, error) {
	kr, err := dp.Rule(rule)
	if err != nil {
		return kr, loader.Stats{}, err
	}
	st, err := dp.Stats(rule)
	return kr, st, err
}
