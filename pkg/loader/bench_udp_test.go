//go:build linux

package loader

import (
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/egressd/egressd/internal/privtest"
)

// BenchmarkUDPCost reports what counting UDP flows costs a datagram sent
// to an address, the path every datagram of unconnected UDP takes (issue
// 45): the BPF programs' run time per send (kernel.bpf_stats_enabled),
// summed over every program that ran for it, and the agent's own time per
// send, with bare syscalls. The cases take turns, a round each, so that
// the machine's drift falls on all alike; figures are medians over the
// rounds, and margins and ratios are taken within a round.
//
// Sends from one socket to one destination: with nothing attached; with
// programs that do nothing at every hook the datapath attaches with a UDP
// rule (the floor any program there costs); with a UDP rule for another
// network (no rule matches), and for the other half of the destination's
// /24 (nearby: a prefix of at most 128 addresses marks each in udp_dests,
// see egressd.c, so the send finds no rule's mark as for any other
// network); and with one for it,
// the socket's flow to it open since the rounds began (an open flow). Each
// from a socket of
// its own, opened, sent one datagram and closed: the same three ways, the
// rule's case opening a flow at each send and ending it at each close
// (its figure counts both, the send's program and sock_release's, as an
// admitted TCP connection's counts its connect() and its close();
// opening-send-ns is the send's alone). And an admitted TCP connect()
// and close() under a concurrency rule, for the comparison.
func BenchmarkUDPCost(b *testing.B) {
	privtest.RequireRoot(b)
	udpSink, tcpSink := udpSink(b), sinkServer(b)
	local := []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}
	flows := &Rule{Name: "udp", Dests: local, Limit: 1 << 20, Protocols: ProtoUDP}
	hooks := slices.Concat(connPrograms, udpPrograms)
	cases := []*costCase{
		{name: "nothing attached", bare: true, cmd: "udp-send"},
		{name: "empty programs", empty: hooks, cmd: "udp-send"},
		{name: "no-match", rule: &Rule{Name: "other", Dests: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}, Limit: 1000, Protocols: ProtoUDP}, cmd: "udp-send"},
		{name: "no-match nearby", rule: &Rule{Name: "other", Dests: []netip.Prefix{netip.MustParsePrefix("127.0.0.128/25")}, Limit: 1000, Protocols: ProtoUDP}, cmd: "udp-send"},
		{name: "open flow", rule: flows, cmd: "udp-send"},
		{name: "nothing attached, new socket", bare: true, cmd: "udp-open"},
		{name: "empty programs, new socket", empty: hooks, cmd: "udp-open"},
		{name: "opening", rule: flows, cmd: "udp-open"},
		{name: "tcp admitted", rule: &Rule{Name: "c", Dests: local, Limit: 1000}},
	}
	nothing, empty, noMatch, near, open, opening, tcp := cases[0], cases[1], cases[2], cases[3], cases[4], cases[7], cases[8]
	const sends, opens = 1000, 200 // per round
	perRound := func(c *costCase) (netip.AddrPort, int) {
		switch c.cmd {
		case "udp-send":
			return udpSink, sends
		case "udp-open":
			return udpSink, opens
		}
		return tcpSink, opens
	}
	for _, c := range cases {
		c.setUp(b)
		// Before the statistics count: the open flow's first datagram
		// opens it here.
		target, n := perRound(c)
		if reply := c.agent.Call(b, "%s %s %d", c.cmd, target, n); !strings.HasPrefix(reply, "ok") {
			b.Fatalf("%s: %s", c.name, reply)
		}
	}
	stats, err := EnableStats()
	if err != nil {
		b.Fatal(err)
	}
	defer stats.Close()
	rounds := 0
	for b.Loop() {
		for _, c := range cases {
			target, n := perRound(c)
			c.round(b, target, n)
		}
		rounds++
	}
	b.Logf("%-29s %6s %7s  per program: ns (runs); per send (new socket: per socket), median of %d rounds of %d sends or %d sockets",
		"case", "BPF ns", "wall ns", rounds, sends, opens)
	for _, c := range cases {
		b.Logf("%-29s %6.0f %7.0f  %s", c.name, median(c.ns), median(c.wall), c.programs(rounds))
		metric := strings.ReplaceAll(strings.ReplaceAll(c.name, ", ", "-"), " ", "-")
		b.ReportMetric(median(c.ns), metric+"-ns")
		b.ReportMetric(median(c.wall), metric+"-wall-ns")
	}
	b.ReportMetric(median(opening.progs["sendmsg4"]), "opening-send-ns")
	// The targets, each within a round.
	b.ReportMetric(medianOf(rounds, func(i int) float64 { return noMatch.ns[i] - empty.ns[i] }), "no-match-over-floor-ns")
	b.ReportMetric(medianOf(rounds, func(i int) float64 { return near.ns[i] - empty.ns[i] }), "no-match-nearby-over-floor-ns")
	b.ReportMetric(medianOf(rounds, func(i int) float64 { return open.ns[i] - empty.ns[i] }), "open-flow-over-floor-ns")
	b.ReportMetric(medianOf(rounds, func(i int) float64 { return opening.ns[i] / tcp.ns[i] }), "opening/tcp-admitted")
	b.ReportMetric(medianOf(rounds, func(i int) float64 { return noMatch.wall[i] - nothing.wall[i] }), "no-match-over-nothing-wall-ns")
	b.ReportMetric(medianOf(rounds, func(i int) float64 { return open.wall[i] - nothing.wall[i] }), "open-flow-over-nothing-wall-ns")
	// What each rule counted: the open flow, one flow (its later sends
	// passed on it); a flow or connection each for the others, every one
	// ended; none for the rule that matches nothing.
	for _, c := range []struct {
		c        *costCase
		rule     string
		admitted int
		live     int64
	}{{noMatch, "other", 0, 0}, {near, "other", 0, 0}, {open, "udp", 1, 1}, {opening, "udp", (rounds + 1) * opens, 0}, {tcp, "c", (rounds + 1) * opens, 0}} {
		if s := waitLive(b, c.c.d, c.rule, c.live); s.Admitted != uint64(c.admitted) {
			b.Errorf("%s: admitted %d, want %d", c.c.name, s.Admitted, c.admitted)
		}
	}
}
