package shared

import (
	"context"
	"net"
	"os/exec"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// server is a redis-server the test started on loopback.
type server struct {
	t    testing.TB
	port int
	cmd  *exec.Cmd
}

// startRedis starts a redis-server on a free loopback port, without
// persistence, and stops it in t.Cleanup. It skips the test when
// redis-server is not installed (apt-get install redis-server; make deps
// installs it).
func startRedis(t testing.TB) *server {
	t.Helper()
	if _, err := exec.LookPath("redis-server"); err != nil {
		t.Skip("redis-server not installed: the shared limiters need a real Redis (apt-get install redis-server)")
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	s := &server{t: t, port: port}
	s.start()
	t.Cleanup(s.stop)
	return s
}

func (s *server) addr() string { return "127.0.0.1:" + strconv.Itoa(s.port) }

func (s *server) start() {
	s.t.Helper()
	s.cmd = exec.Command("redis-server", "--port", strconv.Itoa(s.port), "--bind", "127.0.0.1",
		"--save", "", "--appendonly", "no", "--loglevel", "warning")
	if err := s.cmd.Start(); err != nil {
		s.t.Fatalf("start redis-server: %v", err)
	}
	c := redis.NewClient(&redis.Options{Addr: s.addr(), MaxRetries: -1})
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
			s.stop()
			s.t.Fatalf("redis-server on %s never answered PING: %v", s.addr(), err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// stop kills the server and waits for it; safe to call twice.
func (s *server) stop() {
	if s.cmd == nil {
		return
	}
	_ = s.cmd.Process.Kill()
	_ = s.cmd.Wait()
	s.cmd = nil
}

// client returns a client of s, closed in t.Cleanup, that fails fast when
// the server is down.
func (s *server) client(t testing.TB) *redis.Client {
	c := redis.NewClient(&redis.Options{
		Addr:        s.addr(),
		MaxRetries:  -1,
		DialTimeout: 200 * time.Millisecond,
		ReadTimeout: time.Second,
		PoolSize:    64,
	})
	t.Cleanup(func() { c.Close() })
	return c
}
