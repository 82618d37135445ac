// Package redistest runs real redis-server (and redis-sentinel) processes
// for tests: on free loopback ports, without persistence unless asked,
// stopped when the test ends.
package redistest

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/internal/testport"
)

// Server is a redis-server a test started.
type Server struct {
	t    testing.TB
	port int
	cmd  *exec.Cmd
	args []string // how to start it again
	dir  string   // its working directory (and AOF's)
	// exited is closed once the running process has been waited for.
	exited chan struct{}
}

// Config is how a server runs.
type Config struct {
	// AOF turns on the append-only file with appendfsync everysec, in a
	// directory of the test's: a restart reads the state back.
	AOF bool
	// ReplicaOf makes the server a replica of another.
	ReplicaOf *Server
	// Cluster runs the server in cluster mode (see StartCluster).
	Cluster bool
}

// Start starts a redis-server and stops it in t.Cleanup. It skips the test
// when redis-server is not installed (apt-get install redis-server; make
// deps installs it).
func Start(t testing.TB) *Server { return StartWith(t, Config{}) }

// StartWith starts a redis-server as c says.
func StartWith(t testing.TB, c Config) *Server {
	t.Helper()
	need(t, "redis-server")
	s := &Server{t: t}
	t.Cleanup(s.Stop)
	// Another process may bind the port between the check and the
	// server's own bind: then the next port, in a new directory (a
	// cluster node's config file names its port).
	var err error
	for range 3 {
		s.port, s.dir = port(t, c.Cluster), t.TempDir()
		s.args = []string{"--port", strconv.Itoa(s.port), "--bind", "127.0.0.1", "--save", "", "--repl-diskless-sync-delay", "0", "--loglevel", "warning", "--dir", s.dir}
		if c.AOF {
			s.args = append(s.args, "--appendonly", "yes", "--appendfsync", "everysec")
		} else {
			s.args = append(s.args, "--appendonly", "no")
		}
		if c.ReplicaOf != nil {
			s.args = append(s.args, "--replicaof", "127.0.0.1", strconv.Itoa(c.ReplicaOf.port))
		}
		if c.Cluster {
			s.args = append(s.args, "--cluster-enabled", "yes", "--cluster-config-file", filepath.Join(s.dir, "nodes.conf"), "--cluster-node-timeout", "1000")
		}
		if err = s.start(); err == nil {
			return s
		}
	}
	t.Fatalf("redis-server: %v", err)
	return nil
}

func need(t testing.TB, cmd string) {
	t.Helper()
	if _, err := exec.LookPath(cmd); err != nil {
		t.Skipf("%s not installed: this test needs a real one (make deps installs it)", cmd)
	}
}

// port is a free port for a server (and its cluster bus port, 10000 above).
func port(t testing.TB, cluster bool) int {
	if cluster {
		return testport.Free(t, 10000)
	}
	return testport.Free(t)
}

// Addr is the server's host:port.
func (s *Server) Addr() string { return "127.0.0.1:" + strconv.Itoa(s.port) }

// URL is the server's redis:// URL.
func (s *Server) URL() string { return "redis://" + s.Addr() }

// Restart starts the server again on its port after Stop and waits until
// it answers: empty, unless it keeps an AOF.
func (s *Server) Restart() {
	s.t.Helper()
	if err := s.start(); err != nil {
		s.t.Fatalf("redis-server: %v", err)
	}
}

// start runs the server and waits until it answers; on failure it is
// stopped, and the error has what it printed.
func (s *Server) start() error {
	cmd := exec.Command("redis-server", s.args...)
	cmd.Dir = s.dir
	out := new(bytes.Buffer)
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start: %w", err)
	}
	exited := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(exited)
	}()
	s.cmd, s.exited = cmd, exited
	if err := waitPing(s.Addr(), exited); err != nil {
		s.Stop()
		return fmt.Errorf("on %s: %w\n%s", s.Addr(), err, out)
	}
	return nil
}

// waitPing waits until the server at addr answers PING, or exited is
// closed (nil: never).
func waitPing(addr string, exited <-chan struct{}) error {
	c := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1})
	defer c.Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		err := c.Ping(ctx).Err()
		cancel()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("never answered PING: %w", err)
		}
		select {
		case <-exited:
			return fmt.Errorf("exited without answering PING: %w", err)
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// Stop kills the server (SIGKILL: no chance to save) and waits for it;
// safe to call twice.
func (s *Server) Stop() {
	if s.cmd == nil {
		return
	}
	_ = s.cmd.Process.Signal(syscall.SIGCONT) // a paused one too
	_ = s.cmd.Process.Kill()
	<-s.exited
	s.cmd = nil
}

// Bind makes the server listen on addrs (and 127.0.0.1) from now on, and
// after a Restart: for clients in network namespaces reaching it over a
// veth.
func (s *Server) Bind(t testing.TB, addrs ...string) {
	t.Helper()
	bind := strings.Join(append([]string{"127.0.0.1"}, addrs...), " ")
	for i, a := range s.args {
		if a == "--bind" {
			s.args[i+1] = bind
		}
	}
	if !slices.Contains(s.args, "--protected-mode") {
		// Protected mode refuses clients that are not on loopback; these
		// come over the test's own veths, and the server binds no other
		// address.
		s.args = append(s.args, "--protected-mode", "no")
	}
	for _, set := range [][]any{{"bind", bind}, {"protected-mode", "no"}} {
		if _, err := s.Do(append([]any{"CONFIG", "SET"}, set...)...); err != nil {
			t.Fatalf("redis config set %v: %v", set, err)
		}
	}
}

// Port is the server's port.
func (s *Server) Port() int { return s.port }

// Pause stops the server's process (SIGSTOP): connections stay open and
// requests wait unanswered, as with a hung or overloaded Redis.
func (s *Server) Pause() { s.signal(syscall.SIGSTOP) }

// Resume lets a paused server go on (SIGCONT).
func (s *Server) Resume() { s.signal(syscall.SIGCONT) }

func (s *Server) signal(sig syscall.Signal) {
	s.t.Helper()
	if s.cmd == nil {
		s.t.Fatalf("redis-server on %s is not running", s.Addr())
	}
	if err := s.cmd.Process.Signal(sig); err != nil {
		s.t.Fatalf("signal redis-server: %v", err)
	}
}

// Client returns a client of s, closed in t.Cleanup, that fails fast when
// the server is down.
func (s *Server) Client(t testing.TB) *redis.Client {
	c := redis.NewClient(&redis.Options{
		Addr:        s.Addr(),
		MaxRetries:  -1,
		DialTimeout: 200 * time.Millisecond,
		ReadTimeout: time.Second,
		PoolSize:    64,
	})
	t.Cleanup(func() { c.Close() })
	return c
}

// Do runs one command on s and returns its reply.
func (s *Server) Do(args ...any) (any, error) {
	c := redis.NewClient(&redis.Options{Addr: s.Addr(), MaxRetries: -1})
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return c.Do(ctx, args...).Result()
}

// Calls is how many times the server ran a command since it started
// (INFO commandstats), e.g. "evalsha".
func (s *Server) Calls(t testing.TB, command string) int {
	t.Helper()
	info, err := s.Do("INFO", "commandstats")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(info.(string), "\r\n") {
		rest, ok := strings.CutPrefix(l, "cmdstat_"+command+":calls=")
		if !ok {
			continue
		}
		n, err := strconv.Atoi(rest[:strings.IndexByte(rest, ',')])
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	return 0
}

// WaitReplica waits until replica has caught up with s: a write to s
// reached it (WAIT on the connection that wrote).
func (s *Server) WaitReplica(t testing.TB, replica *Server) {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: s.Addr(), MaxRetries: -1})
	defer c.Close()
	clocktest.Eventually(t, fmt.Sprintf("replica %s to catch up with %s", replica.Addr(), s.Addr()), func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		pipe := c.Pipeline()
		pipe.Set(ctx, "redistest:replicated", replica.Addr(), 0)
		wait := pipe.Do(ctx, "WAIT", 1, 200)
		_, err := pipe.Exec(ctx)
		if n, _ := wait.Int64(); err != nil || n < 1 {
			return false
		}
		v, _ := replica.Do("GET", "redistest:replicated")
		return v == replica.Addr()
	})
}

// Sentinel is a redis-sentinel watching one primary.
type Sentinel struct {
	t    testing.TB
	port int
	cmd  *exec.Cmd
}

// StartSentinel starts a sentinel that watches primary as master name,
// deciding alone (quorum 1) that it is down after downAfter.
func StartSentinel(t testing.TB, name string, primary *Server, downAfter time.Duration) *Sentinel {
	t.Helper()
	need(t, "redis-sentinel")
	s := &Sentinel{t: t, port: testport.Free(t)}
	dir := t.TempDir()
	conf := filepath.Join(dir, "sentinel.conf")
	text := fmt.Sprintf("port %d\nbind 127.0.0.1\ndir %s\nsentinel monitor %s 127.0.0.1 %d 1\nsentinel down-after-milliseconds %s %d\nsentinel failover-timeout %s 5000\nsentinel parallel-syncs %s 1\n",
		s.port, dir, name, primary.port, name, downAfter.Milliseconds(), name, name)
	if err := os.WriteFile(conf, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	s.cmd = exec.Command("redis-sentinel", conf)
	s.cmd.Dir = dir
	if err := s.cmd.Start(); err != nil {
		t.Fatalf("start redis-sentinel: %v", err)
	}
	t.Cleanup(func() {
		_ = s.cmd.Process.Kill()
		_ = s.cmd.Wait()
	})
	if err := waitPing(s.Addr(), nil); err != nil {
		t.Fatalf("redis-sentinel on %s: %v", s.Addr(), err)
	}
	return s
}

// Addr is the sentinel's host:port.
func (s *Sentinel) Addr() string { return "127.0.0.1:" + strconv.Itoa(s.port) }

// Primary asks the sentinel which server is the primary of name now.
func (s *Sentinel) Primary(t testing.TB, name string) string {
	t.Helper()
	c := redis.NewSentinelClient(&redis.Options{Addr: s.Addr()})
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	addr, err := c.GetMasterAddrByName(ctx, name).Result()
	if err != nil {
		t.Fatal(err)
	}
	return net.JoinHostPort(addr[0], addr[1])
}

// StartCluster starts n cluster-mode servers, joins them into one cluster
// of n primaries (redis-cli --cluster create) and waits until it serves
// every slot.
func StartCluster(t testing.TB, n int) []*Server {
	t.Helper()
	need(t, "redis-cli")
	var nodes []*Server
	args := []string{"--cluster", "create"}
	for range n {
		s := StartWith(t, Config{Cluster: true})
		nodes = append(nodes, s)
		args = append(args, s.Addr())
	}
	args = append(args, "--cluster-replicas", "0", "--cluster-yes")
	if out, err := exec.Command("redis-cli", args...).CombinedOutput(); err != nil {
		t.Fatalf("redis-cli --cluster create: %v\n%s", err, out)
	}
	for _, s := range nodes {
		clocktest.Eventually(t, "cluster state ok on "+s.Addr(), func() bool {
			info, err := s.Do("CLUSTER", "INFO")
			return err == nil && strings.Contains(info.(string), "cluster_state:ok")
		})
	}
	return nodes
}
