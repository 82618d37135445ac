//go:build linux

package loader

import (
	"fmt"
	"net/netip"
	"testing"

	"github.com/egressd/egressd/internal/privtest"
)

// TestStormNeverOverAdmits runs many processes connecting at once and
// checks, with the server's own count, that no more than the limit were
// ever connected together.
func TestStormNeverOverAdmits(t *testing.T) {
	d, cg := open(t)
	srv := privtest.NewStormServer(t)
	const limit, procs = 5, 8
	dest := netip.MustParseAddrPort(srv.Addr)
	put(t, d, Rule{Name: "storm", Dests: []netip.Prefix{netip.PrefixFrom(dest.Addr(), 32)}, Port: dest.Port(), Limit: limit})

	var children []*privtest.Child
	for range procs {
		children = append(children, privtest.Spawn(t, cg, "storm", srv.Addr, "3s", "2ms"))
	}
	var admitted, refused, failed int64
	for _, c := range children {
		var a, r, f int64
		if _, err := fmt.Sscanf(c.Line(t), "admitted %d refused %d failed %d", &a, &r, &f); err != nil {
			t.Fatal(err)
		}
		c.Wait(t)
		admitted, refused, failed = admitted+a, refused+r, failed+f
	}
	s := waitLive(t, d, "storm", 0)
	t.Logf("%d processes: admitted %d refused %d failed %d; server saw %d, at most %d at once; kernel %+v",
		procs, admitted, refused, failed, srv.Total(), srv.Max(), s)
	if srv.Max() > limit {
		t.Fatalf("server saw %d connections at once, limit %d", srv.Max(), limit)
	}
	if srv.Max() < limit || refused == 0 || failed != 0 {
		t.Fatalf("the storm did not press the limit: max %d refused %d failed %d", srv.Max(), refused, failed)
	}
	if s.Admitted != uint64(admitted) || s.Refused != uint64(refused) || s.Released != s.Admitted {
		t.Fatalf("kernel counted %+v; processes admitted %d refused %d", s, admitted, refused)
	}
}
