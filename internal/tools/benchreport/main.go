// Command benchreport runs every benchmark of the project and writes one
// Markdown report: the Go benchmarks' figures (with the ratios they measure
// against baselines in the same run) and the comparison modules' tables.
// `make bench` runs it; the latest report is committed as docs/bench.md.
package main

import (
	"bufio"
	"bytes"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"time"
)

func main() {
	out := flag.String("o", "docs/bench.md", "report file")
	benchtime := flag.String("benchtime", "2s", "go test -benchtime")
	flag.Parse()
	if err := run(*out, *benchtime); err != nil {
		fmt.Fprintln(os.Stderr, "benchreport:", err)
		os.Exit(1)
	}
}

// suites are the Go benchmarks, each run in its package; benchtime, when
// set, overrides the report's (benchmarks that alternate rounds want more).
var suites = []struct{ title, pkg, pattern, benchtime, note string }{
	{"Kernel datapath", "./pkg/loader/", ".", "8s", "BPF run time per connect() (kernel.bpf_stats_enabled) summed over all programs, the cases taking turns in one run, with empty programs at the same hooks (the floor any program there costs), a refused connect() and a concurrency rule's connect() while 100 or 4,096 others hold their slots (the socket table's hot part full, then its warm part too; go test keeps the first nine cases' lines of the log below, every case's figures are in the table); the same per UDP datagram sent to an address, the cases taking turns likewise: with nothing attached, empty programs, no rule matching (its destination another network's, or of a /24 a rule has part of) and on an open flow, and per socket that opens a flow with its one datagram and ends it at its close (the send's and the release's programs), beside an admitted TCP connect()+close(), with the agent's wall time per send; request tracking per packet, client and server pinned to one CPU and to two; connect()+close() plain, limited by egressd and by nftables `ct count`, each in its own network namespace, rounds alternating on one CPU; 100,000 rules beside 10; 1,000,000 tracked sockets; rule updates."},
	{"Daemon", "./tests/", "Policy100k|Daemon100k", "", "The built egressd: a 100,000-rule policy from file to enforcement at start, on a reload that adds a rule and on one that changes every rule (three starts, each reload after 5 s idle; the mean and the slowest; the start's phases as the daemon logs them: reading the file, waiting for the datapath opened meanwhile, installing the rules; with the YAML parse alone, the daemon's page faults, and what the first touch of a 4 KiB page costs on this machine); and what a daemon enforcing 100,000 rules costs idle, per metrics scrape (gzip asked, as Prometheus does; the first after start, then the mean and the slowest of five, with the default --metrics-rules 500 and with 1,000), per list of every rule (with the time to its first row), of the 111 rules a name pattern picks and of the 50 busiest that top asks for, and per list of events."},
	{"Refusal storms", "./tests/", "RefusalStorm", "3x", "The built egressd's CPU during refusal storms at 50,000 a second (from /proc, with its idle CPU for comparison): TCP connect()s, UDP datagrams that would open a flow (the udp- figures) and TCP connect()s again, three seconds each, taking turns against one daemon in three rounds; udp/tcp-per-refusal is the median of the rounds' ratios, tcp-spread how far apart the two TCP storms were (the median of the rounds' larger over smaller), and udp/tcp-over-spread the one over the other: above 1 only where UDP cost more than the run's own scatter. Each storm runs again with the clients on one CPU and the daemon on the other (-apart): a kernel without CONFIG_IRQ_TIME_ACCOUNTING counts a client's softirq work (a UDP socket's port and its free after an RCU grace period) to whatever thread it interrupts, the daemon's among them, so the UDP targets read the -apart runs."},
	{"Kubernetes node", "./tests/", "KubeNode", "1x", "The built egressd with the DaemonSet's command line against a real kube-apiserver and etcd (cgroupfs layout): 100 pods and 100 EgressLimits each selecting them all (10,000 rules), from the last limit created to every rule installed and the daemon's resident memory then; from a new pod's cgroup made to the first connect() its rule refuses, seen from a process in the pod (perSecond 1, burst 1), median and slowest of 10 pods; and from a limit's update (concurrency 10 to 3, three connections held) to the first connect() refused, median and slowest of 10 edits."},
	{"In-process limiters", "./pkg/limit/", ".", "", "Acquire+Release per shape, serial and parallel."},
	{"SDK executor", "./pkg/sdk/", ".", "", "Run on the success path."},
	{"Adaptive controller", "./pkg/adaptive/", ".", "", "Recording one latency sample."},
	{"Shared limiters (Redis)", "./pkg/shared/", ".", "", "Admissions against a local redis-server, 1 and 8 clients; the daemon's path to a shared rate, claims of 10 permits (permits/s); and 1,000 holders on one budget, each its own Slots or Grants: calls a second, Redis's CPU a second, Jain's fairness among them, overshoot."},
	{"Partitioned limiters", "./pkg/partition/", ".", "", "Acquire+Release on a partition found by key."},
}

// modules are the comparisons, each printing its own table with ratios
// measured in the same run; those against peers are modules of their own,
// which keeps the peers out of egressd's go.mod.
var modules = []struct{ title, dir string }{
	{"SDK and limiter against peers (failsafe-go, x/time/rate)", "bench/sdkcompare"},
	{"A hedge that does not fire against Run before hedging", "internal/tools/hedgecost"},
	{"Adaptive loop against peers in a queueing model", "bench/adaptivesim"},
}

func run(out, benchtime string) error {
	var b bytes.Buffer
	fmt.Fprintf(&b, "# Benchmark report\n\nGenerated by `make bench` (internal/tools/benchreport) on %s.\n\n", time.Now().UTC().Format("2006-01-02 15:04 MST"))
	fmt.Fprintf(&b, "Machine: %s; %d CPUs; %s; %s.%s\n\n", cpuModel(), runtime.NumCPU(), kernel(), runtime.Version(), memoryNote())
	figures := map[string]float64{}
	for _, s := range suites {
		fmt.Fprintf(os.Stderr, "benchmarks: %s\n", s.pkg)
		bt := benchtime
		if s.benchtime != "" {
			bt = s.benchtime
		}
		text, err := command("", "go", "test", "-count=1", "-run", "^$", "-bench", s.pattern, "-benchtime", bt, "-benchmem", "-timeout", "60m", s.pkg)
		if err != nil {
			return fmt.Errorf("%s: %w\n%s", s.pkg, err, text)
		}
		fmt.Fprintf(&b, "## %s\n\n%s\n\n", s.title, s.note)
		writeTable(&b, text, figures)
		writeLogs(&b, text)
	}
	writeTargets(&b, "Datapath targets", datapathTargets, figures)
	writeTargets(&b, "Daemon targets at 100,000 rules", daemonTargets, figures)
	writeTargets(&b, "UDP flow targets", udpTargets, figures)
	for _, m := range modules {
		fmt.Fprintf(os.Stderr, "comparison: %s\n", m.dir)
		text, err := command(m.dir, "go", "run", ".")
		// A comparison that ran exits non-zero when it missed a target,
		// which its verdicts say: the report keeps them.
		if err != nil && !strings.Contains(text, "MISSED") {
			return fmt.Errorf("%s: %w\n%s", m.dir, err, text)
		}
		fmt.Fprintf(&b, "## %s\n\n`cd %s && go run .`\n\n```\n%s```\n\n", m.title, m.dir, text)
	}
	return os.WriteFile(out, b.Bytes(), 0o644)
}

// writeTable turns go test -bench lines into a table of name and metrics,
// and keeps each figure in figures as "Name unit" (the name without its
// -CPUS suffix).
func writeTable(b *bytes.Buffer, text string, figures map[string]float64) {
	fmt.Fprintf(b, "| benchmark | figures |\n|---|---|\n")
	sc := bufio.NewScanner(strings.NewReader(text))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 4 || !strings.HasPrefix(f[0], "Benchmark") {
			continue
		}
		name := strings.TrimPrefix(f[0], "Benchmark")
		if i := strings.LastIndex(name, "-"); i > 0 {
			name = name[:i]
		}
		var metrics []string
		for i := 2; i+1 < len(f); i += 2 {
			metrics = append(metrics, f[i]+" "+f[i+1])
			if v, err := strconv.ParseFloat(f[i], 64); err == nil {
				figures[name+" "+f[i+1]] = v
			}
		}
		fmt.Fprintf(b, "| %s | %s |\n", strings.TrimPrefix(f[0], "Benchmark"), strings.Join(metrics, ", "))
	}
	b.WriteString("\n")
}

// writeLogs copies what benchmarks logged (the tables some print) into a
// block, without the file:line prefixes.
func writeLogs(b *bytes.Buffer, text string) {
	var lines []string
	inBench := false
	sc := bufio.NewScanner(strings.NewReader(text))
	for sc.Scan() {
		l := sc.Text()
		switch {
		case strings.HasPrefix(l, "--- BENCH: "):
			inBench = true
			lines = append(lines, strings.TrimPrefix(l, "--- BENCH: Benchmark"))
		case inBench && strings.HasPrefix(l, "    "):
			msg := strings.TrimSpace(l)
			if _, after, ok := strings.Cut(msg, ": "); ok && strings.Contains(msg[:len(msg)-len(after)], ".go:") {
				msg = after
			}
			lines = append(lines, "  "+msg)
		default:
			inBench = false
		}
	}
	if len(lines) > 0 {
		fmt.Fprintf(b, "```\n%s\n```\n\n", strings.Join(lines, "\n"))
	}
}

// target is a bound on one figure, judged from the figures of a run.
type target struct {
	what string
	got  func(f map[string]float64) (value float64, ok bool)
	max  float64
	unit string
}

func fig(name string) func(map[string]float64) (float64, bool) {
	return func(f map[string]float64) (float64, bool) { v, ok := f[name]; return v, ok }
}

// datapathTargets bound the datapath's costs: BPF time per connection and
// per tracked packet, the daemon's CPU per refusal, 100,000 rules against
// 10, a 100,000-rule policy's start and reloads, and egressd against
// nftables.
var datapathTargets = []target{
	{"admitted connection (concurrency), BPF ns", fig("KernelCost concurrency-ns"), 1000, "ns"},
	{"admitted connection (per second), BPF ns", fig("KernelCost per-second-ns"), 1000, "ns"},
	{"admitted connection (per window), BPF ns", fig("KernelCost per-window-ns"), 1000, "ns"},
	{"admitted connection (granted), BPF ns", fig("KernelCost granted-ns"), 1000, "ns"},
	{"admitted (concurrency) / no rule", fig("KernelCost concurrency-x"), 2, "x"},
	{"refused connect() / one no rule matches", fig("KernelCost refused/no-match"), 1, "x"},
	{"connection no rule matches, BPF ns", fig("KernelCost no-match-ns"), 400, "ns"},
	{"request tracking per tracked packet beyond untracked, client and server on one CPU", fig("RequestTracking tracking-ns/packet"), 100, "ns"},
	{"request tracking per tracked packet beyond untracked, on two CPUs", fig("RequestTracking tracking-2cpu-ns/packet"), 100, "ns"},
	{"daemon CPU per refusal, one client at 50,000/s", fig("RefusalStorm/1-client daemon-ns/refusal"), 1000, "ns"},
	{"daemon CPU per refusal, 16 clients at 50,000/s", fig("RefusalStorm/16-clients daemon-ns/refusal"), 1000, "ns"},
	{"daemon CPU per refusal, 65,535 destinations at 50,000/s", fig("RefusalStorm/1-client-65535-ports daemon-ns/refusal"), 1000, "ns"},
	{"admitted connection, 100,000 rules / 10", fig("RuleScale admitted-100k/10"), 1.1, "x"},
	{"connection no rule matches, 100,000 rules / 10", fig("RuleScale no-match-100k/10"), 1.1, "x"},
	{"100,000-rule policy, start to enforcement", fig("Policy100k start-s"), 1, "s"},
	{"100,000-rule policy, reload to enforcement (one rule added)", fig("Policy100k reload-s"), 1, "s"},
	{"100,000-rule policy, reload to enforcement (every rule changed)", fig("Policy100k reload-every-rule-s"), 1, "s"},
	{"egressd's added connect()+close() over nftables ct count's", fig("AgainstNftables egressd/nftables"), 0.3, "x"},
}

// daemonTargets bound what a daemon of 100,000 rules with the default
// settings costs idle and per metrics scrape.
var daemonTargets = []target{
	{"metrics scrape, text", fig("Daemon100k scrape-MB"), 2, "MB"},
	{"metrics scrape, daemon CPU (after the first)", fig("Daemon100k scrape-cpu-ms"), 100, "ms"},
	{"metrics scrape with 1,000 rules' series / with 500", fig("Daemon100k scrape-1000/500"), 2.1, "x"},
	{"idle daemon CPU per 10 s", fig("Daemon100k idle-cpu-ms/10s"), 30, "ms"},
}

// udpTargets bound the costs of counting UDP flows: a datagram's beyond empty
// programs at the same hooks, within a round; a flow's life (the send
// that opens it and its socket's release) against an admitted TCP
// connection's (connect4, sockops, sock_release); the daemon's CPU per
// refusal in a UDP storm against a TCP one, the client on a CPU of its
// own: sharing one, the client's softirq work is counted to the daemon.
var udpTargets = []target{
	{"UDP send no rule matches, BPF ns beyond empty programs", fig("UDPCost no-match-over-floor-ns"), 20, "ns"},
	{"UDP send no rule matches, to another address of a rule's /24, BPF ns beyond empty programs", fig("UDPCost no-match-nearby-over-floor-ns"), 20, "ns"},
	{"UDP send on an open flow, BPF ns beyond empty programs", fig("UDPCost open-flow-over-floor-ns"), 60, "ns"},
	{"UDP flow opened and ended (its send and release) / admitted TCP connection", fig("UDPCost opening/tcp-admitted"), 1, "x"},
	{"daemon CPU per refusal, UDP / TCP beyond the TCP storm's own spread, one client", fig("RefusalStorm/1-client-apart udp/tcp-over-spread"), 1, "x"},
	{"daemon CPU per refusal, UDP / TCP beyond the TCP storm's own spread, 16 clients", fig("RefusalStorm/16-clients-apart udp/tcp-over-spread"), 1, "x"},
	{"daemon CPU per refusal, UDP / TCP beyond the TCP storm's own spread, 65,535 destinations", fig("RefusalStorm/1-client-65535-ports-apart udp/tcp-over-spread"), 1, "x"},
}

// writeTargets judges targets from the figures of this run, under title.
func writeTargets(b *bytes.Buffer, title string, targets []target, figures map[string]float64) {
	fmt.Fprintf(b, "## %s\n\nFrom the figures above, this run.\n\n| target | at most | this run | |\n|---|---|---|---|\n", title)
	for _, t := range targets {
		v, ok := t.got(figures)
		if !ok {
			fmt.Fprintf(b, "| %s | %g %s | not measured | |\n", t.what, t.max, t.unit)
			continue
		}
		verdict := "met"
		if v > t.max {
			verdict = "missed"
		}
		got := strconv.FormatFloat(v, 'f', 0, 64)
		if v < 100 {
			got = strconv.FormatFloat(v, 'g', 3, 64)
		}
		fmt.Fprintf(b, "| %s | %g %s | %s %s | %s |\n", t.what, t.max, t.unit, got, t.unit, verdict)
	}
	b.WriteString("\n")
}

// command returns what name printed. The go tool's own messages (the
// modules it downloads on a fresh machine) go to stderr, which only a
// failure shows.
func command(dir, name string, args ...string) (string, error) {
	cmd := exec.Command(name, args...)
	cmd.Dir = dir
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		out = append(out, stderr.Bytes()...)
	}
	return string(out), err
}

func cpuModel() string {
	if m := cpuinfo("model name"); m != "" {
		return m
	}
	return runtime.GOARCH
}

// cpuinfo is the first CPU's value of key in /proc/cpuinfo.
func cpuinfo(key string) string {
	data, _ := os.ReadFile("/proc/cpuinfo")
	for _, line := range strings.Split(string(data), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == key {
			return strings.TrimSpace(v)
		}
	}
	return ""
}

// memoryNote says what makes memory dearer here than on bare metal, which
// the kernel figures pay for each page and cache line a program touches.
func memoryNote() string {
	flags := map[string]bool{}
	for _, f := range strings.Fields(cpuinfo("flags")) {
		flags[f] = true
	}
	meltdown, _ := os.ReadFile("/sys/devices/system/cpu/vulnerabilities/meltdown")
	var notes []string
	if flags["hypervisor"] {
		notes = append(notes, "A virtual machine")
	}
	if strings.Contains(string(meltdown), "PTI") && !flags["pcid"] {
		notes = append(notes, "Page-table isolation without PCID: every entry to the kernel from user space, and every return, flushes the TLB")
	}
	if len(notes) == 0 {
		return ""
	}
	return " " + strings.Join(notes, ". ") + "."
}

func kernel() string {
	data, err := os.ReadFile("/proc/sys/kernel/osrelease")
	if err != nil {
		return runtime.GOOS
	}
	return "Linux " + strings.TrimSpace(string(data))
}
