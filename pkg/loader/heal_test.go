//go:build linux

package loader

import (
	"fmt"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/internal/privtest"
)

// withoutSockRelease runs fn with the datapath's sock_release program
// detached: sockets closed meanwhile are freed as by a close the kernel
// runs no sock_release for.
func withoutSockRelease(t *testing.T, d *Datapath, fn func()) {
	t.Helper()
	d.mu.Lock()
	l := d.links["sock_release"]
	delete(d.links, "sock_release")
	d.mu.Unlock()
	if err := l.Unpin(); err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	fn()
	d.mu.Lock()
	err := d.attachAll(connPrograms)
	d.mu.Unlock()
	if err != nil {
		t.Fatal(err)
	}
}

// recountUntil recounts until the recounts have freed at least want of
// the rule's slots, and returns how many they freed.
func recountUntil(t *testing.T, d *Datapath, rule string, want int64) int64 {
	t.Helper()
	var freed int64
	clocktest.Eventually(t, fmt.Sprintf("recounts to free %d slots of rule %s", want, rule), func() bool {
		rc, err := d.Recount()
		if err != nil {
			t.Fatal(err)
		}
		freed += rc[rule].Freed
		return freed >= want
	})
	return freed
}

// TestRecountFreesSlotsOfFreedSockets: sockets that hold a slot and are
// freed without their sock_release running (a kernel socket, or a close
// the kernel runs none for) keep it until a recount finds their state,
// in the socket table or in the overflow table, and gives it back; the
// states' places are free again. A 4-entry table sends most of them to
// the overflow table.
func TestRecountFreesSlotsOfFreedSockets(t *testing.T) {
	const n = 12
	d, cg := openSockTable(t, 4)
	closed := closedPort(t)
	put(t, d, Rule{Name: "r", Dests: []netip.Prefix{netip.PrefixFrom(closed.Addr(), 32)}, Port: closed.Port(), Limit: 1000})
	privtest.Join(t, cg)
	var fds []int
	for range n {
		// Refused by the peer: the socket keeps its slot until close().
		fd := socket4(t, 0)
		if err := unix.Connect(fd, sa4(closed)); err != unix.ECONNREFUSED {
			t.Fatalf("connect to a closed port: %v", err)
		}
		fds = append(fds, fd)
	}
	if inOverflow, err := d.OverflowSockets(); err != nil || inOverflow == 0 {
		t.Fatalf("%d sockets in the overflow table (%v), want some", inOverflow, err)
	}
	withoutSockRelease(t, d, func() {
		for _, fd := range fds {
			unix.Close(fd)
		}
	})
	if s := stats(t, d, "r"); s.Live != n {
		t.Fatalf("live %d after closes that ran no sock_release, want %d", s.Live, n)
	}
	freed := recountUntil(t, d, "r", n)
	s := stats(t, d, "r")
	if s.Live != 0 || s.Released != n || freed != n {
		t.Errorf("live %d, released %d, freed by the recounts %d; want 0, %d, %d", s.Live, s.Released, freed, n, n)
	}
	if held := heldEntries(t, d); len(held) != 0 {
		t.Errorf("socket table entries still held: %v", held)
	}
	if left := overflowEntries(t, d); left != 0 {
		t.Errorf("%d overflow table entries left", left)
	}
	checkRecount(t, d, "r", 0)
}

// TestRecountGivesBackLostCount: a slot the kernel counts that no state
// holds is given back by the second recount that sees it, and a drift seen
// by one recount only is not.
func TestRecountGivesBackLostCount(t *testing.T) {
	d, _ := open(t)
	put(t, d, Rule{Name: "r", Dests: []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}, Limit: 10})
	recount := func() Recount {
		t.Helper()
		rc, err := d.Recount()
		if err != nil {
			t.Fatal(err)
		}
		return rc["r"]
	}

	// Seen once, then gone: nothing given back.
	addLive(t, d, "r", 1)
	if r := recount(); r.Drift() != 1 || r.GivenBack != 0 {
		t.Fatalf("first recount of a lost slot: %+v (drift %d), want drift 1, none given back", r, r.Drift())
	}
	addLive(t, d, "r", -1)
	if r := recount(); r.Drift() != 0 || r.GivenBack != 0 {
		t.Fatalf("recount after the drift went: %+v, want none", r)
	}

	// Seen twice: given back, once.
	addLive(t, d, "r", 2)
	for i, want := range []int64{0, 2, 0} {
		if r := recount(); r.GivenBack != want {
			t.Fatalf("recount %d of 2 lost slots: %+v, want %d given back", i, r, want)
		}
	}
	if s := stats(t, d, "r"); s.Live != 0 {
		t.Errorf("live %d after the give-back, want 0", s.Live)
	}
}

// addLive adds n to the kernel's live count of rule, as a slot taken (or
// given back) that no socket holds would.
func addLive(t *testing.T, d *Datapath, rule string, n int64) {
	t.Helper()
	d.mu.Lock()
	idx, ok := d.t.byName[rule]
	d.mu.Unlock()
	if !ok {
		t.Fatalf("no rule %s", rule)
	}
	a := egressdMergeArgs{Slot: idx, Epoch: noEpoch, Live: n}
	if err := merge(&d.objs, &a); err != nil {
		t.Fatal(err)
	}
}

func TestGiveBack(t *testing.T) {
	for _, tc := range []struct {
		before, now, want int64
	}{
		{0, 0, 0},
		{0, 3, 0},  // seen once
		{3, 0, 0},  // gone
		{2, 3, 2},  // no more than both saw
		{3, 2, 2},  //
		{3, -1, 0}, // more sockets than slots now
		{-1, 3, 0}, //
	} {
		if got := giveBack(tc.before, tc.now); got != tc.want {
			t.Errorf("giveBack(%d, %d) = %d, want %d", tc.before, tc.now, got, tc.want)
		}
	}
}

// TestRecountRemarks: a connection whose marks another program took off
// before it was established is not seen to reset (its slot waits for
// close()); once the recount has put the marks back, its reset gives the
// slot back at once.
func TestRecountRemarks(t *testing.T) {
	privtest.RequireRoot(t)
	cg := privtest.Cgroup(t, "remark")
	below := privtest.SubCgroup(t, cg, "service")
	d := openOn(t, cg)
	reset := make(chan struct{})
	srv := serve(t, "tcp4", "127.0.0.1:0", func(c net.Conn) {
		<-reset
		c.(*net.TCPConn).SetLinger(0)
		c.Close()
	})
	put(t, d, Rule{Name: "r", Dests: []netip.Prefix{netip.PrefixFrom(srv.Addr(), 32)}, Port: srv.Port(), Limit: 10})
	detach := privtest.AttachFlipper(t, below, privtest.FlipClear)
	privtest.Join(t, below)
	c := dial(t, srv)
	detach()
	rc, err := d.Recount()
	if err != nil {
		t.Fatal(err)
	}
	if r := rc["r"]; r.Remarked != 1 || r.Counted != 1 {
		t.Fatalf("recount: %+v, want the one connection counted and remarked", r)
	}
	close(reset)
	waitLive(t, d, "r", 0)
	c.Close()
}

// TestSweepFreesNoLiveSocket: while clients open and close connections as
// fast as they can, one after another (each takes the socket table entry
// the one before gave back), the recount sweeps the states again and
// again: it must give back the slot of no socket but one freed without
// its sock_release. A sweep that took a state's owner for the entry's
// owner before it would give back the slot of a live connection. The
// kernel now and then runs no sock_release for a socket (see
// docs/design.md): the sock_release program's run count says how many.
func TestSweepFreesNoLiveSocket(t *testing.T) {
	// A small table: each sweep reads it in a moment, and looks at more
	// states in passing.
	d, cg := openSockTable(t, 16)
	srv := listen(t, "tcp4", "127.0.0.1:0")
	put(t, d, Rule{Name: "r", Dests: []netip.Prefix{netip.PrefixFrom(srv.Addr(), 32)}, Port: srv.Port(), Limit: 1 << 20})
	sweepDuringChurn(t, d, cg, "r", 3*time.Second, func(stop <-chan struct{}, sockets *atomic.Uint64) {
		var wg sync.WaitGroup
		for range 2 {
			wg.Go(func() {
				for !stopped(stop) {
					sockets.Add(1)
					if c, err := connect(srv); err == nil {
						c.Close()
					}
				}
			})
		}
		wg.Wait()
	})
}

// sweepDuringChurn joins cg, runs churn (which makes sockets, counting
// them, until stop closes, and returns once all are closed), and sweeps the
// states again and again for dur. It fails the test if the sweeps gave
// back more slots of rule than sockets were freed with no sock_release
// (the program's run count, from BPF stats, short of the sockets), and
// sweeps after the churn until every slot is back.
func sweepDuringChurn(t *testing.T, d *Datapath, cg, rule string, dur time.Duration, churn func(stop <-chan struct{}, sockets *atomic.Uint64)) {
	t.Helper()
	enabled, err := EnableStats()
	if err != nil {
		t.Fatal(err)
	}
	defer enabled.Close()
	releases := func() uint64 {
		st, err := d.objs.EgressdSockRelease.Stats()
		if err != nil {
			t.Fatal(err)
		}
		return st.RunCount
	}
	privtest.Join(t, cg)
	released := releases()
	var freed, swept uint64
	sweep := func() {
		err := d.sweepStates(func(it *egressdSweepItem) {
			swept++
			if egressdRecWhat(it.What)&egressdRecWhatREC_FREED != 0 {
				freed++
			}
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	stop := make(chan struct{})
	var sockets atomic.Uint64
	var wg sync.WaitGroup
	wg.Go(func() { churn(stop, &sockets) })
	for deadline := time.Now().Add(dur); time.Now().Before(deadline); {
		sweep()
	}
	close(stop)
	wg.Wait()
	// A socket the last sweep did not see may hold its slot yet, freed
	// with no sock_release: the sweeps give it back.
	clocktest.Eventually(t, "every slot back", func() bool {
		sweep()
		return stats(t, d, rule).Live == 0
	})
	ran := releases() - released
	if ran > sockets.Load() {
		t.Fatalf("sock_release ran %d times for %d sockets", ran, sockets.Load())
	}
	skipped := sockets.Load() - ran
	if freed > skipped {
		t.Errorf("the sweeps gave back %d slots of %d states looked at; %d of %d sockets were freed with no sock_release", freed, swept, skipped, sockets.Load())
	}
	if swept == 0 {
		t.Error("the sweeps found no state held: the test checked nothing")
	}
	t.Logf("%d states looked at; %d sockets, %d freed with no sock_release, %d slots given back", swept, sockets.Load(), skipped, freed)
}

func stopped(stop <-chan struct{}) bool {
	select {
	case <-stop:
		return true
	default:
		return false
	}
}
