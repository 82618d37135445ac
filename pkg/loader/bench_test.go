//go:build linux

package loader

import (
	"fmt"
	"net"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/egressd/egressd/internal/privtest"
)

// sinkServer accepts and closes connections until the benchmark ends.
func sinkServer(b *testing.B) netip.AddrPort {
	b.Helper()
	return serve(b, "tcp4", "127.0.0.1:0", func(c net.Conn) { c.Close() })
}

// connectClose opens and closes one loopback connection.
func connectClose(b *testing.B, target netip.AddrPort) {
	c, err := connect(target)
	if err != nil {
		b.Fatal(err)
	}
	c.Close()
}

// BenchmarkKernelCost reports the BPF programs' own run time per
// connection (kernel.bpf_stats_enabled), summed over every program that
// ran for it, for the datapath's common cases.
func BenchmarkKernelCost(b *testing.B) {
	privtest.RequireRoot(b)
	cases := []struct {
		name string
		rule *Rule
	}{
		{"no-rules", nil},
		{"no-match", &Rule{Name: "other", Dests: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}, Limit: 1000}},
		{"concurrency", &Rule{Name: "c", Dests: []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}, Limit: 1000}},
		{"per-second", &Rule{Name: "c", Dests: []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}, Shape: ShapePerSecond, Limit: MaxRate}},
		{"per-window", &Rule{Name: "c", Dests: []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}, Shape: ShapePerWindow, Limit: 1 << 30, Window: time.Second}},
		{"granted", &Rule{Name: "c", Dests: []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}, Shape: ShapeGranted, Granted: 1 << 62}},
		{"concurrency+requests", &Rule{Name: "c", Dests: []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}, Limit: 1000, Requests: true}},
	}
	srv := sinkServer(b)
	for _, tc := range cases {
		b.Run(tc.name, func(b *testing.B) {
			cg := privtest.Cgroup(b, "bench")
			d, err := Open(&Config{Cgroup: cg, PinDir: privtest.PinDir(b), MaxRules: 64})
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { d.Uninstall() })
			if tc.rule != nil {
				if err := d.Put(*tc.rule); err != nil {
					b.Fatal(err)
				}
			}
			stats, err := EnableStats()
			if err != nil {
				b.Fatal(err)
			}
			defer stats.Close()
			privtest.Join(b, cg)
			before, err := d.ProgramStats()
			if err != nil {
				b.Fatal(err)
			}
			b.ResetTimer()
			for b.Loop() {
				connectClose(b, srv)
			}
			b.StopTimer()
			after, err := d.ProgramStats()
			if err != nil {
				b.Fatal(err)
			}
			var total time.Duration
			for name, a := range after {
				per := (a.Runtime - before[name].Runtime) / time.Duration(b.N)
				b.ReportMetric(float64(per), name+"-ns/conn")
				b.ReportMetric(float64(a.Runs-before[name].Runs)/float64(b.N), name+"-runs/conn")
				total += a.Runtime - before[name].Runtime
			}
			b.ReportMetric(float64(total)/float64(b.N), "kernel-ns/conn")
		})
	}
}

// BenchmarkConnectOverhead times connect()+close() on loopback from a
// process in a cgroup with the datapath attached (a concurrency rule
// matching) and from one in a cgroup without, alternating rounds in one
// run, and reports the ratio of their medians.
func BenchmarkConnectOverhead(b *testing.B) {
	privtest.RequireRoot(b)
	srv := sinkServer(b)
	plain := privtest.Cgroup(b, "plain")
	limited := privtest.Cgroup(b, "limited")
	d, err := Open(&Config{Cgroup: limited, PinDir: privtest.PinDir(b), MaxRules: 64})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { d.Uninstall() })
	if err := d.Put(Rule{Name: "c", Dests: []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}, Limit: 1000}); err != nil {
		b.Fatal(err)
	}
	without := privtest.Spawn(b, plain, "agent")
	with := privtest.Spawn(b, limited, "agent")
	const round = 500
	var plainNs, attachedNs []float64
	for b.Loop() {
		for _, side := range []struct {
			agent *privtest.Child
			out   *[]float64
		}{{without, &plainNs}, {with, &attachedNs}} {
			var ns float64
			if _, err := fmt.Sscanf(side.agent.Call(b, "loop %s %d", srv, round), "ok %g", &ns); err != nil {
				b.Fatal(err)
			}
			*side.out = append(*side.out, ns)
		}
	}
	median := func(d []float64) float64 { slices.Sort(d); return d[len(d)/2] }
	b.ReportMetric(median(plainNs), "plain-ns/conn")
	b.ReportMetric(median(attachedNs), "attached-ns/conn")
	b.ReportMetric(median(attachedNs)/median(plainNs), "ratio")
}

// BenchmarkRuleUpdate changes an existing rule's limit, what the adaptive
// loop does on every move, and reports the median and 99th percentile.
func BenchmarkRuleUpdate(b *testing.B) {
	privtest.RequireRoot(b)
	d, err := Open(&Config{Cgroup: privtest.Cgroup(b, "update"), PinDir: privtest.PinDir(b), MaxRules: 1024})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { d.Uninstall() })
	if err := d.PutMany(manyRules(1000)); err != nil {
		b.Fatal(err)
	}
	r, err := d.Rule("r500")
	if err != nil {
		b.Fatal(err)
	}
	var took []time.Duration
	for i := 0; b.Loop(); i++ {
		r.Limit = uint32(1 + i%200)
		start := time.Now()
		if err := d.Put(r); err != nil {
			b.Fatal(err)
		}
		took = append(took, time.Since(start))
	}
	slices.Sort(took)
	b.ReportMetric(float64(took[len(took)/2]), "p50-ns")
	b.ReportMetric(float64(took[len(took)*99/100]), "p99-ns")
}

// BenchmarkLoad10kRules loads 10,000 rules in one batch into an empty
// datapath.
func BenchmarkLoad10kRules(b *testing.B) {
	privtest.RequireRoot(b)
	rules := manyRules(10_000)
	cg, pins := privtest.Cgroup(b, "load"), privtest.PinDir(b)
	for b.Loop() {
		b.StopTimer()
		d, err := Open(&Config{Cgroup: cg, PinDir: pins, MaxRules: 10_000})
		if err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		if err := d.PutMany(rules); err != nil {
			b.Fatal(err)
		}
		b.StopTimer()
		if err := d.Uninstall(); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
}
