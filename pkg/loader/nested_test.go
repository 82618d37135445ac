//go:build linux

package loader

import (
	"io"
	"net"
	"net/netip"
	"testing"

	"github.com/egressd/egressd/internal/privtest"
)

// openOn loads a datapath attached to cg with its own pins.
func openOn(t *testing.T, cg string) *Datapath {
	t.Helper()
	d, err := Open(&Config{Cgroup: cg, PinDir: privtest.PinDir(t), MaxRules: 64, VerifierLog: true})
	if err != nil {
		t.Fatalf("open on %s: %v", cg, err)
	}
	t.Cleanup(func() {
		if err := d.Uninstall(); err != nil {
			t.Errorf("uninstall: %v", err)
		}
	})
	return d
}

// closeFirstServer answers each connection with a byte and closes it, as
// an HTTP/1.0 server does: the client's socket sees the peer's FIN
// (CLOSE_WAIT) before its own close().
func closeFirstServer(t *testing.T) netip.AddrPort {
	return serve(t, "tcp4", "127.0.0.1:0", func(c net.Conn) {
		c.Write([]byte{1})
		c.Close()
	})
}

// TestNestedDatapaths: two datapaths on a cgroup and its child, loaded in
// either order, each with or without a rule for the same destination,
// each keep exact counts of their own rules through connections that the
// server closes first, that it resets, and that the client closes first.
// Before sockops left alone the marks of sockets it held no state for, a
// datapath without the rule took the mark off as the server's FIN came
// in, and the other's slot never came back: the fourth connection of a
// limit of 3 was refused for good.
func TestNestedDatapaths(t *testing.T) {
	const limit = 3
	for _, tc := range []struct {
		name       string
		childFirst bool
		parentRule bool
		childRule  bool
	}{
		{"rule above, empty below, parent loaded first", false, true, false},
		{"rule above, empty below, child loaded first", true, true, false},
		{"rule below, empty above, parent loaded first", false, false, true},
		{"rule below, empty above, child loaded first", true, false, true},
		{"rules on both, parent loaded first", false, true, true},
		{"rules on both, child loaded first", true, true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			privtest.RequireRoot(t)
			parentCg := privtest.Cgroup(t, "nested")
			childCg := privtest.SubCgroup(t, parentCg, "child")
			var parent, child *Datapath
			if tc.childFirst {
				child, parent = openOn(t, childCg), openOn(t, parentCg)
			} else {
				parent, child = openOn(t, parentCg), openOn(t, childCg)
			}
			// Whether the client waits for the server to end the
			// connection before it closes its own end.
			type server struct {
				addr netip.AddrPort
				wait bool
			}
			servers := map[string]server{
				"server closes first": {closeFirstServer(t), true},
				"server resets":       {resetServer(t), true},
				"client closes first": {listen(t, "tcp4", "127.0.0.1:0"), false},
			}
			local := []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}
			limited := map[*Datapath]bool{parent: tc.parentRule, child: tc.childRule}
			for d, on := range limited {
				if on {
					put(t, d, Rule{Name: "local", Dests: local, Limit: limit})
				}
			}
			privtest.Join(t, childCg)
			for how, srv := range servers {
				// Three times the limit, one at a time: a slot lost on
				// any of them refuses the last ones.
				for i := range 3 * limit {
					c, err := net.Dial("tcp4", srv.addr.String())
					if err != nil {
						t.Fatalf("%s: connection %d: %v", how, i, err)
					}
					c.Write([]byte{1})
					if srv.wait {
						io.Copy(io.Discard, c)
					}
					c.Close()
				}
				for d, on := range limited {
					if on {
						waitLive(t, d, "local", 0)
					}
				}
			}
			// Each rule's own count: every connection admitted by each,
			// and given back to each.
			for d, on := range limited {
				if !on {
					continue
				}
				s := stats(t, d, "local")
				if want := uint64(3 * limit * len(servers)); s.Admitted != want || s.Released != want {
					t.Errorf("admitted %d, released %d; want %d each", s.Admitted, s.Released, want)
				}
				checkRecount(t, d, "local", 0)
			}
		})
	}
}
