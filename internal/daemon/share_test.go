package daemon

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/egressd/egressd/internal/redistest"
	"github.com/egressd/egressd/pkg/policy"
)

// TestShareFollowsRuleChanges: a shared rule's slots are claimed when it
// is installed, carried over when its limit changes on the same key, and
// handed back when the rule goes.
func TestShareFollowsRuleChanges(t *testing.T) {
	rds := redistest.Start(t)
	rdb := rds.Client(t)
	rule := func(limit int) string {
		return fmt.Sprintf("rules:\n  - name: pool\n    destination: 127.0.0.9\n    concurrency: %d\n    shared: {redis: %q, key: pool, durability: persistent}\n", limit, rds.URL())
	}
	d := newTestDaemon(t, rule(10))
	slots := func() int64 {
		n, err := rdb.ZCard(context.Background(), "pool").Result()
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		for deadline := time.Now().Add(5 * time.Second); !cond(); time.Sleep(20 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%s: never happened", what)
			}
		}
	}
	// Idle, the host holds its one spare slot until the idle spell ends.
	waitFor("a spare slot claimed", func() bool { return slots() == 1 })
	first := d.entries["pool"].share
	if k, _ := d.dp.Rule("pool"); k.Limit != 1 {
		t.Errorf("kernel limit %d with one slot held, want 1", k.Limit)
	}

	apply := func(text string) {
		t.Helper()
		p, err := policy.Parse([]byte(text))
		if err != nil {
			t.Fatal(err)
		}
		if err := d.install(context.Background(), p); err != nil {
			t.Fatal(err)
		}
	}
	apply(rule(12))
	d.mu.Lock()
	next := d.entries["pool"].share
	d.mu.Unlock()
	if next == first {
		t.Fatal("a changed rule kept its old share")
	}
	d.mu.Lock()
	limit := next.limit
	d.mu.Unlock()
	if v := next.view(); v.slots.Held != 1 || limit != 1 {
		t.Errorf("the new share starts with %d slots, limit %d; want the old share's 1 and 1", v.slots.Held, limit)
	}
	if k, _ := d.dp.Rule("pool"); k.Limit != 1 {
		t.Errorf("kernel limit %d right after the change, want the share carried over (1)", k.Limit)
	}
	time.Sleep(200 * time.Millisecond)
	if n := slots(); n != 1 {
		t.Errorf("%d slots in Redis after the change, want the same one (the old share must not release it)", n)
	}

	apply("rules: []\n")
	waitFor("the slots handed back when the rule went", func() bool { return slots() == 0 })
}
