package tests

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/internal/privtest"
	"github.com/egressd/egressd/pkg/control"
)

// BenchmarkRefusalStorm runs the daemon while processes in its cgroup are
// refused 50,000 times a second in all for three seconds (one of them
// holds the rule's one slot, which counts TCP connections and UDP flows),
// and reports the daemon's own CPU time (every thread's, from /proc) per
// refusal: one client retrying one destination; 16 clients retrying it,
// their refusals interleaved; and one client trying a different port each
// time over 65,535, so that every refusal is a new pair of process and
// destination, each an event. Each storm runs twice, taking turns: TCP
// connect()s, and UDP datagrams that would open a flow, each from a fresh
// socket (the udp- figures; udp/tcp-per-refusal is the median over the
// rounds of the one's CPU per refusal over the other's), after a second of
// each that is not measured. The TCP storm runs a second time in each
// round: tcp-spread is how far apart the same storm's two runs were (the
// median over the rounds of the larger over the smaller), and
// udp/tcp-over-spread the UDP ratio beyond it, which is above 1 only if
// UDP cost more than this run can tell from its own scatter.
// Each storm runs again with the clients on one CPU and the daemon on
// another (-apart): the kernel here counts no interrupt time apart
// (CONFIG_IRQ_TIME_ACCOUNTING), so what a client's sockets cost in softirq
// (a UDP socket binds a port and is freed after an RCU grace period) is
// counted to whatever thread it interrupts, the daemon's among them. It
// checks that the rule counted every refusal, that `egressd events` shows
// both storms, and that the daemon attributes a client's refusal of
// either protocol.
func BenchmarkRefusalStorm(b *testing.B) {
	for _, tc := range []struct {
		name           string
		clients, ports int
		apart          bool // the client on CPU 0, the daemon on CPU 1
	}{
		{"1-client", 1, 1, false},
		{"16-clients", 16, 1, false},
		{"1-client-65535-ports", 1, 65535, false},
		{"1-client-apart", 1, 1, true},
		{"16-clients-apart", 16, 1, true},
		{"1-client-65535-ports-apart", 1, 65535, true},
	} {
		b.Run(tc.name, func(b *testing.B) {
			privtest.RequireRoot(b)
			if tc.apart && runtime.NumCPU() < 2 {
				b.Skip("skipping: one CPU")
			}
			const rate, duration = 50_000, 3 * time.Second
			dir := b.TempDir()
			pol := filepath.Join(dir, "policy.yaml")
			if err := os.WriteFile(pol, []byte("rules:\n  - name: storm\n    destination: 127.0.0.2\n    protocols: [tcp, udp]\n    concurrency: 1\n"), 0o644); err != nil {
				b.Fatal(err)
			}
			cg := privtest.Cgroup(b, "storm")
			socket := filepath.Join(dir, "egressd.sock")
			cmd := exec.Command(egressd, "run", "--cgroup", cg, "--bpffs", privtest.PinDir(b), "--socket", socket,
				"--state-dir", filepath.Join(dir, "state"), "--policy", pol, "--metrics", "", "--detach-on-exit")
			cmd.Stderr = os.Stderr
			start := cmd.Start
			if tc.apart {
				start = func() error { return startOn(cmd, 1) }
			}
			if err := start(); err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { cmd.Process.Signal(os.Interrupt); cmd.Wait() })
			c := &control.Client{Socket: socket, Timeout: time.Second}
			clocktest.Eventually(b, "the daemon to answer", func() bool {
				_, err := c.Status(context.Background())
				return err == nil
			})
			var agents []*privtest.Child
			for range tc.clients {
				agents = append(agents, privtest.Spawn(b, cg, "agent"))
			}
			if tc.apart {
				for _, a := range agents {
					if reply := a.Call(b, "pin 0"); reply != "ok" {
						b.Fatalf("pin the client: %s", reply)
					}
				}
			}
			agent := agents[0]
			// The client holds the rule's one slot: everything else it
			// tries is refused.
			ln, err := net.Listen("tcp4", "127.0.0.2:0")
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { ln.Close() })
			if reply := agent.Call(b, "dial %s 2s", ln.Addr()); !strings.HasPrefix(reply, "ok") {
				b.Fatalf("hold the slot: %s", reply)
			}

			// storm has every client try proto for d, at the rate in all,
			// and returns how many were refused.
			storm := func(proto string, d time.Duration) int {
				replies := make([]string, len(agents))
				var wg sync.WaitGroup
				for i, a := range agents {
					wg.Go(func() {
						var err error
						if replies[i], err = a.Send("storm %s 127.0.0.2:1 %d %d %s", proto, tc.ports, rate/len(agents), d); err != nil {
							b.Error(err)
						}
					})
				}
				wg.Wait()
				refused := 0
				for _, reply := range replies {
					var n, r int
					if _, err := fmt.Sscanf(reply, "ok %d %d", &n, &r); err != nil || r != n-dnsTries(n, 1, tc.ports) {
						b.Fatalf("%s storm: %q (%v), want every try refused but those to DNS ports", proto, reply, err)
					}
					refused += r
				}
				return refused
			}
			// A storm of each first, not measured: whatever the daemon
			// does once, at its first storm, falls on neither.
			protos := []string{"tcp", "udp"}
			total := 0
			for _, proto := range protos {
				total += storm(proto, time.Second)
			}

			// What the daemon spends with nothing refused, to set the
			// storm's figure against; the warm-up's events have come out
			// by its end.
			idle := cpuTime(b, cmd.Process.Pid)
			time.Sleep(duration)
			idle = cpuTime(b, cmd.Process.Pid) - idle

			// The storms take turns, each first in one round of three:
			// TCP's, UDP's, and TCP's again, whose ratio to the first is
			// what the same storm scatters by in this run. ratios holds
			// each round's UDP CPU per refusal over TCP's, again each
			// round's second TCP storm's over its first's.
			passes := []struct{ name, proto string }{{"tcp", "tcp"}, {"udp", "udp"}, {"tcp-again", "tcp"}}
			cpu := map[string]time.Duration{}
			refused := map[string]int{}
			var ratios, again []float64
			for round := 0; b.Loop(); round++ {
				perRefusal := map[string]float64{}
				for j := range passes {
					pass := passes[(round+j)%len(passes)]
					before := cpuTime(b, cmd.Process.Pid)
					n := storm(pass.proto, duration)
					// Events come out within a tenth of a second, and a
					// pair's last counts a second after its last event.
					time.Sleep(1200 * time.Millisecond)
					spent := cpuTime(b, cmd.Process.Pid) - before
					cpu[pass.proto] += spent
					refused[pass.proto] += n
					perRefusal[pass.name] = float64(spent) / float64(n)
				}
				ratios = append(ratios, perRefusal["udp"]/perRefusal["tcp"])
				again = append(again, perRefusal["tcp-again"]/perRefusal["tcp"])
			}
			total += refused["tcp"] + refused["udp"]
			l, err := c.Limit(context.Background(), "storm")
			if err != nil || l.Refused != uint64(total) || l.Live != 1 {
				b.Fatalf("the rule counted %d refusals (%v), the client was refused %d times", l.Refused, err, total)
			}
			events, counted := map[string]uint64{}, map[string]uint64{}
			err = c.Events(context.Background(), false, func(r control.Event) error {
				if r.Rule == "storm" {
					events[r.Protocol]++
					counted[r.Protocol] += r.Count
				}
				return nil
			})
			st, serr := c.Status(context.Background())
			if err != nil || serr != nil || events["tcp"] == 0 || events["udp"] == 0 {
				b.Fatalf("events of the storms: %v (%v, %v)", events, err, serr)
			}
			// One more refusal of each: the daemon says it was its own.
			dest := netip.MustParseAddrPort("127.0.0.2:1")
			for _, try := range []struct{ proto, cmd string }{{"tcp", "dial %s 1s"}, {"udp", "sendto %s"}} {
				if reply := agent.Call(b, try.cmd, dest); reply != "err 1" {
					b.Fatalf("%s after the storm: %q, want EPERM", try.proto, reply)
				}
				a, err := c.Attribute(context.Background(), agent.PID(), try.proto, dest)
				if err != nil || !a.Refused || a.Rule != "storm" {
					b.Fatalf("attribution of the client's %s refusal: %+v, %v", try.proto, a, err)
				}
			}
			for _, proto := range protos {
				prefix := ""
				if proto == "udp" {
					prefix = "udp-"
				}
				b.ReportMetric(float64(cpu[proto])/float64(refused[proto]), prefix+"daemon-ns/refusal")
				b.ReportMetric(float64(refused[proto])/(float64(b.N)*duration.Seconds()), prefix+"refusals/s")
				b.ReportMetric(float64(events[proto]), prefix+"events-kept")
				b.ReportMetric(float64(counted[proto]), prefix+"refusals-in-events-kept")
			}
			udp, spread := median(ratios), median(again)
			spread = max(spread, 1/spread)
			b.ReportMetric(udp, "udp/tcp-per-refusal")
			b.ReportMetric(spread, "tcp-spread")
			b.ReportMetric(udp/spread, "udp/tcp-over-spread")
			b.ReportMetric(float64(idle)/duration.Seconds()/1e6, "daemon-idle-ms/s")
			b.ReportMetric(float64(st.LostRefusals), "records-lost")
		})
	}
}

// startOn starts cmd with its threads on cpu: a process starts on its
// parent thread's CPUs. The thread gets its own back, and lives on.
func startOn(cmd *exec.Cmd, cpu int) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var was, set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &was); err != nil {
		return err
	}
	set.Set(cpu)
	if err := unix.SchedSetaffinity(0, &set); err != nil {
		return err
	}
	defer unix.SchedSetaffinity(0, &was)
	return cmd.Start()
}

// dnsTries is how many of n tries, port after port from first over ports
// of them, went to 53 or 853, which a rule on any port leaves alone.
func dnsTries(n, first, ports int) int {
	tries := 0
	for _, dns := range []int{53, 853} {
		if k := dns - first; k >= 0 && k < ports && n > k {
			tries += (n-k-1)/ports + 1
		}
	}
	return tries
}

// cpuTime is the CPU time of every thread of process pid so far, from
// the scheduler's nanosecond account.
func cpuTime(b *testing.B, pid int) time.Duration {
	b.Helper()
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		b.Fatal(err)
	}
	var total time.Duration
	for _, t := range tasks {
		data, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/schedstat", pid, t.Name()))
		if err != nil {
			continue // the thread ended
		}
		ns, err := strconv.ParseInt(strings.Fields(string(data))[0], 10, 64)
		if err != nil {
			b.Fatal(err)
		}
		total += time.Duration(ns)
	}
	return total
}

// median is the middle of xs, or the mean of its two middles.
func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	n := len(s)
	return (s[(n-1)/2] + s[n/2]) / 2
}
