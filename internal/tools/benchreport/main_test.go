package main

import (
	"bytes"
	"strings"
	"testing"
)

// TestUDPTargets: the UDP flow rows are judged from the figures of go test's
// lines, sub-benchmarks' included, the storms' from their runs with the
// client on a CPU of its own (not the 65,535-destination line that
// shares one), and a target no line measured says so.
func TestUDPTargets(t *testing.T) {
	out := `BenchmarkUDPCost-2   	      30	  35174616 ns/op	       46.29 no-match-over-floor-ns	        48.10 no-match-nearby-over-floor-ns	       12.50 open-flow-over-floor-ns	         0.9024 opening/tcp-admitted
BenchmarkRefusalStorm/1-client-apart-2         	       3	8412485329 ns/op	        63.89 daemon-ns/refusal	         1.292 udp/tcp-per-refusal	         1.100 tcp-spread	         1.175 udp/tcp-over-spread
BenchmarkRefusalStorm/1-client-65535-ports-2         	       3	8863959732 ns/op	         0.9283 udp/tcp-per-refusal	         1.020 tcp-spread	         1.31 udp/tcp-over-spread
BenchmarkRefusalStorm/1-client-65535-ports-apart-2         	       3	8403385280 ns/op	         1.057 udp/tcp-per-refusal	         1.100 tcp-spread	         0.9609 udp/tcp-over-spread
`
	figures := map[string]float64{}
	var b bytes.Buffer
	writeTable(&b, out, figures)
	b.Reset()
	writeTargets(&b, "UDP flow targets", udpTargets, figures)
	report := b.String()
	for _, row := range []string{
		"| UDP send no rule matches, BPF ns beyond empty programs | 20 ns | 46.3 ns | missed |",
		"| UDP send no rule matches, to another address of a rule's /24, BPF ns beyond empty programs | 20 ns | 48.1 ns | missed |",
		"| UDP send on an open flow, BPF ns beyond empty programs | 60 ns | 12.5 ns | met |",
		"| UDP flow opened and ended (its send and release) / admitted TCP connection | 1 x | 0.902 x | met |",
		"| daemon CPU per refusal, UDP / TCP beyond the TCP storm's own spread, one client | 1 x | 1.18 x | missed |",
		"| daemon CPU per refusal, UDP / TCP beyond the TCP storm's own spread, 16 clients | 1 x | not measured | |",
		"| daemon CPU per refusal, UDP / TCP beyond the TCP storm's own spread, 65,535 destinations | 1 x | 0.961 x | met |",
	} {
		if !strings.Contains(report, row+"\n") {
			t.Errorf("no row %q in\n%s", row, report)
		}
	}
}
