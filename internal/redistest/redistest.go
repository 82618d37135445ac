// Package redistest runs a real redis-server for tests: on a free loopback
// port, without persistence, stopped when the test ends.
package redistest

import (
	"context"
	"net"
	"os/exec"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// Server is a redis-server a test started.
type Server struct {
	t    testing.TB
	port int
	cmd  *exec.Cmd
}

// Start starts a redis-server and stops it in t.Cleanup. It skips the test
// when redis-server is not installed (apt-get install redis-server; make
// deps installs it).
func Start(t testing.TB) *Server {
	t.Helper()
	if _, err := exec.LookPath("redis-server"); err != nil {
		t.Skip("redis-server not installed: this test needs a real Redis (apt-get install redis-server)")
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	s := &Server{t: t, port: port}
	s.Restart()
	t.Cleanup(s.Stop)
	return s
}

// Addr is the server's host:port.
func (s *Server) Addr() string { return "127.0.0.1:" + strconv.Itoa(s.port) }

// URL is the server's redis:// URL.
func (s *Server) URL() string { return "redis://" + s.Addr() }

// Restart starts the server again on its port after Stop, empty, and
// waits until it answers.
func (s *Server) Restart() {
	s.t.Helper()
	s.cmd = exec.Command("redis-server", "--port", strconv.Itoa(s.port), "--bind", "127.0.0.1",
		"--save", "", "--appendonly", "no", "--loglevel", "warning")
	if err := s.cmd.Start(); err != nil {
		s.t.Fatalf("start redis-server: %v", err)
	}
	c := redis.NewClient(&redis.Options{Addr: s.Addr(), MaxRetries: -1})
	defer c.Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		err := c.Ping(ctx).Err()
		cancel()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			s.Stop()
			s.t.Fatalf("redis-server on %s never answered PING: %v", s.Addr(), err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Stop kills the server and waits for it; safe to call twice.
func (s *Server) Stop() {
	if s.cmd == nil {
		return
	}
	_ = s.cmd.Process.Kill()
	_ = s.cmd.Wait()
	s.cmd = nil
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
