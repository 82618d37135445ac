package tests

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/egressd/egressd/internal/privtest"
	"github.com/egressd/egressd/pkg/control"
	"github.com/egressd/egressd/pkg/policy"
)

// BenchmarkPolicy100k times a policy of 100,000 rules from file to
// enforcement: egressd run started until a helper in its cgroup is refused
// by the file's last rule, and a reload (SIGHUP) that adds a rule until
// that rule refuses. A rule refuses its second connection in an hour. It
// also reports how long parsing the file takes alone.
func BenchmarkPolicy100k(b *testing.B) {
	privtest.RequireRoot(b)
	const n = 100_000
	dir := b.TempDir()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	port := ln.Addr().(*net.TCPAddr).Port
	probe := func(name string, ip string) string {
		return fmt.Sprintf("  - {name: %s, destination: %s, port: %d, perWindow: {permits: 1, window: 1h}}\n", name, ip, port)
	}
	var rules strings.Builder
	rules.WriteString("rules:\n")
	for i := range n - 1 {
		fmt.Fprintf(&rules, "  - {name: r%d, destination: 10.%d.%d.%d, port: %d, concurrency: 100}\n", i, i>>16&255, i>>8&255, i&255, 1+i%2000)
	}
	pol := filepath.Join(dir, "policy.yaml")
	write := func(extra string) {
		if err := os.WriteFile(pol, []byte(rules.String()+extra), 0o644); err != nil {
			b.Fatal(err)
		}
	}
	cg := privtest.Cgroup(b, "policy100k")
	agent := privtest.Spawn(b, cg, "agent")
	var start, reload []time.Duration
	for i := 0; b.Loop(); i++ {
		write(probe("probe", "127.0.0.1"))
		t0 := time.Now()
		socket := filepath.Join(dir, fmt.Sprint("s", i))
		cmd := exec.Command(egressd, "run", "--cgroup", cg, "--bpffs", privtest.PinDir(b), "--socket", socket,
			"--state-dir", filepath.Join(dir, fmt.Sprint("state", i)), "--policy", pol, "--metrics", "", "--detach-on-exit")
		cmd.Stderr = os.Stderr
		if err := cmd.Start(); err != nil {
			b.Fatal(err)
		}
		if reply := agent.Call(b, "until-refused 127.0.0.1:%d 60s", port); reply != "ok" {
			b.Fatalf("start: %s", reply)
		}
		start = append(start, time.Since(t0))
		// SIGHUP before the daemon handles it would end it.
		c := &control.Client{Socket: socket, Timeout: time.Second}
		for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) {
			if _, err := c.Status(context.Background()); err == nil {
				break
			} else if time.Now().After(deadline) {
				b.Fatalf("daemon not ready: %v", err)
			}
		}

		write(probe("probe", "127.0.0.1") + probe("added", "127.0.0.2"))
		t0 = time.Now()
		if err := cmd.Process.Signal(syscall.SIGHUP); err != nil {
			b.Fatal(err)
		}
		if reply := agent.Call(b, "until-refused 127.0.0.2:%d 60s", port); reply != "ok" {
			b.Fatalf("reload: %s", reply)
		}
		reload = append(reload, time.Since(t0))
		cmd.Process.Signal(syscall.SIGTERM)
		cmd.Wait()
	}
	// How much of that is reading the YAML alone.
	t0 := time.Now()
	if _, err := policy.Load(pol); err != nil {
		b.Fatal(err)
	}
	b.ReportMetric(time.Since(t0).Seconds(), "parse-s")
	b.ReportMetric(mean(start).Seconds(), "start-s")
	b.ReportMetric(mean(reload).Seconds(), "reload-s")
}

func mean(d []time.Duration) time.Duration {
	var sum time.Duration
	for _, x := range d {
		sum += x
	}
	return sum / time.Duration(len(d))
}
