package privtest

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"os/exec"
	"syscall"
	"testing"
)

const helperEnv = "EGRESSD_TEST_HELPER"

// helpers are the roles a test binary can be re-run as.
var helpers = map[string]func(args []string) error{
	"agent":     runAgent,
	"storm":     runStorm,
	"requester": runRequester,
}

// IsHelper reports whether this test binary was started as a helper.
func IsHelper() bool { return os.Getenv(helperEnv) != "" }

// Role is an extra helper a test package can be re-run as.
type Role struct {
	Name string
	Run  func(args []string) error
}

// Main runs the test binary as a helper when a test started it as one,
// and as the tests otherwise. Call it from TestMain.
func Main(m *testing.M, roles ...Role) {
	for _, r := range roles {
		helpers[r.Name] = r.Run
	}
	if name := os.Getenv(helperEnv); name != "" {
		fn, ok := helpers[name]
		if !ok {
			fmt.Fprintf(os.Stderr, "unknown helper %q\n", name)
			os.Exit(2)
		}
		if err := fn(os.Args[1:]); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// Child is a helper process started directly inside a cgroup, so every
// socket it creates is counted there.
type Child struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	stdout *bufio.Scanner
}

// Spawn starts the test binary as the named helper inside cgroup dir. It is
// killed when the test ends if it is still running.
func Spawn(t testing.TB, dir, helper string, args ...string) *Child {
	t.Helper()
	c, err := spawn(dir, helper, args, 0)
	if err != nil {
		t.Fatal(err)
	}
	c.cleanup(t)
	return c
}

// SpawnPIDNamespace starts the helper as Spawn does, as the first process
// of a new pid namespace: its pids are not the host's.
func SpawnPIDNamespace(t testing.TB, dir, helper string, args ...string) *Child {
	t.Helper()
	c, err := spawn(dir, helper, args, syscall.CLONE_NEWPID)
	if err != nil {
		t.Fatal(err)
	}
	c.cleanup(t)
	return c
}

// Spawn starts the helper as the package-level Spawn does, inside the
// namespace: its sockets are the namespace's.
func (ns *NetNS) Spawn(t testing.TB, dir, helper string, args ...string) *Child {
	t.Helper()
	var c *Child
	err := ns.Do(func() (err error) {
		c, err = spawn(dir, helper, args, 0)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	c.cleanup(t)
	return c
}

func spawn(dir, helper string, args []string, cloneflags uintptr) (*Child, error) {
	cg, err := os.Open(dir)
	if err != nil {
		return nil, fmt.Errorf("open cgroup: %w", err)
	}
	defer cg.Close()
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(exe, args...)
	cmd.Env = append(os.Environ(), helperEnv+"="+helper)
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(cg.Fd()), Pdeathsig: syscall.SIGKILL, Cloneflags: cloneflags}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start helper: %w", err)
	}
	return &Child{cmd: cmd, stdin: stdin, stdout: bufio.NewScanner(stdout)}, nil
}

func (c *Child) cleanup(t testing.TB) {
	t.Cleanup(func() {
		if c.cmd.ProcessState == nil {
			c.cmd.Process.Kill()
			c.cmd.Wait()
		}
	})
}

// Call sends one command line and returns the reply line.
func (c *Child) Call(t testing.TB, format string, args ...any) string {
	t.Helper()
	reply, err := c.Send(format, args...)
	if err != nil {
		t.Fatal(err)
	}
	return reply
}

// Send is Call for a goroutine other than the test's, where t.Fatal would
// end only that goroutine and leave the test waiting for its answer.
func (c *Child) Send(format string, args ...any) (string, error) {
	if _, err := fmt.Fprintf(c.stdin, format+"\n", args...); err != nil {
		return "", fmt.Errorf("helper write: %w", err)
	}
	if !c.stdout.Scan() {
		return "", fmt.Errorf("helper exited: %v", c.stdout.Err())
	}
	return c.stdout.Text(), nil
}

// Line reads one line the helper printed by itself.
func (c *Child) Line(t testing.TB) string {
	t.Helper()
	if !c.stdout.Scan() {
		t.Fatalf("helper exited: %v", c.stdout.Err())
	}
	return c.stdout.Text()
}

// Kill sends SIGKILL and waits for the process to be gone.
func (c *Child) Kill(t testing.TB) {
	t.Helper()
	if err := c.cmd.Process.Kill(); err != nil {
		t.Fatalf("kill helper: %v", err)
	}
	c.cmd.Wait()
}

// Wait closes the helper's input and waits for it to exit cleanly.
func (c *Child) Wait(t testing.TB) {
	t.Helper()
	c.stdin.Close()
	if err := c.cmd.Wait(); err != nil {
		t.Fatalf("helper: %v", err)
	}
}

// CloseInput closes the helper's input, which tells a helper that runs
// until then to finish; read what it prints, then Wait.
func (c *Child) CloseInput() { c.stdin.Close() }

// PID is the helper's process id.
func (c *Child) PID() int { return c.cmd.Process.Pid }
