package controlserver_test

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/egressd/egressd/internal/controlserver"
	"github.com/egressd/egressd/pkg/control"
)

// staleSocket leaves a socket file nobody listens on, as a killed daemon
// does.
func staleSocket(t *testing.T, path string) {
	t.Helper()
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	ln.SetUnlinkOnClose(false)
	ln.Close()
	if fi, err := os.Lstat(path); err != nil || fi.Mode().Type() != os.ModeSocket {
		t.Fatalf("stale socket not left behind: %v", err)
	}
}

func listen(t *testing.T, path string, opts *controlserver.ListenOptions) net.Listener {
	t.Helper()
	ln, err := controlserver.Listen(path, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	return ln
}

// dialOK checks that something accepts connections at path.
func dialOK(t *testing.T, ln net.Listener, path string) {
	t.Helper()
	accepted := make(chan error, 1)
	go func() {
		c, err := ln.Accept()
		if err == nil {
			c.Close()
		}
		accepted <- err
	}()
	c, err := net.DialTimeout("unix", path, time.Second)
	if err != nil {
		t.Fatalf("dial %s: %v", path, err)
	}
	c.Close()
	if err := <-accepted; err != nil {
		t.Fatalf("accept: %v", err)
	}
}

func TestListenDefaults(t *testing.T) {
	dir := sockDir(t)
	path := filepath.Join(dir, "sub", "egressd.sock")
	ln := listen(t, path, nil)
	if ln.Addr().String() != path {
		t.Errorf("Addr = %s, want %s", ln.Addr(), path)
	}
	fi, err := os.Lstat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Type() != os.ModeSocket || fi.Mode().Perm() != controlserver.DefaultMode {
		t.Errorf("socket mode %v, want socket 0660", fi.Mode())
	}
	entries, _ := os.ReadDir(filepath.Dir(path))
	if len(entries) != 2 || entries[0].Name() != "egressd.sock" || entries[1].Name() != "egressd.sock.lock" {
		t.Errorf("socket directory holds %v, want only the socket and its lock (no temporary left)", entries)
	}
	dialOK(t, ln, path)
	if err := ln.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(path); !os.IsNotExist(err) {
		t.Errorf("socket still there after Close: %v", err)
	}
}

func TestListenModeAndGroup(t *testing.T) {
	requireRoot(t)
	path := filepath.Join(sockDir(t), "egressd.sock")
	listen(t, path, &controlserver.ListenOptions{Mode: 0o600, Group: "4242"})
	fi, err := os.Lstat(path)
	if err != nil {
		t.Fatal(err)
	}
	if st := fi.Sys().(*syscall.Stat_t); fi.Mode().Perm() != 0o600 || st.Gid != 4242 {
		t.Errorf("mode %v gid %d, want 0600 gid 4242", fi.Mode().Perm(), st.Gid)
	}
}

func TestListenBadOptions(t *testing.T) {
	dir := sockDir(t)
	for _, opts := range []*controlserver.ListenOptions{
		{Mode: os.ModeSetuid | 0o660},
		{Group: "no-such-group-egressd-test"},
	} {
		if ln, err := controlserver.Listen(filepath.Join(dir, "x.sock"), opts); err == nil {
			ln.Close()
			t.Errorf("Listen(%+v) succeeded", opts)
		}
	}
}

func TestListenReplacesStaleSocket(t *testing.T) {
	path := filepath.Join(sockDir(t), "egressd.sock")
	staleSocket(t, path)
	ln := listen(t, path, nil)
	dialOK(t, ln, path)
}

func TestListenKeepsLiveSocket(t *testing.T) {
	path := filepath.Join(sockDir(t), "egressd.sock")
	first := listen(t, path, nil)
	before, err := os.Lstat(path)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := controlserver.Listen(path, nil)
	if err == nil {
		ln.Close()
		t.Fatal("second Listen on a live socket succeeded")
	}
	if want := "another egressd is listening on " + path; !strings.Contains(err.Error(), want) {
		t.Errorf("error %q, want it to say %q", err, want)
	}
	after, err := os.Lstat(path)
	if err != nil || !os.SameFile(before, after) {
		t.Fatalf("live socket was replaced or removed: %v", err)
	}
	dialOK(t, first, path)
}

func TestListenLeavesNonSocketAlone(t *testing.T) {
	path := filepath.Join(sockDir(t), "egressd.sock")
	if err := os.WriteFile(path, []byte("precious"), 0o644); err != nil {
		t.Fatal(err)
	}
	ln, err := controlserver.Listen(path, nil)
	if err == nil {
		ln.Close()
		t.Fatal("Listen over a regular file succeeded")
	}
	if !strings.Contains(err.Error(), "not a socket") {
		t.Errorf("error %q, want it to say not a socket", err)
	}
	if b, _ := os.ReadFile(path); string(b) != "precious" {
		t.Errorf("file changed to %q", b)
	}
}

// While a daemon listens, another cannot, even with the first's socket
// removed (an operator cleaning up): two daemons would fight over the
// datapath. Once the first closes, another can.
func TestSecondListenerRefused(t *testing.T) {
	path := filepath.Join(sockDir(t), "egressd.sock")
	old, err := controlserver.Listen(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	if ln, err := controlserver.Listen(path, nil); err == nil || !strings.Contains(err.Error(), "another egressd is listening") {
		if ln != nil {
			ln.Close()
		}
		t.Fatalf("a second Listen while the first listens: %v, want it refused", err)
	}
	if err := old.Close(); err != nil {
		t.Fatal(err)
	}
	successor := listen(t, path, nil)
	dialOK(t, successor, path)
}

// Daemons started at once over a stale socket: one listens, the others
// are refused; none removes the socket the one made.
func TestListenAtOnceOverStaleSocket(t *testing.T) {
	path := filepath.Join(sockDir(t), "egressd.sock")
	staleSocket(t, path)
	const n = 8
	lns := make(chan net.Listener, n)
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			if ln, err := controlserver.Listen(path, nil); err == nil {
				lns <- ln
			}
		})
	}
	wg.Wait()
	close(lns)
	var got []net.Listener
	for ln := range lns {
		got = append(got, ln)
		t.Cleanup(func() { ln.Close() })
	}
	if len(got) != 1 {
		t.Fatalf("%d of %d Listens at once succeeded, want 1", len(got), n)
	}
	dialOK(t, got[0], path)
}

func TestServerShutdownRemovesSocket(t *testing.T) {
	h := start(t, controlserver.Config{})
	if err := h.client.Get(context.Background(), "whoami", nil); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := h.srv.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(h.sock); !os.IsNotExist(err) {
		t.Errorf("socket still there after Shutdown: %v", err)
	}
	h.client.CloseIdleConnections()
	if err := h.client.Get(context.Background(), "whoami", nil); !control.IsNotRunning(err) {
		t.Errorf("after Shutdown: %v, want not running", err)
	}
}
