package daemon

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/egressd/egressd/internal/redistest"
	"github.com/egressd/egressd/pkg/loader"
	"github.com/egressd/egressd/pkg/policy"
)

// sharedPool is a policy with one shared concurrency rule "pool" of limit
// on key in r (persistent: its first use does not freeze it).
func sharedPool(r *redistest.Server, limit int, key string) string {
	return fmt.Sprintf("rules:\n  - name: pool\n    destination: 127.0.0.9\n    concurrency: %d\n    shared: {redis: %q, key: %q, durability: persistent}\n", limit, r.URL(), key)
}

// tick runs one tick of a rule's share at now, as its loop does.
func (td *testDaemon) tick(t *testing.T, rule string, now time.Time) {
	t.Helper()
	td.table.mu.Lock()
	e := td.table.entries[rule]
	td.table.mu.Unlock()
	switch s := e.share.(type) {
	case *slotShare:
		s.tick(context.Background(), now)
	case *grantShare:
		s.tick(context.Background(), now)
	default:
		t.Fatalf("rule %s has no share", rule)
	}
}

func (td *testDaemon) kernelLimit(t *testing.T, rule string) uint32 {
	t.Helper()
	r, ok := td.fake.rule(rule)
	if !ok {
		t.Fatalf("rule %s is not in the kernel", rule)
	}
	return r.Limit
}

// TestSlotShareFollowsDemand: a concurrency share's tick grows the kernel
// limit to what Redis confirmed, as connections are refused; lowers it
// first when it shrinks; and the kernel limit is what the table writes
// when the rule is planned again.
func TestSlotShareFollowsDemand(t *testing.T) {
	rds := redistest.Start(t)
	td := newTestDaemon(t)
	installed := time.Now()
	td.apply(t, sharedPool(rds, 10, t.Name()))
	e := td.table.entries["pool"]
	// The test ticks the share; its loop may have ticked once before end
	// stopped it, so the install is read from what it wrote.
	e.share.end(false, 0)
	if r, ok := td.fake.syncedRule("pool"); !ok || r.Limit != 0 {
		t.Fatalf("a new share was installed with kernel limit %d (installed %v), want 0 until Redis confirms", r.Limit, ok)
	}
	now := time.Now()
	td.tick(t, "pool", now) // no connection yet: one spare slot
	if got := td.kernelLimit(t, "pool"); got != 1 {
		t.Errorf("after a first tick: kernel limit %d, want the spare, 1", got)
	}
	// The kernel holds it until the slots' lease could run out in Redis
	// (the default lease, less the margin, from the tick that last asked
	// Redis: this one, or the loop's before it), and then admits nothing
	// new (failure mode throw) unless a tick renews it.
	lease := policy.DefaultLease - shareMargin
	if r, _ := td.fake.rule("pool"); r.Until.Before(installed.Add(lease)) || r.Until.After(now.Add(lease)) || r.LimitAfter != 0 {
		t.Errorf("after a first tick: kernel limit until %v, then %d; want the lease less the margin from the tick, then 0", r.Until.Sub(now), r.LimitAfter)
	}
	// 6 refused: Redis hears the demand (its fair share was the demand
	// of 1), then grants it.
	td.fake.set("pool", loader.Stats{Live: 1, Refused: 6})
	now = now.Add(shareTick)
	td.tick(t, "pool", now)
	td.fake.set("pool", loader.Stats{Live: 1, Refused: 12})
	now = now.Add(shareTick)
	td.tick(t, "pool", now)
	if got := td.kernelLimit(t, "pool"); got != 7 {
		t.Errorf("after 6 refused a tick: kernel limit %d, want 1 live + 6", got)
	}
	// Demand drops: the limit falls to live + 1.
	td.fake.set("pool", loader.Stats{Live: 2, Refused: 12})
	now = now.Add(shareTick)
	td.tick(t, "pool", now)
	if got := td.kernelLimit(t, "pool"); got != 3 {
		t.Errorf("with 2 live and no refusals: kernel limit %d, want 3", got)
	}
	// The table plans the rule again (a refresh): the kernel keeps the
	// share's limit, not the policy's.
	td.apply(t, sharedPool(rds, 10, t.Name()))
	if got := td.kernelLimit(t, "pool"); got != 3 {
		t.Errorf("after the rule was planned again: kernel limit %d, want the share's 3", got)
	}
}

// TestShareFollowsRuleChanges: a shared rule's slots are claimed when it
// is installed, carried over when its limit changes on the same key, and
// handed back when the rule goes.
func TestShareFollowsRuleChanges(t *testing.T) {
	rds := redistest.Start(t)
	rdb := rds.Client(t)
	td := newTestDaemon(t)
	key := t.Name()
	slots := func() int64 {
		n, err := rdb.ZCard(context.Background(), key).Result()
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	td.apply(t, sharedPool(rds, 10, key))
	first := td.table.entries["pool"].share
	first.end(false, 0)
	td.tick(t, "pool", time.Now())
	if n, k := slots(), td.kernelLimit(t, "pool"); n != 1 || k != 1 {
		t.Fatalf("after a tick: %d slots in Redis, kernel limit %d; want the spare, 1 and 1", n, k)
	}

	td.apply(t, sharedPool(rds, 12, key))
	next := td.table.entries["pool"].share
	if next == first {
		t.Fatal("a changed rule kept its old share")
	}
	if v := next.view(); v.slots.Held != 1 || td.kernelLimit(t, "pool") != 1 {
		t.Errorf("the new share starts with %d slots, kernel limit %d; want the old share's 1 and 1", v.slots.Held, td.kernelLimit(t, "pool"))
	}
	if n := slots(); n != 1 {
		t.Errorf("%d slots in Redis after the change, want the same one (the old share must not release it)", n)
	}

	// The rule goes: its slots are handed back before install returns.
	td.apply(t, "rules: []\n")
	if n := slots(); n != 0 {
		t.Errorf("%d slots in Redis after the rule went, want 0", n)
	}
}

// TestShareKeepsSlotsOfOpenConnections: a shared rule renamed, moved to
// another key or removed while its kernel rule holds open connections
// hands back at once only the slots those connections do not use: the
// rest stay claimed until their lease runs out, so that another host is
// not given slots this host's connections still use.
func TestShareKeepsSlotsOfOpenConnections(t *testing.T) {
	for _, tc := range []struct{ name, next string }{
		{"renamed", "pool2"},
		{"moved to another key", "other-key"},
		{"removed", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rds := redistest.Start(t)
			rdb := rds.Client(t)
			td := newTestDaemon(t)
			key := t.Name()
			td.apply(t, sharedPool(rds, 10, key))
			td.table.entries["pool"].share.end(false, 0) // the test ticks
			now := time.Now()
			td.tick(t, "pool", now)
			// 5 refused: the share grows to 1 live + 5.
			for _, refused := range []uint64{5, 10} {
				td.fake.set("pool", loader.Stats{Live: 1, Refused: refused})
				now = now.Add(shareTick)
				td.tick(t, "pool", now)
			}
			if got := td.kernelLimit(t, "pool"); got != 6 {
				t.Fatalf("kernel limit %d, want 6", got)
			}
			td.fake.set("pool", loader.Stats{Live: 4, Refused: 10})
			switch tc.next {
			case "pool2":
				td.apply(t, strings.Replace(sharedPool(rds, 10, key), "name: pool", "name: pool2", 1))
			case "other-key":
				td.apply(t, sharedPool(rds, 10, key+"-other"))
			default:
				td.apply(t, "rules: []\n")
			}
			var old int64
			for _, m := range rdb.ZRange(context.Background(), key, 0, -1).Val() {
				if strings.HasPrefix(m, "test-host:pool:") {
					old++
				}
			}
			if old != 4 {
				t.Errorf("the old rule's slots in Redis: %d, want its 4 open connections'", old)
			}
		})
	}
}

// TestGrantShareClaimsAndReturns: a rate share claims a batch ahead of
// demand, grants it to the kernel, and when idle takes the unspent back
// from the kernel and returns it to Redis, but one.
func TestGrantShareClaimsAndReturns(t *testing.T) {
	rds := redistest.Start(t)
	td := newTestDaemon(t)
	td.apply(t, fmt.Sprintf("rules:\n  - name: rate\n    destination: 127.0.0.8\n    perSecond: {permits: 100}\n    shared: {redis: %q, key: %q}\n", rds.URL(), t.Name()))
	td.table.entries["rate"].share.end(false, 0)
	now := time.Now()
	td.tick(t, "rate", now)
	r, _ := td.fake.rule("rate")
	if r.Shape != loader.ShapeGranted || r.Granted != 10 {
		t.Fatalf("after a first tick: %v granted %d, want granted 10 (100 ms of 100/s)", r.Shape, r.Granted)
	}
	td.fake.set("rate", loader.Stats{Spent: 3})
	now = now.Add(shareTick)
	td.tick(t, "rate", now) // 7 unspent: enough
	// Idle for a second: 6 of the 7 go back.
	now = now.Add(shareIdle)
	td.tick(t, "rate", now)
	r, _ = td.fake.rule("rate")
	if v := td.table.entries["rate"].share.view(); r.Granted != 4 || v.grants.Returned != 6 {
		t.Errorf("idle: granted %d, returned %d; want 4 (3 spent and 1 kept) and 6", r.Granted, v.grants.Returned)
	}
}

// TestShareWaitsForFirstAnswer: until a call to Redis comes back, a share
// is shown neither reachable nor unreachable, so that `limit set` of a
// shared rule on a Redis that does not answer does not say "reachable".
func TestShareWaitsForFirstAnswer(t *testing.T) {
	rds := redistest.Start(t)
	rds.Pause() // the loop's first call hangs until end cancels it
	td := newTestDaemon(t)
	td.apply(t, sharedPool(rds, 10, t.Name()))
	e := td.table.entries["pool"]
	e.share.end(false, 0)
	if got := e.share.view().control(loader.Stats{}); got.Reachable || !got.Waiting {
		t.Fatalf("before Redis answered: reachable %v, waiting %v; want false, true", got.Reachable, got.Waiting)
	}
	rds.Resume()
	td.tick(t, "pool", time.Now())
	if got := e.share.view().control(loader.Stats{}); !got.Reachable || got.Waiting {
		t.Fatalf("after Redis answered: reachable %v, waiting %v (%s); want true, false", got.Reachable, got.Waiting, got.Error)
	}
	// A change of the rule on the same budget carries the share over, and
	// what it knew of Redis with it: it does not wait again.
	rds.Pause()
	td.apply(t, sharedPool(rds, 12, t.Name()))
	next := td.table.entries["pool"].share
	next.end(false, 0)
	rds.Resume()
	if got := next.view().control(loader.Stats{}); !got.Reachable || got.Waiting {
		t.Fatalf("after the rule changed: reachable %v, waiting %v; want true, false", got.Reachable, got.Waiting)
	}
}
