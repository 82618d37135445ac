package tests

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/egressd/egressd/internal/privtest"
	"github.com/egressd/egressd/pkg/control"
	"github.com/egressd/egressd/pkg/policy"
)

// BenchmarkPolicy100k times a policy of 100,000 rules from file to
// enforcement: egressd run started until a helper in its cgroup is refused
// by the file's last rule; a reload (SIGHUP) that adds a rule, until that
// rule refuses; and a reload of a file in which every rule changed (its
// limit) and one more was added, until that one refuses - the daemon then
// parses and writes all 100,000 again. A rule refuses its second
// connection in an hour. Each iteration starts the daemon three times;
// the figures are the mean and the slowest. It also reports the start's
// phases as the daemon logs them (reading the file; waiting, after that,
// for the datapath it opened meanwhile; installing the rules), how long
// parsing the file takes alone, the daemon's page faults at start and in
// the reload that changes every rule (first touches of memory, mostly),
// and what one costs here.
//
// A reload comes to a daemon that has been idle for reloadAfter, as an
// operator's does: one that came right after the start found the daemon's
// memory warm, and took 0.1 s less (one rule added) in runs here.
func BenchmarkPolicy100k(b *testing.B) {
	privtest.RequireRoot(b)
	const n = 100_000
	dir := b.TempDir()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	port := privtest.CloseEach(b, ln)
	probe := func(name string, ip string) string {
		return fmt.Sprintf("  - {name: %s, destination: %s, port: %d, perWindow: {permits: 1, window: 1h}}\n", name, ip, port)
	}
	rules := manyRules(n - 1)
	pol := filepath.Join(dir, "policy.yaml")
	write := func(rules, extra string) {
		if err := os.WriteFile(pol, []byte(rules+extra), 0o644); err != nil {
			b.Fatal(err)
		}
	}
	cg := privtest.Cgroup(b, "policy100k")
	agent := privtest.Spawn(b, cg, "agent")
	everyRule := strings.ReplaceAll(rules, "concurrency: 100}", "concurrency: 99}")
	var start, reload, reloadAll []time.Duration
	phases := map[string][]time.Duration{}
	var startFaults, reloadAllFaults int64
	const rounds, reloadAfter = 3, 5 * time.Second
	i := 0 // daemons started: each has a socket and state of its own
	for b.Loop() {
		for range rounds {
			i++
			write(rules, probe("probe", "127.0.0.1"))
			t0 := time.Now()
			socket := filepath.Join(dir, fmt.Sprint("s", i))
			cmd := exec.Command(egressd, "run", "--cgroup", cg, "--bpffs", privtest.PinDir(b), "--socket", socket,
				"--state-dir", filepath.Join(dir, fmt.Sprint("state", i)), "--policy", pol, "--metrics", "", "--detach-on-exit")
			var log bytes.Buffer
			cmd.Stderr = io.MultiWriter(os.Stderr, &log)
			if err := cmd.Start(); err != nil {
				b.Fatal(err)
			}
			if reply := agent.Call(b, "until-refused 127.0.0.1:%d 60s", port); reply != "ok" {
				b.Fatalf("start: %s", reply)
			}
			start = append(start, time.Since(t0))
			startFaults += minorFaults(b, cmd.Process.Pid)

			probes := probe("probe", "127.0.0.1") + probe("added", "127.0.0.2")
			for _, r := range []struct {
				rules, extra, added string
				took                *[]time.Duration
				faults              *int64
			}{
				{rules, probes, "127.0.0.2", &reload, new(int64)},
				{everyRule, probes + probe("added2", "127.0.0.3"), "127.0.0.3", &reloadAll, &reloadAllFaults},
			} {
				time.Sleep(reloadAfter)
				write(r.rules, r.extra)
				faults := minorFaults(b, cmd.Process.Pid)
				t0 = time.Now()
				if err := cmd.Process.Signal(syscall.SIGHUP); err != nil {
					b.Fatal(err)
				}
				if reply := agent.Call(b, "until-refused %s:%d 60s", r.added, port); reply != "ok" {
					b.Fatalf("reload: %s", reply)
				}
				*r.took = append(*r.took, time.Since(t0))
				*r.faults += minorFaults(b, cmd.Process.Pid) - faults
			}
			cmd.Process.Signal(syscall.SIGTERM)
			cmd.Wait() // and the copy of its log with it
			for name, took := range startPhases(b, log.String()) {
				phases[name] = append(phases[name], took)
			}
		}
	}
	// How much of that is reading the YAML alone.
	t0 := time.Now()
	if _, err := policy.Load(pol); err != nil {
		b.Fatal(err)
	}
	b.ReportMetric(time.Since(t0).Seconds(), "parse-s")
	b.ReportMetric(mean(start).Seconds(), "start-s")
	b.ReportMetric(slices.Max(start).Seconds(), "start-max-s")
	for name, took := range phases {
		b.ReportMetric(mean(took).Seconds(), "start-"+strings.ReplaceAll(name, "_", "-")+"-s")
	}
	b.ReportMetric(mean(reload).Seconds(), "reload-s")
	b.ReportMetric(slices.Max(reload).Seconds(), "reload-max-s")
	b.ReportMetric(mean(reloadAll).Seconds(), "reload-every-rule-s")
	b.ReportMetric(slices.Max(reloadAll).Seconds(), "reload-every-rule-max-s")
	b.ReportMetric(float64(startFaults)/float64(len(start)), "start-faults")
	b.ReportMetric(float64(reloadAllFaults)/float64(len(reloadAll)), "reload-every-rule-faults")
	b.ReportMetric(pageFaultCost(b).Seconds()*1e6, "page-fault-us")
}

// startPhaseAttr is a phase's time in the daemon's line "egressd running".
var startPhaseAttr = regexp.MustCompile(` (read|datapath_wait|install)=(\S+)`)

// startPhases reads how long the phases of a start took from the log of
// the daemon that made it.
func startPhases(b *testing.B, log string) map[string]time.Duration {
	b.Helper()
	for line := range strings.Lines(log) {
		if !strings.Contains(line, `msg="egressd running"`) {
			continue
		}
		out := map[string]time.Duration{}
		for _, m := range startPhaseAttr.FindAllStringSubmatch(line, -1) {
			d, err := time.ParseDuration(m[2])
			if err != nil {
				b.Fatalf("%s in %q: %v", m[1], line, err)
			}
			out[m[1]] = d
		}
		if len(out) != 3 {
			b.Fatalf("no start phases in %q", line)
		}
		return out
	}
	b.Fatalf("the daemon did not say it was running:\n%s", log)
	return nil
}

// minorFaults is how many page faults pid has taken that needed no I/O.
func minorFaults(b *testing.B, pid int) int64 {
	b.Helper()
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		b.Fatal(err)
	}
	// After the command's name, which may hold anything, in parentheses:
	// the state is the 3rd field and minflt the 10th.
	f := strings.Fields(string(data[bytes.LastIndexByte(data, ')')+1:]))
	n, err := strconv.ParseInt(f[7], 10, 64)
	if err != nil {
		b.Fatalf("minflt in %q: %v", data, err)
	}
	return n
}

// pageFaultCost is the first touch of a 4 KiB page of anonymous memory
// here, the median of five times 64 MiB mapped and touched page by page.
func pageFaultCost(b *testing.B) time.Duration {
	const size, page = 64 << 20, 4096
	var took []time.Duration
	for range 5 {
		m, err := unix.Mmap(-1, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
		if err != nil {
			b.Fatal(err)
		}
		_ = unix.Madvise(m, unix.MADV_NOHUGEPAGE) // where every page may be huge
		t0 := time.Now()
		for i := 0; i < size; i += page {
			m[i] = 1
		}
		took = append(took, time.Since(t0)/(size/page))
		if err := unix.Munmap(m); err != nil {
			b.Fatal(err)
		}
	}
	slices.Sort(took)
	return took[len(took)/2]
}

func mean(d []time.Duration) time.Duration {
	var sum time.Duration
	for _, x := range d {
		sum += x
	}
	return sum / time.Duration(len(d))
}

// manyRules is a policy of n concurrency rules to 10.0.0.0/8 addresses,
// mixed ports.
func manyRules(n int) string {
	var rules strings.Builder
	rules.WriteString("rules:\n")
	for i := range n {
		fmt.Fprintf(&rules, "  - {name: r%d, destination: 10.%d.%d.%d, port: %d, concurrency: 100}\n", i, i>>16&255, i>>8&255, i&255, 1+i%2000)
	}
	return rules.String()
}

// BenchmarkDaemon100k measures what a daemon enforcing 100,000 rules costs
// while it runs, from /proc: its CPU idle for 10 s (between two recounts,
// which come every 30 s), a metrics scrape (its size, how long it takes,
// the daemon's CPU), and the list of every rule that `egressd limit list`
// asks for, twice (the first writes each rule's text, which is kept).
func BenchmarkDaemon100k(b *testing.B) {
	privtest.RequireRoot(b)
	dir := b.TempDir()
	pol := filepath.Join(dir, "policy.yaml")
	if err := os.WriteFile(pol, []byte(manyRules(100_000)), 0o644); err != nil {
		b.Fatal(err)
	}
	cg := privtest.Cgroup(b, "daemon100k")
	var idle, scrape, scrapeCPU, list, listCPU, again, againCPU time.Duration
	var scraped int64
	for i := 0; b.Loop(); i++ {
		metrics := freeLoopbackAddr(b)
		socket := filepath.Join(dir, fmt.Sprint("s", i))
		cmd := exec.Command(egressd, "run", "--cgroup", cg, "--bpffs", privtest.PinDir(b), "--socket", socket,
			"--state-dir", filepath.Join(dir, fmt.Sprint("state", i)), "--policy", pol, "--metrics", metrics)
		cmd.Stderr = os.Stderr
		if err := cmd.Start(); err != nil {
			b.Fatal(err)
		}
		stop := func() { cmd.Process.Signal(syscall.SIGTERM); cmd.Wait() }
		c := &control.Client{Socket: socket, Timeout: time.Minute}
		for deadline := time.Now().Add(time.Minute); ; time.Sleep(50 * time.Millisecond) {
			if _, err := c.Status(context.Background()); err == nil {
				break
			} else if time.Now().After(deadline) {
				stop()
				b.Fatalf("daemon not ready: %v", err)
			}
		}
		pid := cmd.Process.Pid
		time.Sleep(time.Second) // past what start-up left running
		cpu0 := cpuTime(b, pid)
		time.Sleep(10 * time.Second)
		idle += cpuTime(b, pid) - cpu0

		cpu0, t0 := cpuTime(b, pid), time.Now()
		resp, err := http.Get("http://" + metrics + "/metrics")
		if err != nil {
			stop()
			b.Fatal(err)
		}
		n, err := io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if err != nil || resp.StatusCode != http.StatusOK {
			stop()
			b.Fatalf("scrape: %v, %s", err, resp.Status)
		}
		scrape, scrapeCPU, scraped = scrape+time.Since(t0), scrapeCPU+cpuTime(b, pid)-cpu0, scraped+n

		for _, into := range []struct{ wall, cpu *time.Duration }{{&list, &listCPU}, {&again, &againCPU}} {
			cpu0, t0 := cpuTime(b, pid), time.Now()
			n := 0
			err := c.Limits(context.Background(), control.LimitsQuery{}, func(control.Limit) error { n++; return nil })
			if err != nil || n != 100_000 {
				stop()
				b.Fatalf("limits: %d, %v", n, err)
			}
			*into.wall, *into.cpu = *into.wall+time.Since(t0), *into.cpu+cpuTime(b, pid)-cpu0
		}
		stop()
	}
	per := func(d time.Duration) float64 { return d.Seconds() / float64(b.N) }
	b.ReportMetric(per(idle)*1000, "idle-cpu-ms/10s")
	b.ReportMetric(float64(scraped)/float64(b.N)/1e6, "scrape-MB")
	b.ReportMetric(per(scrape), "scrape-s")
	b.ReportMetric(per(scrapeCPU), "scrape-cpu-s")
	b.ReportMetric(per(list), "list-s")
	b.ReportMetric(per(listCPU), "list-cpu-s")
	b.ReportMetric(per(again), "list-again-s")
	b.ReportMetric(per(againCPU), "list-again-cpu-s")
}

// freeLoopbackAddr is a loopback address with a port nobody listens on now.
func freeLoopbackAddr(b *testing.B) string {
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}
