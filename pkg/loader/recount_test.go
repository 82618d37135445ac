//go:build linux

package loader

import (
	"io"
	"net"
	"net/netip"
	"sync"
	"testing"

	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/internal/privtest"
)

// TestRecountDriftUnderChurn: connections that open and close while the
// states are walked are no drift, on every recount of a busy rule, and
// nothing of it is ever given back; a slot not given back is a drift, which
// churn can hide from a recount (it is within what opened and closed during
// the walk) but never make more, and the second recount in a row that sees
// it gives it back, once: under the churn if two recounts see it, else once
// the churn stops. Before the walk was bounded by what was admitted and
// released during it, most recounts of a busy rule showed drift.
func TestRecountDriftUnderChurn(t *testing.T) {
	d, cg := open(t)
	drain := func(c net.Conn) { io.Copy(io.Discard, c); c.Close() }
	busy, leaky := serve(t, "tcp4", "127.0.0.1:0", drain), serve(t, "tcp4", "127.0.0.1:0", drain)
	local := []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}
	put(t, d, Rule{Name: "busy", Dests: local, Port: busy.Port(), Limit: 1000})
	put(t, d, Rule{Name: "leaky", Dests: local, Port: leaky.Port(), Limit: 1000})
	addLive(t, d, "leaky", 1)
	rc, err := d.Recount()
	if err != nil {
		t.Fatal(err)
	}
	if b, l := rc["busy"], rc["leaky"]; b.Drift() != 0 || l.Drift() != 1 || l.GivenBack != 0 {
		t.Errorf("before churn: busy %+v drift %d, leaky %+v drift %d; want 0, and the 1 slot lost, not yet given back", b, b.Drift(), l, l.Drift())
	}
	privtest.Join(t, cg)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	stopChurn := sync.OnceFunc(func() { close(stop); wg.Wait() })
	t.Cleanup(stopChurn)
	for _, srv := range []netip.AddrPort{busy, leaky, busy, leaky} {
		wg.Go(func() {
			var open []io.Closer
			defer func() {
				for _, c := range open {
					c.Close()
				}
			}()
			for {
				select {
				case <-stop:
					return
				default:
				}
				if c, err := connect(srv); err == nil {
					open = append(open, c)
				}
				if len(open) > 20 {
					open[0].Close()
					open = open[1:]
				}
			}
		})
	}
	churned := false
	var givenBack int64
	for i := range 20 {
		// Each recount after more churn: twenty of busy's connections.
		from := stats(t, d, "busy").Admitted
		clocktest.Eventually(t, "more connections of busy", func() bool { return stats(t, d, "busy").Admitted >= from+20 })
		rc, err := d.Recount()
		if err != nil {
			t.Fatal(err)
		}
		b, l := rc["busy"], rc["leaky"]
		if b.Drift() != 0 || b.GivenBack != 0 || b.Freed != 0 || l.Drift() < 0 || l.Drift() > 1 || l.Freed != 0 {
			t.Errorf("recount %d under churn: busy %+v drift %d, leaky %+v drift %d; want no drift and nothing given back of busy, and 0 or 1 (the slot lost) of leaky", i, b, b.Drift(), l, l.Drift())
		}
		churned = churned || b.Admitted+b.Released > 0
		givenBack += l.GivenBack
	}
	stopChurn()
	if !churned {
		t.Error("no connection of busy opened or closed during any walk: the test checked nothing")
	}
	waitLive(t, d, "busy", 0)
	for range 2 {
		rc, err := d.Recount()
		if err != nil {
			t.Fatal(err)
		}
		givenBack += rc["leaky"].GivenBack
	}
	if givenBack != 1 {
		t.Errorf("leaky: %d slots given back under the churn and by two recounts after, want the 1 lost", givenBack)
	}
	waitLive(t, d, "leaky", 0)
	checkRecount(t, d, "busy", 0)
	checkRecount(t, d, "leaky", 0)
}
