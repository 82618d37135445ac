package decide

import (
	"testing"
	"time"

	"github.com/egressd/egressd/pkg/shared"
)

// grantsTick is one tick of a Grants share at a fixed instant: what the
// kernel showed and what the share planned; then, for a claim, Redis's
// answer and the kernel enforcement it led to, or, for a return, what the
// kernel gave back and how many went to Redis.
type grantsTick struct {
	ms  int
	obs GrantsObs

	plan GrantsPlan

	got       uint64 // Claim: permits Redis gave
	seg       int64  // and the window's segment it counted them in
	confirmed bool
	err       bool
	kernel    GrantsKernel
	ev        Event

	taken, granted uint64 // Return: what the kernel gave back, its grant after
	back           uint64 // how many may go to Redis
	since          int64  // the segment of the oldest claim they came from
}

func TestGrantsTicks(t *testing.T) {
	cfg := GrantsConfig{Batch: 10, Margin: 100 * time.Millisecond, Idle: time.Second, RateWindow: 5 * time.Second}
	tests := []struct {
		name   string
		window time.Duration
		mode   Mode
		ticks  []grantsTick
	}{{
		name: "keeps a batch ahead of demand, plus what was refused",
		ticks: []grantsTick{
			{ms: 0, obs: GrantsObs{}, plan: GrantsPlan{Op: Claim, N: 10}, got: 10, confirmed: true, kernel: GrantsKernel{Granted: 10}},
			// 4 unspent of 10: under half a batch, and 3 refused.
			{ms: 50, obs: GrantsObs{Granted: 10, Spent: 6, Refused: 3}, plan: GrantsPlan{Op: Claim, N: 13, base: 10}, got: 13, confirmed: true, kernel: GrantsKernel{Granted: 23}},
			// 17 unspent: enough.
			{ms: 100, obs: GrantsObs{Granted: 23, Spent: 6, Refused: 3, Live: 1}, plan: GrantsPlan{Op: Hold}},
			// Redis had only 2 left.
			{ms: 150, obs: GrantsObs{Granted: 23, Spent: 20, Refused: 3}, plan: GrantsPlan{Op: Claim, N: 10, base: 23}, got: 2, confirmed: true, kernel: GrantsKernel{Granted: 25}},
		},
	}, {
		name: "idle: hands back every unspent permit but one",
		ticks: []grantsTick{
			{ms: 0, obs: GrantsObs{}, plan: GrantsPlan{Op: Claim, N: 10}, got: 10, confirmed: true, kernel: GrantsKernel{Granted: 10}},
			{ms: 100, obs: GrantsObs{Granted: 10, Spent: 2}, plan: GrantsPlan{Op: Hold}},
			{ms: 1200, obs: GrantsObs{Granted: 10, Spent: 2}, plan: GrantsPlan{Op: Return, Keep: 1}, taken: 7, granted: 3, back: 7},
			{ms: 1300, obs: GrantsObs{Granted: 3, Spent: 2}, plan: GrantsPlan{Op: Hold}},
		},
	}, {
		name:   "sliding window: only permits claimed within the window go back",
		window: 1500 * time.Millisecond,
		ticks: []grantsTick{
			{ms: 0, obs: GrantsObs{}, plan: GrantsPlan{Op: Claim, N: 10}, got: 10, seg: 100, confirmed: true, kernel: GrantsKernel{Granted: 10}},
			{ms: 600, obs: GrantsObs{Granted: 10, Spent: 6, Live: 1}, plan: GrantsPlan{Op: Claim, N: 10, base: 10}, got: 4, seg: 106, confirmed: true, kernel: GrantsKernel{Granted: 14}},
			// Idle since 600: at 1700 the first claim is past the window
			// (less the margin); of the 7 taken back, only the newest
			// claim's 4 still count in it.
			{ms: 1700, obs: GrantsObs{Granted: 14, Spent: 6}, plan: GrantsPlan{Op: Return, Keep: 1}, taken: 7, granted: 7, back: 4, since: 106},
		},
	}, {
		name:   "sliding window: a return is bounded by the oldest claim it takes from",
		window: 10 * time.Second,
		ticks: []grantsTick{
			{ms: 0, obs: GrantsObs{}, plan: GrantsPlan{Op: Claim, N: 10}, got: 10, seg: 100, confirmed: true, kernel: GrantsKernel{Granted: 10}},
			{ms: 100, obs: GrantsObs{Granted: 10, Spent: 6}, plan: GrantsPlan{Op: Claim, N: 10, base: 10}, got: 10, seg: 101, confirmed: true, kernel: GrantsKernel{Granted: 20}},
			{ms: 200, obs: GrantsObs{Granted: 20, Spent: 6, Live: 1}, plan: GrantsPlan{Op: Hold}},
			// 14 unspent: the second claim's 10 and the first's 4, of
			// which the kernel keeps one.
			{ms: 1300, obs: GrantsObs{Granted: 20, Spent: 6}, plan: GrantsPlan{Op: Return, Keep: 1}, taken: 13, granted: 7, back: 13, since: 100},
			{ms: 1400, obs: GrantsObs{Granted: 7, Spent: 7, Live: 1}, plan: GrantsPlan{Op: Claim, N: 10, base: 7}, got: 10, seg: 114, confirmed: true, kernel: GrantsKernel{Granted: 17}},
			{ms: 1500, obs: GrantsObs{Granted: 17, Spent: 8}, plan: GrantsPlan{Op: Hold}},
			// The 8 taken are the third claim's: the others' went back
			// or were spent.
			{ms: 2600, obs: GrantsObs{Granted: 17, Spent: 8}, plan: GrantsPlan{Op: Return, Keep: 1}, taken: 8, granted: 9, back: 8, since: 114},
		},
	}, {
		name: "claims the replicas did not confirm are not granted",
		ticks: []grantsTick{
			{ms: 0, obs: GrantsObs{}, plan: GrantsPlan{Op: Claim, N: 10}, got: 10, confirmed: false, kernel: GrantsKernel{Granted: 0}, ev: Unconfirmed},
			{ms: 50, obs: GrantsObs{Refused: 2}, plan: GrantsPlan{Op: Claim, N: 12}, got: 12, confirmed: true, kernel: GrantsKernel{Granted: 12}},
		},
	}, {
		name: "throw: the rate claimed lately, as a bucket, until Redis answers",
		ticks: []grantsTick{
			{ms: 0, obs: GrantsObs{}, plan: GrantsPlan{Op: Claim, N: 10}, got: 10, confirmed: true, kernel: GrantsKernel{Granted: 10}},
			{ms: 100, obs: GrantsObs{Granted: 10, Spent: 8}, plan: GrantsPlan{Op: Claim, N: 10, base: 10}, got: 10, confirmed: true, kernel: GrantsKernel{Granted: 20}},
			{ms: 200, obs: GrantsObs{Granted: 20, Spent: 16}, plan: GrantsPlan{Op: Claim, N: 10, base: 20}, err: true,
				kernel: GrantsKernel{Granted: 20, PerSecond: 4, Burst: 10}, ev: Failed}, // 20 in 5 s
			// Failing: every tick claims, from what the kernel spent.
			{ms: 800, obs: GrantsObs{Granted: 20, Spent: 16}, plan: GrantsPlan{Op: Claim, N: 10, base: 16}, err: true, kernel: GrantsKernel{Granted: 20, PerSecond: 4, Burst: 10}},
			{ms: 900, obs: GrantsObs{Granted: 20, Spent: 16, Refused: 5}, plan: GrantsPlan{Op: Claim, N: 15, base: 16}, got: 15, confirmed: true, kernel: GrantsKernel{Granted: 31}, ev: Recovered},
		},
	}, {
		name: "allow: the rule's own shape; deny: nothing new",
		mode: Allow,
		ticks: []grantsTick{
			{ms: 0, obs: GrantsObs{}, plan: GrantsPlan{Op: Claim, N: 10}, err: true, kernel: GrantsKernel{Own: true}, ev: Failed},
		},
	}, {
		name: "deny: nothing new while Redis is away",
		mode: Deny,
		ticks: []grantsTick{
			{ms: 0, obs: GrantsObs{}, plan: GrantsPlan{Op: Claim, N: 10}, got: 10, confirmed: true, kernel: GrantsKernel{Granted: 10}},
			{ms: 100, obs: GrantsObs{Granted: 10, Spent: 9}, plan: GrantsPlan{Op: Claim, N: 10, base: 10}, err: true, kernel: GrantsKernel{Granted: 10, Closed: true}, ev: Failed},
		},
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := cfg
			c.Window, c.Mode = tt.window, tt.mode
			g := NewGrants(c, t0)
			for i, tk := range tt.ticks {
				now := at(tk.ms)
				p := g.Plan(tk.obs, now)
				if p != tk.plan {
					t.Fatalf("tick %d (+%dms): plan %+v, want %+v", i, tk.ms, p, tk.plan)
				}
				switch p.Op {
				case Claim:
					var err error
					if tk.err {
						err = errDown
					}
					k, ev := g.Claimed(p, shared.Claimed{Got: int(tk.got), Segment: tk.seg, Confirmed: tk.confirmed}, err, now)
					if k != tk.kernel || ev != tk.ev {
						t.Fatalf("tick %d: kernel %+v, events %b; want %+v, %b", i, k, ev, tk.kernel, tk.ev)
					}
				case Return:
					if back, since := g.Reclaimed(tk.taken, tk.granted, now); back != tk.back || since != tk.since {
						t.Fatalf("tick %d: %d may go back, claimed from segment %d on; want %d from %d", i, back, since, tk.back, tk.since)
					}
					g.Returned(tk.back, nil)
				}
			}
		})
	}
}
