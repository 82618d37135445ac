package tests

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/egressd/egressd/internal/privtest"
	"github.com/egressd/egressd/pkg/control"
)

// BenchmarkRefusalStorm runs the daemon while processes in its cgroup are
// refused 50,000 times a second in all for three seconds (one of them
// holds the rule's one slot), and reports the daemon's own CPU time (every
// thread's, from /proc) per refused connect(): one client retrying one
// destination; 16 clients retrying it, their refusals interleaved; and one
// client trying a different port each time over 65,535, so that every
// refusal is a new pair of process and destination, each an event. It
// checks that the rule counted every refusal, that `egressd events` shows
// the storm, and that the daemon attributes a client's refusal.
func BenchmarkRefusalStorm(b *testing.B) {
	for _, tc := range []struct {
		name           string
		clients, ports int
	}{
		{"1-client", 1, 1},
		{"16-clients", 16, 1},
		{"1-client-65535-ports", 1, 65535},
	} {
		b.Run(tc.name, func(b *testing.B) {
			privtest.RequireRoot(b)
			const rate, duration = 50_000, 3 * time.Second
			dir := b.TempDir()
			pol := filepath.Join(dir, "policy.yaml")
			if err := os.WriteFile(pol, []byte("rules:\n  - name: storm\n    destination: 127.0.0.2\n    concurrency: 1\n"), 0o644); err != nil {
				b.Fatal(err)
			}
			cg := privtest.Cgroup(b, "storm")
			socket := filepath.Join(dir, "egressd.sock")
			cmd := exec.Command(egressd, "run", "--cgroup", cg, "--bpffs", privtest.PinDir(b), "--socket", socket,
				"--state-dir", filepath.Join(dir, "state"), "--policy", pol, "--metrics", "", "--detach-on-exit")
			cmd.Stderr = os.Stderr
			if err := cmd.Start(); err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { cmd.Process.Signal(os.Interrupt); cmd.Wait() })
			c := &control.Client{Socket: socket, Timeout: time.Second}
			for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
				if _, err := c.Status(context.Background()); err == nil {
					break
				} else if time.Now().After(deadline) {
					b.Fatalf("daemon not ready: %v", err)
				}
			}
			var agents []*privtest.Child
			for range tc.clients {
				agents = append(agents, privtest.Spawn(b, cg, "agent"))
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

			// What the daemon spends with nothing refused, to set the
			// storm's figure against.
			idle := cpuTime(b, cmd.Process.Pid)
			time.Sleep(duration)
			idle = cpuTime(b, cmd.Process.Pid) - idle

			var cpu time.Duration
			var refused int
			for b.Loop() {
				before := cpuTime(b, cmd.Process.Pid)
				replies := make([]string, len(agents))
				var wg sync.WaitGroup
				for i, a := range agents {
					wg.Go(func() {
						var err error
						if replies[i], err = a.Send("storm 127.0.0.2:1 %d %d %s", tc.ports, rate/len(agents), duration); err != nil {
							b.Error(err)
						}
					})
				}
				wg.Wait()
				for _, reply := range replies {
					var n, r int
					if _, err := fmt.Sscanf(reply, "ok %d %d", &n, &r); err != nil || r != n {
						b.Fatalf("storm: %q (%v), want every connect refused", reply, err)
					}
					refused += r
				}
				// Events come out within a tenth of a second, and a
				// pair's last counts a second after its last event.
				time.Sleep(1200 * time.Millisecond)
				cpu += cpuTime(b, cmd.Process.Pid) - before
			}
			l, err := c.Limit(context.Background(), "storm")
			if err != nil || l.Refused != uint64(refused) || l.Live != 1 {
				b.Fatalf("the rule counted %d refusals (%v), the client was refused %d times", l.Refused, err, refused)
			}
			var events, counted uint64
			err = c.Events(context.Background(), false, func(r control.Event) error {
				if r.Rule == "storm" {
					events++
					counted += r.Count
				}
				return nil
			})
			st, serr := c.Status(context.Background())
			if err != nil || serr != nil || events == 0 {
				b.Fatalf("events: %d of the storm (%v, %v)", events, err, serr)
			}
			// One more refusal: the daemon says it was its own.
			if reply := agent.Call(b, "dial 127.0.0.2:1 1s"); reply != "err 1" {
				b.Fatalf("dial after the storm: %q, want EPERM", reply)
			}
			a, err := c.Attribute(context.Background(), agent.PID(), "", netip.MustParseAddrPort("127.0.0.2:1"))
			if err != nil || !a.Refused || a.Rule != "storm" {
				b.Fatalf("attribution of the client's refusal: %+v, %v", a, err)
			}
			b.ReportMetric(float64(cpu)/float64(refused), "daemon-ns/refusal")
			b.ReportMetric(float64(idle)/duration.Seconds()/1e6, "daemon-idle-ms/s")
			b.ReportMetric(float64(refused)/(float64(b.N)*duration.Seconds()), "refusals/s")
			b.ReportMetric(float64(events), "events-kept")
			b.ReportMetric(float64(counted), "refusals-in-events-kept")
			b.ReportMetric(float64(st.LostRefusals), "records-lost")
		})
	}
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
