package sdnotify_test

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/egressd/egressd/internal/sdnotify"
)

// listen creates a unixgram socket at name, points NOTIFY_SOCKET at it and
// returns it; t.Setenv restores the environment.
func listen(t *testing.T, name string) *net.UnixConn {
	t.Helper()
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: name, Net: "unixgram"})
	if err != nil {
		t.Fatalf("listen %s: %v", name, err)
	}
	t.Cleanup(func() { conn.Close() })
	t.Setenv("NOTIFY_SOCKET", name)
	return conn
}

// fileSocket is a socket in the test's temporary directory.
func fileSocket(t *testing.T) *net.UnixConn {
	return listen(t, filepath.Join(t.TempDir(), "notify"))
}

// abstractSocket is a socket in the abstract namespace, the "@name" form.
func abstractSocket(t *testing.T) *net.UnixConn {
	b := make([]byte, 8)
	rand.Read(b)
	return listen(t, "@egressd-sdnotify-test-"+hex.EncodeToString(b))
}

// receive reads one datagram, failing the test if none comes.
func receive(t *testing.T, conn *net.UnixConn) string {
	t.Helper()
	if err := conn.SetReadDeadline(time.Now().Add(5 * time.Second)); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4096)
	n, err := conn.Read(buf)
	if err != nil {
		t.Fatalf("read datagram: %v", err)
	}
	return string(buf[:n])
}

// nothingMore fails the test if another datagram is waiting.
func nothingMore(t *testing.T, conn *net.UnixConn) {
	t.Helper()
	if err := conn.SetReadDeadline(time.Now().Add(50 * time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4096)
	if n, err := conn.Read(buf); err == nil {
		t.Errorf("unexpected datagram %q", buf[:n])
	}
}

func TestMessages(t *testing.T) {
	tests := []struct {
		name string
		send func() error
		want string
	}{
		{"ready", sdnotify.Ready, "READY=1"},
		{"stopping", sdnotify.Stopping, "STOPPING=1"},
		{"watchdog", sdnotify.Watchdog, "WATCHDOG=1"},
		{"status", func() error { return sdnotify.Status("enforcing 3 rules") }, "STATUS=enforcing 3 rules"},
		{"status empty", func() error { return sdnotify.Status("") }, "STATUS="},
		{"status newlines", func() error { return sdnotify.Status("reload failed:\nline 3: bad\r\nREADY=1") }, "STATUS=reload failed: line 3: bad READY=1"},
		{"notify", func() error { return sdnotify.Notify("EXTEND_TIMEOUT_USEC=5000000") }, "EXTEND_TIMEOUT_USEC=5000000"},
	}
	sockets := []struct {
		name   string
		listen func(*testing.T) *net.UnixConn
	}{
		{"path", fileSocket},
		{"abstract", abstractSocket},
	}
	for _, s := range sockets {
		for _, tt := range tests {
			t.Run(s.name+"/"+tt.name, func(t *testing.T) {
				conn := s.listen(t)
				if err := tt.send(); err != nil {
					t.Fatalf("send: %v", err)
				}
				if got := receive(t, conn); got != tt.want {
					t.Errorf("datagram = %q, want %q", got, tt.want)
				}
				nothingMore(t, conn)
			})
		}
	}
}

// Outside systemd every call is a no-op.
func TestNoSocket(t *testing.T) {
	calls := map[string]func() error{
		"Ready":     sdnotify.Ready,
		"Stopping":  sdnotify.Stopping,
		"Reloading": sdnotify.Reloading,
		"Watchdog":  sdnotify.Watchdog,
		"Status":    func() error { return sdnotify.Status("x") },
	}
	// "-" is unset; systemd sets it to a non-empty path or nothing.
	for _, env := range []string{"-", ""} {
		for name, call := range calls {
			t.Run(strconv.Quote(env)+"/"+name, func(t *testing.T) {
				setOrUnset(t, "NOTIFY_SOCKET", env)
				if err := call(); err != nil {
					t.Errorf("%s() = %v, want nil", name, err)
				}
			})
		}
	}
}

func TestBadSocket(t *testing.T) {
	tests := []struct {
		name    string
		socket  string
		address bool // want ErrAddress
	}{
		{"relative path", "run/notify", true},
		{"vsock", "vsock:2:1234", true},
		{"missing file", "/nonexistent/egressd/notify", false},
		{"nobody listening on abstract", "@egressd-sdnotify-test-nobody", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Setenv("NOTIFY_SOCKET", tt.socket)
			err := sdnotify.Ready()
			if err == nil {
				t.Fatal("Ready() = nil, want an error")
			}
			if errors.Is(err, sdnotify.ErrAddress) != tt.address {
				t.Errorf("Ready() = %v; errors.Is(ErrAddress) = %v, want %v", err, !tt.address, tt.address)
			}
		})
	}
}

func TestWatchdogInterval(t *testing.T) {
	self := strconv.Itoa(os.Getpid())
	tests := []struct {
		name   string
		usec   string // "-" leaves WATCHDOG_USEC unset
		pid    string // "-" leaves WATCHDOG_PID unset
		want   time.Duration
		wantOK bool
	}{
		{"unset", "-", "-", 0, false},
		{"30s, no pid", "30000000", "-", 30 * time.Second, true},
		{"30s, our pid", "30000000", self, 30 * time.Second, true},
		{"1us", "1", self, time.Microsecond, true},
		{"another process's", "30000000", "1", 0, false},
		{"pid not a number", "30000000", "self", 0, false},
		{"zero", "0", self, 0, false},
		{"empty", "", self, 0, false},
		{"negative", "-5", self, 0, false},
		{"not a number", "30s", self, 0, false},
		{"overflows a Duration", "9223372036854776", self, 0, false},
		{"largest Duration", "9223372036854775", self, 9223372036854775 * time.Microsecond, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			setOrUnset(t, "WATCHDOG_USEC", tt.usec)
			setOrUnset(t, "WATCHDOG_PID", tt.pid)
			got, ok := sdnotify.WatchdogInterval()
			if got != tt.want || ok != tt.wantOK {
				t.Errorf("WatchdogInterval() = %v, %v; want %v, %v", got, ok, tt.want, tt.wantOK)
			}
		})
	}
}

// setOrUnset sets an environment variable for the test, or unsets it for
// "-"; either way t.Setenv restores it.
func setOrUnset(t *testing.T, key, value string) {
	t.Setenv(key, value)
	if value == "-" {
		os.Unsetenv(key)
	}
}
