//go:build linux

package loader

import (
	"fmt"
	"maps"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/egressd/egressd/internal/privtest"
)

// sinkServer accepts and closes connections until the benchmark ends.
func sinkServer(b *testing.B) netip.AddrPort {
	b.Helper()
	return serve(b, "tcp4", "127.0.0.1:0", func(c net.Conn) { c.Close() })
}

// costCase is one datapath whose BPF run time per connect() (or per send)
// a benchmark measures, from a helper process in a cgroup of its own.
type costCase struct {
	name string
	rule *Rule
	// empty, when set, are the hooks that get programs doing nothing
	// (see emptyPrograms) instead of the datapath; with bare, nothing is
	// attached.
	empty []program
	bare  bool
	cmd   string // the agent's loop: "loop" admits, "refused" must fail
	held  int    // connections the agent holds open on the rule throughout
	agent *privtest.Child
	d     *Datapath // the case's, if it has one
	stats func() (map[string]ProgramStats, error)
	// ns holds, per round, the run time per connect() summed over every
	// program, and wall the agent's own time per connect(); progs, per
	// program, its run time per connect() in each round, and runs its
	// runs per connect() over all rounds.
	ns, wall []float64
	progs    map[string][]float64
	runs     map[string]float64
}

// setUp gives the case a cgroup of its own, attaches what it measures
// there and starts its agent in it.
func (c *costCase) setUp(b *testing.B) {
	b.Helper()
	cg := privtest.Cgroup(b, "bench")
	c.progs, c.runs = map[string][]float64{}, map[string]float64{}
	if c.cmd == "" {
		c.cmd = "loop"
	}
	switch {
	case c.bare:
		c.stats = func() (map[string]ProgramStats, error) { return nil, nil }
	case c.empty != nil:
		c.stats = emptyPrograms(b, cg, c.empty)
	default:
		d, err := Open(&Config{Cgroup: cg, PinDir: privtest.PinDir(b), MaxRules: 64})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { d.Uninstall() })
		if c.rule != nil {
			if err := d.Put(*c.rule); err != nil {
				b.Fatal(err)
			}
		}
		c.d, c.stats = d, d.ProgramStats
	}
	c.agent = privtest.Spawn(b, cg, "agent")
}

// round runs n connects of the case's agent and records their cost.
func (c *costCase) round(b *testing.B, target netip.AddrPort, n int) {
	before, err := c.stats()
	if err != nil {
		b.Fatal(err)
	}
	var wall float64
	if reply := c.agent.Call(b, "%s %s %d", c.cmd, target, n); !strings.HasPrefix(reply, "ok") {
		b.Fatalf("%s: %s", c.name, reply)
	} else if _, err := fmt.Sscanf(reply, "ok %g", &wall); err != nil {
		b.Fatalf("%s: %q: %v", c.name, reply, err)
	}
	after, err := c.stats()
	if err != nil {
		b.Fatal(err)
	}
	var total time.Duration
	for name, a := range after {
		d := a.Runtime - before[name].Runtime
		total += d
		c.progs[name] = append(c.progs[name], float64(d)/float64(n))
		c.runs[name] += float64(a.Runs-before[name].Runs) / float64(n)
	}
	c.ns = append(c.ns, float64(total)/float64(n))
	c.wall = append(c.wall, wall)
}

// programs says, for each program that ran, its mean run time per
// connect() over the rounds and its runs per connect().
func (c *costCase) programs(rounds int) string {
	var parts []string
	for _, name := range slices.Sorted(maps.Keys(c.progs)) {
		if c.runs[name] == 0 {
			continue
		}
		var sum float64
		for _, ns := range c.progs[name] {
			sum += ns
		}
		parts = append(parts, fmt.Sprintf("%s %.0f (%.2f)", name, sum/float64(rounds), c.runs[name]/float64(rounds)))
	}
	return strings.Join(parts, ", ")
}

func median(d []float64) float64 {
	d = slices.Clone(d)
	slices.Sort(d)
	return d[len(d)/2]
}

// medianOf is the median over the rounds of f of round i.
func medianOf(rounds int, f func(i int) float64) float64 {
	d := make([]float64, rounds)
	for i := range d {
		d[i] = f(i)
	}
	return median(d)
}

// emptyPrograms attaches programs that only return 1 at the datapath's
// hooks progs: what any program there costs, with kernel.bpf_stats_enabled
// on, before it does anything.
func emptyPrograms(b *testing.B, cg string, progs []program) func() (map[string]ProgramStats, error) {
	b.Helper()
	spec, err := loadEgressd()
	if err != nil {
		b.Fatal(err)
	}
	empty := map[string]*ebpf.Program{}
	for _, h := range progs {
		p, err := ebpf.NewProgram(&ebpf.ProgramSpec{Type: spec.Programs["egressd_"+h.name].Type, AttachType: h.attach, License: "GPL",
			Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 1), asm.Return()}})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { p.Close() })
		l, err := link.AttachCgroup(link.CgroupOptions{Path: cg, Attach: h.attach, Program: p})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { l.Close() })
		empty[h.name] = p
	}
	return func() (map[string]ProgramStats, error) {
		out := map[string]ProgramStats{}
		for name, p := range empty {
			st, err := p.Stats()
			if err != nil {
				return nil, err
			}
			out[name] = ProgramStats{Runs: st.RunCount, Runtime: st.Runtime}
		}
		return out, nil
	}
}

// BenchmarkKernelCost reports the BPF programs' own run time per connect()
// (kernel.bpf_stats_enabled), summed over every program that ran for it:
// for each shape of rule, a connection no rule matches, one refused, one
// admitted while 100 or 4,096 long-lived connections hold entries of the
// socket table's first parts, and empty programs at the same hooks (the
// floor any datapath pays). The cases take turns, a round of 200 connects each, so that the
// machine's drift falls on all alike; figures are medians over the rounds, and ratios are
// to the no-rules case of the same run.
func BenchmarkKernelCost(b *testing.B) {
	privtest.RequireRoot(b)
	srv := sinkServer(b)
	local := []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}
	cases := []*costCase{
		{name: "empty programs", empty: connPrograms},
		{name: "no-rules"},
		{name: "no-match", rule: &Rule{Name: "other", Dests: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}, Limit: 1000}},
		{name: "refused", rule: &Rule{Name: "c", Dests: local, Limit: 0}, cmd: "refused"},
		{name: "concurrency", rule: &Rule{Name: "c", Dests: local, Limit: 1000}},
		{name: "per-second", rule: &Rule{Name: "c", Dests: local, Shape: ShapePerSecond, Limit: MaxRate}},
		{name: "per-window", rule: &Rule{Name: "c", Dests: local, Shape: ShapePerWindow, Limit: 1 << 30, Window: time.Second}},
		{name: "granted", rule: &Rule{Name: "c", Dests: local, Shape: ShapeGranted, Granted: 1 << 62}},
		// Long-lived connections fill the socket table's first parts: a
		// new one finds its hot entry taken and goes on to the others.
		// 100 fill the hot part (16 entries), and 4,096 the warm part
		// (1,024) too.
		{name: "concurrency 100 held", rule: &Rule{Name: "c", Dests: local, Limit: 1 << 20}, held: 100},
		{name: "concurrency 4096 held", rule: &Rule{Name: "c", Dests: local, Limit: 1 << 20}, held: 4096},
		{name: "concurrency+requests", rule: &Rule{Name: "c", Dests: local, Limit: 1000, Requests: true}},
	}
	for _, c := range cases {
		c.setUp(b)
		for range c.held {
			// The server closes its end at once: the client's stays in
			// CLOSE_WAIT, holding its slot.
			if reply := c.agent.Call(b, "dial %s 5s", srv); !strings.HasPrefix(reply, "ok") {
				b.Fatalf("%s: hold: %s", c.name, reply)
			}
		}
	}
	stats, err := EnableStats()
	if err != nil {
		b.Fatal(err)
	}
	defer stats.Close()
	const perRound = 200
	rounds := 0
	for b.Loop() {
		for _, c := range cases {
			c.round(b, srv, perRound)
		}
		rounds++
	}

	// go test keeps ten lines of a benchmark's log: the last cases' lines
	// are cut (their figures are in the metrics).
	b.Logf("%-22s %9s %6s  per program: ns (runs); BPF run time per connect(), median of %d rounds of %d; x = times no-rules in the same round",
		"case", "ns", "x", rounds, perRound)
	for _, c := range cases {
		x := medianOf(rounds, func(i int) float64 { return c.ns[i] / cases[1].ns[i] })
		b.Logf("%-22s %9.0f %6.2f  %s", c.name, median(c.ns), x, c.programs(rounds))
		b.ReportMetric(median(c.ns), strings.ReplaceAll(c.name, " ", "-")+"-ns")
		b.ReportMetric(x, strings.ReplaceAll(c.name, " ", "-")+"-x")
	}
	// The refusal target: a refused connect() costs no more than
	// one that matches no rule (with rules loaded), round by round.
	refused, noMatch := cases[3], cases[2]
	b.ReportMetric(medianOf(rounds, func(i int) float64 { return refused.ns[i] / noMatch.ns[i] }), "refused/no-match")
}

// BenchmarkRequestTracking reports what tracking requests costs per
// packet: one-byte round trips on a connection whose rule tracks requests,
// and on one to a destination no rule names, with the per-packet programs
// attached for both (some rule tracks requests). Rounds alternate; the
// figures are the egress and ingress programs' run time per run, medians
// over the rounds. Client and server are pinned, where the scheduler would
// place them by chance: both on one CPU (tracking-ns/packet), and on two
// (tracking-2cpu-ns/packet), where a request leaves from the client's CPU
// and its response comes in on the server's, and the lines both write
// move between the two.
func BenchmarkRequestTracking(b *testing.B) {
	privtest.RequireRoot(b)
	ncpu := runtime.NumCPU()
	type placement struct {
		suffix             string
		tracked, untracked netip.AddrPort
		agent              *privtest.Child
	}
	cg := privtest.Cgroup(b, "requests")
	d, err := Open(&Config{Cgroup: cg, PinDir: privtest.PinDir(b), MaxRules: 64})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { d.Uninstall() })
	var places []*placement
	for _, p := range []struct {
		suffix         string
		server, client int // CPUs
	}{{"", 0, 0}, {"-2cpu", 1, 0}} {
		if p.server >= ncpu {
			continue
		}
		pl := &placement{suffix: p.suffix, tracked: pinnedEchoServer(b, p.server), untracked: pinnedEchoServer(b, p.server)}
		name := "tracked" + p.suffix
		if err := d.Put(Rule{Name: name, Dests: []netip.Prefix{netip.PrefixFrom(pl.tracked.Addr(), 32)}, Port: pl.tracked.Port(), Limit: 1000, Requests: true}); err != nil {
			b.Fatal(err)
		}
		pl.agent = privtest.Spawn(b, cg, "agent")
		if reply := pl.agent.Call(b, "pin %d", p.client); reply != "ok" {
			b.Fatal(reply)
		}
		places = append(places, pl)
	}
	stats, err := EnableStats()
	if err != nil {
		b.Fatal(err)
	}
	defer stats.Close()
	const perRound = 500
	perRun := map[netip.AddrPort][]float64{}
	runs := map[netip.AddrPort][]float64{}
	for b.Loop() {
		for _, pl := range places {
			for _, target := range []netip.AddrPort{pl.tracked, pl.untracked} {
				before, err := d.ProgramStats()
				if err != nil {
					b.Fatal(err)
				}
				if reply := pl.agent.Call(b, "echo %s %d", target, perRound); !strings.HasPrefix(reply, "ok") {
					b.Fatal(reply)
				}
				after, err := d.ProgramStats()
				if err != nil {
					b.Fatal(err)
				}
				var ns time.Duration
				var n uint64
				for _, name := range []string{"egress", "ingress"} {
					ns += after[name].Runtime - before[name].Runtime
					n += after[name].Runs - before[name].Runs
				}
				perRun[target] = append(perRun[target], float64(ns)/float64(n))
				runs[target] = append(runs[target], float64(n)/perRound)
			}
		}
	}
	for _, pl := range places {
		s, err := d.Stats("tracked" + pl.suffix)
		if err != nil || s.Requests < uint64(perRound) || s.InFlight != 0 {
			b.Fatalf("the tracked connection's requests: %+v, %v", s, err)
		}
		b.ReportMetric(median(perRun[pl.tracked]), "tracked"+pl.suffix+"-ns/packet")
		b.ReportMetric(median(perRun[pl.untracked]), "untracked"+pl.suffix+"-ns/packet")
		b.ReportMetric(median(perRun[pl.tracked])-median(perRun[pl.untracked]), "tracking"+pl.suffix+"-ns/packet")
		b.ReportMetric(median(runs[pl.tracked]), "packets"+pl.suffix+"/round-trip")
	}
}

// pinnedEchoServer is an echoServer whose handlers run on one CPU. Each
// gives its thread back as it found it: a thread that ended with its
// goroutine could be the one that started a helper, which the kernel
// then kills (Pdeathsig follows the thread).
func pinnedEchoServer(b *testing.B, cpu int) netip.AddrPort {
	return serve(b, "tcp4", "127.0.0.1:0", func(c net.Conn) {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		var was, set unix.CPUSet
		if err := unix.SchedGetaffinity(0, &was); err != nil {
			b.Errorf("echo server's CPUs: %v", err)
			return
		}
		set.Set(cpu)
		if err := unix.SchedSetaffinity(0, &set); err != nil {
			b.Errorf("pin the echo server: %v", err)
			return
		}
		defer unix.SchedSetaffinity(0, &was)
		echo(c)
	})
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
	b.ReportMetric(median(plainNs), "plain-ns/conn")
	b.ReportMetric(median(attachedNs), "attached-ns/conn")
	b.ReportMetric(median(attachedNs)/median(plainNs), "ratio")
}

// BenchmarkAgainstNftables times connect()+close() on loopback three ways,
// each in a network namespace of its own with a server that accepts and
// closes: plain; limited by egressd (a concurrency rule that never
// refuses, the helper in the datapath's cgroup); and limited by nftables
// as an operator would without egressd (ct count over the same limit on
// the output hook, conntrack on). The helpers run on one CPU, and rounds
// of 200 connects alternate; it reports what each limit added to plain in
// the same round (medians over the rounds), and egressd's added time over
// nftables'.
func BenchmarkAgainstNftables(b *testing.B) {
	privtest.RequireRoot(b)
	nft, err := exec.LookPath("nft")
	if err != nil {
		b.Skipf("nftables: %v", err)
	}
	type side struct {
		name  string
		ns    *privtest.NetNS
		agent *privtest.Child
		port  int
		ns_   []float64
	}
	sides := []*side{{name: "plain"}, {name: "egressd"}, {name: "nftables"}}
	for _, s := range sides {
		s.ns = privtest.NewNetNS(b)
		var ln net.Listener
		if err := s.ns.Do(func() (err error) { ln, err = net.Listen("tcp4", "127.0.0.1:0"); return err }); err != nil {
			b.Fatal(err)
		}
		s.port = privtest.CloseEach(b, ln)
		cg := privtest.Cgroup(b, s.name)
		switch s.name {
		case "egressd":
			d, err := Open(&Config{Cgroup: cg, PinDir: privtest.PinDir(b), MaxRules: 64})
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { d.Uninstall() })
			if err := d.Put(Rule{Name: "c", Dests: []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}, Port: uint16(s.port), Limit: 1 << 20}); err != nil {
				b.Fatal(err)
			}
		case "nftables":
			ruleset := fmt.Sprintf(`table inet egressd_bench {
	chain out {
		type filter hook output priority 0; policy accept;
		ip daddr 127.0.0.1 tcp dport %d ct state new ct count over %d reject
	}
}
`, s.port, 1<<20)
			err := s.ns.Do(func() error {
				cmd := exec.Command(nft, "-f", "-")
				cmd.Stdin = strings.NewReader(ruleset)
				if out, err := cmd.CombinedOutput(); err != nil {
					return fmt.Errorf("nft: %v: %s", err, out)
				}
				return nil
			})
			if err != nil {
				b.Fatal(err)
			}
		}
		s.agent = s.ns.Spawn(b, cg, "agent")
		// One CPU for every helper: the machine's two are too noisy
		// apart.
		if reply := s.agent.Call(b, "pin 0"); reply != "ok" {
			b.Fatal(reply)
		}
	}
	const round = 200
	var egAdded, nfAdded []float64
	for i := 0; b.Loop(); i++ {
		// Each side goes first, second and third in turn: whatever the
		// order costs (a cold cache after the other helpers) falls on
		// all three alike.
		for j := range sides {
			s := sides[(i+j)%len(sides)]
			var ns float64
			if _, err := fmt.Sscanf(s.agent.Call(b, "loop 127.0.0.1:%d %d", s.port, round), "ok %g", &ns); err != nil {
				b.Fatal(err)
			}
			s.ns_ = append(s.ns_, ns)
		}
		// What each limit added in this round: drift between rounds falls
		// on all three alike.
		n := len(sides[0].ns_) - 1
		egAdded = append(egAdded, sides[1].ns_[n]-sides[0].ns_[n])
		nfAdded = append(nfAdded, sides[2].ns_[n]-sides[0].ns_[n])
	}
	eg, nf := median(egAdded), median(nfAdded)
	b.ReportMetric(median(sides[0].ns_), "plain-ns/conn")
	b.ReportMetric(eg, "egressd-added-ns")
	b.ReportMetric(nf, "nftables-added-ns")
	b.ReportMetric(eg/nf, "egressd/nftables")
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

// mixedRules makes n rules as a large policy might have them: host-wide
// and scoped, a port or any, IPv4 and IPv6 addresses (what host names
// resolve to) and prefixes of several lengths.
func mixedRules(n int, scopes []Scope) []Rule {
	rules := make([]Rule, n)
	for i := range rules {
		r := Rule{Name: fmt.Sprintf("m%d", i), Port: uint16(1 + i%2000), Limit: 100}
		v4 := [4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)}
		v6 := netip.MustParseAddr("2001:db8::").As16()
		v6[5], v6[6], v6[7] = byte(i>>16), byte(i>>8), byte(i)
		switch i % 20 {
		case 0, 1:
			r.Dests = []netip.Prefix{netip.PrefixFrom(netip.AddrFrom16(v6), 128)}
		case 2:
			r.Dests = []netip.Prefix{netip.PrefixFrom(netip.AddrFrom16(v6), 64).Masked()}
		case 3:
			r.Dests = []netip.Prefix{netip.PrefixFrom(netip.AddrFrom4([4]byte{11, byte(i >> 16), byte(i >> 8), 0}), 24)}
		case 4:
			r.Dests = []netip.Prefix{netip.PrefixFrom(netip.AddrFrom4([4]byte{12, byte(i >> 16), byte(i >> 8), byte(i & 0xf0)}), 28)}
		default:
			r.Dests = []netip.Prefix{netip.PrefixFrom(netip.AddrFrom4(v4), 32)}
		}
		if i%10 == 5 {
			r.Port = 0
		}
		if i%10 == 7 && len(scopes) > 0 {
			r.Scope = scopes[i%len(scopes)]
		}
		rules[i] = r
	}
	return rules
}

// BenchmarkRuleScale sets 100,000 rules beside 10 and reports what the
// number costs: the BPF run time of a connect() that a rule admits (a
// whole address) and of one no rule matches, alternating rounds between
// the two datapaths; loading the 100,000 into an empty datapath; and the
// kernel memory of the rule tables per slot and per destination, from
// each map's fdinfo.
func BenchmarkRuleScale(b *testing.B) {
	privtest.RequireRoot(b)
	srv, none := sinkServer(b), sinkServer(b)
	const large = 100_000
	// Scoped rules name cgroups at the depths the helpers run at, so that
	// connect() walks the scopes.
	parent := privtest.Cgroup(b, "scale")
	var scopes []Scope
	for i := range 8 {
		scopes = append(scopes, scopeOf(b, privtest.SubCgroup(b, parent, fmt.Sprint("s", i))))
	}
	target := Rule{Name: "target", Dests: []netip.Prefix{netip.PrefixFrom(srv.Addr(), 32)}, Port: srv.Port(), Limit: 1 << 20}
	type side struct {
		rules           int
		d               *Datapath
		admit, nomatch  *costCase
		load            time.Duration
		memEmpty, memIn int
	}
	sides := []*side{{rules: 10}, {rules: large}}
	for _, s := range sides {
		cg := privtest.SubCgroup(b, parent, fmt.Sprint("r", s.rules))
		d, err := Open(&Config{Cgroup: cg, PinDir: privtest.PinDir(b), MaxRules: 131072})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { d.Uninstall() })
		s.d = d
		s.memEmpty = kernelMemory(b, d)
		start := time.Now()
		if err := d.PutMany(append(mixedRules(s.rules, scopes), target)); err != nil {
			b.Fatal(err)
		}
		s.load = time.Since(start)
		s.memIn = kernelMemory(b, d)
		agent := privtest.Spawn(b, cg, "agent")
		s.admit = &costCase{name: "admitted", cmd: "loop", agent: agent, stats: d.ProgramStats, progs: map[string][]float64{}, runs: map[string]float64{}}
		s.nomatch = &costCase{name: "no-match", cmd: "loop", agent: agent, stats: d.ProgramStats, progs: map[string][]float64{}, runs: map[string]float64{}}
	}
	stats, err := EnableStats()
	if err != nil {
		b.Fatal(err)
	}
	defer stats.Close()
	for b.Loop() {
		for _, s := range sides {
			s.admit.round(b, srv, 200)
			s.nomatch.round(b, none, 200)
		}
	}
	small, big := sides[0], sides[1]
	ratio := func(a, b []float64) float64 {
		r := make([]float64, len(a))
		for i := range a {
			r[i] = b[i] / a[i]
		}
		return median(r)
	}
	b.ReportMetric(median(small.admit.ns), "10-rules-admitted-ns")
	b.ReportMetric(median(big.admit.ns), "100k-rules-admitted-ns")
	b.ReportMetric(ratio(small.admit.ns, big.admit.ns), "admitted-100k/10")
	b.ReportMetric(median(small.nomatch.ns), "10-rules-no-match-ns")
	b.ReportMetric(median(big.nomatch.ns), "100k-rules-no-match-ns")
	b.ReportMetric(ratio(small.nomatch.ns, big.nomatch.ns), "no-match-100k/10")
	b.ReportMetric(big.load.Seconds(), "load-100k-s")
	b.ReportMetric(float64(big.memEmpty)/131072, "bytes/slot")
	b.ReportMetric(float64(big.memIn-big.memEmpty)/large, "bytes/rule-keys")
}

// kernelMemory sums the kernel's memlock account of the datapath's maps
// (/proc/self/fdinfo), which for each map is its memory in use.
func kernelMemory(b *testing.B, d *Datapath) int {
	b.Helper()
	total := 0
	for name, m := range d.namedMaps() {
		data, err := os.ReadFile(fmt.Sprintf("/proc/self/fdinfo/%d", m.FD()))
		if err != nil {
			b.Fatal(err)
		}
		var n int
		for _, l := range strings.Split(string(data), "\n") {
			if v, ok := strings.CutPrefix(l, "memlock:"); ok {
				if n, err = strconv.Atoi(strings.TrimSpace(v)); err != nil {
					b.Fatalf("%s: %v", name, err)
				}
			}
		}
		total += n
	}
	return total
}

// BenchmarkLastRefusal is the cost of the question a refused caller's SDK
// asks the daemon: the latest refusal of a process to a destination, out
// of every CPU's log.
func BenchmarkLastRefusal(b *testing.B) {
	privtest.RequireRoot(b)
	d, err := Open(&Config{Cgroup: privtest.Cgroup(b, "bench"), PinDir: privtest.PinDir(b), MaxRules: 64})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { d.Uninstall() })
	dest := netip.MustParseAddrPort("127.0.0.1:443")
	for b.Loop() {
		if _, _, err := d.LastRefusal(uint32(os.Getpid()), ProtoTCP, dest); err != nil {
			b.Fatal(err)
		}
	}
}
