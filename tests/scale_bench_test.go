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
// which come every 30 s); metrics scrapes as Prometheus makes them (gzip
// asked), with the default --metrics-rules (500) and with 1,000: the
// first after start, which builds what the daemon keeps of each rule, then
// five a second apart (their mean and the slowest); the list of every rule
// `egressd limit ls` asks for, twice (the first writes each rule's text),
// with the time to its first row; a list of the rules named r123* (111);
// the busiest 50 that `egressd top` asks for at each refresh; and the
// events `egressd events` lists.
func BenchmarkDaemon100k(b *testing.B) {
	privtest.RequireRoot(b)
	dir := b.TempDir()
	pol := filepath.Join(dir, "policy.yaml")
	if err := os.WriteFile(pol, []byte(manyRules(100_000)), 0o644); err != nil {
		b.Fatal(err)
	}
	cg := privtest.Cgroup(b, "daemon100k")
	var idle time.Duration
	scrapes := map[int]*scrapeFigures{500: {}, 1000: {}}
	var list, listFirst, listCPU, again, againCPU, named, namedCPU, top, topCPU, events time.Duration
	for i := 0; b.Loop(); i++ {
		for _, perRule := range []int{500, 1000} {
			d := startDaemon100k(b, dir, pol, cg, fmt.Sprint(i, "-", perRule), perRule)
			if perRule == 500 {
				cpu0 := cpuTime(b, d.pid)
				time.Sleep(10 * time.Second)
				idle += cpuTime(b, d.pid) - cpu0
			}
			scrapes[perRule].add(b, d)
			if perRule == 1000 {
				d.stop()
				continue
			}
			for _, into := range []struct{ wall, first, cpu *time.Duration }{{&list, &listFirst, &listCPU}, {&again, new(time.Duration), &againCPU}} {
				n := d.list(b, control.LimitsQuery{}, into.wall, into.first, into.cpu)
				if n != 100_000 {
					d.stop()
					b.Fatalf("listed %d rules", n)
				}
			}
			if n := d.list(b, control.LimitsQuery{Name: "r123*"}, &named, new(time.Duration), &namedCPU); n != 111 {
				d.stop()
				b.Fatalf("listed %d rules r123*", n)
			}
			if n := d.list(b, control.LimitsQuery{Sort: control.SortBusy, Max: 50}, &top, new(time.Duration), &topCPU); n != 50 {
				d.stop()
				b.Fatalf("listed %d busiest rules", n)
			}
			t0 := time.Now()
			if err := d.c.Events(context.Background(), false, func(control.Event) error { return nil }); err != nil {
				d.stop()
				b.Fatal(err)
			}
			events += time.Since(t0)
			d.stop()
		}
	}
	per := func(d time.Duration) float64 { return d.Seconds() / float64(b.N) }
	ms := func(d time.Duration) float64 { return per(d) * 1000 }
	b.ReportMetric(ms(idle), "idle-cpu-ms/10s")
	def, more := scrapes[500], scrapes[1000]
	cpu, wall := def.mean()
	b.ReportMetric(def.bytes/float64(b.N)/1e6, "scrape-MB")
	b.ReportMetric(cpu, "scrape-cpu-ms")
	b.ReportMetric(def.slowest*1000, "scrape-max-cpu-ms")
	b.ReportMetric(ms(def.first), "scrape-first-cpu-ms")
	b.ReportMetric(wall, "scrape-ms")
	cpu, _ = more.mean()
	b.ReportMetric(more.bytes/float64(b.N)/1e6, "scrape-1000-MB")
	b.ReportMetric(cpu, "scrape-1000-cpu-ms")
	b.ReportMetric(more.bytes/def.bytes, "scrape-1000/500")
	b.ReportMetric(per(list), "list-s")
	b.ReportMetric(per(listFirst), "list-first-row-s")
	b.ReportMetric(per(listCPU), "list-cpu-s")
	b.ReportMetric(per(again), "list-again-s")
	b.ReportMetric(per(againCPU), "list-again-cpu-s")
	b.ReportMetric(ms(named), "list-name-ms")
	b.ReportMetric(ms(namedCPU), "list-name-cpu-ms")
	b.ReportMetric(ms(top), "top-ms")
	b.ReportMetric(ms(topCPU), "top-cpu-ms")
	b.ReportMetric(ms(events), "events-ms")
}

// daemon100k is a daemon BenchmarkDaemon100k started.
type daemon100k struct {
	cmd     *exec.Cmd
	pid     int
	c       *control.Client
	metrics string
}

// startDaemon100k starts a daemon of the policy pol, with --metrics-rules
// perRule, and waits until it answers and has settled.
func startDaemon100k(b *testing.B, dir, pol, cg, name string, perRule int) *daemon100k {
	d := &daemon100k{metrics: freeLoopbackAddr(b)}
	socket := filepath.Join(dir, "s"+name)
	d.cmd = exec.Command(egressd, "run", "--cgroup", cg, "--bpffs", privtest.PinDir(b), "--socket", socket,
		"--state-dir", filepath.Join(dir, "state"+name), "--policy", pol, "--metrics", d.metrics, "--metrics-rules", fmt.Sprint(perRule))
	d.cmd.Stderr = os.Stderr
	if err := d.cmd.Start(); err != nil {
		b.Fatal(err)
	}
	d.pid = d.cmd.Process.Pid
	d.c = &control.Client{Socket: socket, Timeout: time.Minute}
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(50 * time.Millisecond) {
		if _, err := d.c.Status(context.Background()); err == nil {
			break
		} else if time.Now().After(deadline) {
			d.stop()
			b.Fatalf("daemon not ready: %v", err)
		}
	}
	time.Sleep(time.Second) // past what start-up left running
	return d
}

func (d *daemon100k) stop() { d.cmd.Process.Signal(syscall.SIGTERM); d.cmd.Wait() }

// scrape gets /metrics as Prometheus does, gzip asked (Go's client asks
// and inflates), and returns the text's size, the time and the daemon's
// CPU it took.
func (d *daemon100k) scrape(b *testing.B) (size int64, wall, cpu time.Duration) {
	cpu0, t0 := cpuTime(b, d.pid), time.Now()
	resp, err := http.Get("http://" + d.metrics + "/metrics")
	if err != nil {
		d.stop()
		b.Fatal(err)
	}
	n, err := io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if err != nil || resp.StatusCode != http.StatusOK {
		d.stop()
		b.Fatalf("scrape: %v, %s", err, resp.Status)
	}
	return n, time.Since(t0), cpuTime(b, d.pid) - cpu0
}

// list lists the rules q picks, adding to wall the time it took, to
// first the time to the first rule, and to cpu the daemon's CPU; it
// returns how many rules came.
func (d *daemon100k) list(b *testing.B, q control.LimitsQuery, wall, first, cpu *time.Duration) int {
	cpu0, t0 := cpuTime(b, d.pid), time.Now()
	n := 0
	err := d.c.Limits(context.Background(), q, func(control.Limit) error {
		if n++; n == 1 {
			*first += time.Since(t0)
		}
		return nil
	})
	if err != nil {
		d.stop()
		b.Fatal(err)
	}
	*wall, *cpu = *wall+time.Since(t0), *cpu+cpuTime(b, d.pid)-cpu0
	return n
}

// scrapeFigures add up the scrapes of the daemons of one --metrics-rules.
type scrapeFigures struct {
	bytes         float64 // of each daemon's last scrape
	first, wall   time.Duration
	steady        time.Duration // the CPU of the scrapes after the first
	slowest       float64       // seconds
	steadyScrapes int
}

// add scrapes d once, then five times a second apart.
func (f *scrapeFigures) add(b *testing.B, d *daemon100k) {
	_, _, cpu := d.scrape(b)
	f.first += cpu
	for range 5 {
		time.Sleep(time.Second)
		n, wall, cpu := d.scrape(b)
		f.wall += wall
		f.steady += cpu
		f.steadyScrapes++
		f.slowest = max(f.slowest, cpu.Seconds())
		f.bytes += float64(n) / 5
	}
}

// mean is a scrape after the first, its CPU and its time, in ms.
func (f *scrapeFigures) mean() (cpu, wall float64) {
	n := float64(f.steadyScrapes)
	return f.steady.Seconds() * 1000 / n, f.wall.Seconds() * 1000 / n
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
