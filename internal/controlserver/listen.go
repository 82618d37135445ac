package controlserver

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/egressd/egressd/pkg/control"
)

// DefaultMode is the socket's mode unless told otherwise; its path is
// control.DefaultSocket.
const DefaultMode fs.FileMode = 0o660

// ListenOptions says how the socket is created. Nil means defaults.
type ListenOptions struct {
	// Mode is the socket's permission bits; 0 means DefaultMode. Connecting
	// needs write permission on the socket.
	Mode fs.FileMode
	// Group, a name or a numeric gid, becomes the socket's group. Empty
	// leaves the creator's group.
	Group string
}

// Listen creates the control socket at path (control.DefaultSocket if empty) and
// returns its listener. Closing the listener removes the socket, unless
// another process has replaced it since.
//
// A socket already at path is tested by dialling it: if something answers,
// Listen fails with "another egressd is listening on PATH" and leaves it
// alone; if the dial is refused the socket is stale (its daemon died) and is
// replaced. Anything at path that is not a socket is never removed.
//
// The socket is bound under a temporary name, given its mode and group, and
// only then hard-linked to path, so it is never reachable with the wrong
// permissions and never replaces a socket that appeared meanwhile. A missing
// parent directory is created with mode 0755.
func Listen(path string, opts *ListenOptions) (net.Listener, error) {
	if path == "" {
		path = control.DefaultSocket
	}
	var o ListenOptions
	if opts != nil {
		o = *opts
	}
	if o.Mode == 0 {
		o.Mode = DefaultMode
	}
	if o.Mode&^fs.ModePerm != 0 {
		return nil, fmt.Errorf("listen %s: mode %v has more than permission bits", path, o.Mode)
	}
	gid := -1
	if o.Group != "" {
		g, err := lookupGroup(o.Group)
		if err != nil {
			return nil, fmt.Errorf("listen %s: %w", path, err)
		}
		gid = int(g)
	}

	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("listen %s: %w", path, err)
	}
	lock, err := lockSocket(path)
	if err != nil {
		return nil, err
	}
	if err := clearStale(path); err != nil {
		lock.Close()
		return nil, err
	}
	tmp := filepath.Join(dir, "."+filepath.Base(path)+"."+randomSuffix())
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: tmp, Net: "unix"})
	if err != nil {
		lock.Close()
		return nil, fmt.Errorf("listen %s: %w", path, err)
	}
	ln.SetUnlinkOnClose(false) // the temporary name goes below; path is ours to manage
	err = os.Chmod(tmp, o.Mode)
	if err == nil && gid >= 0 {
		err = os.Chown(tmp, -1, gid)
	}
	if err == nil {
		err = os.Link(tmp, path)
		if errors.Is(err, fs.ErrExist) {
			err = fmt.Errorf("another egressd is listening on %s (it appeared while this one started)", path)
		}
	}
	os.Remove(tmp)
	var fi fs.FileInfo
	if err == nil {
		fi, err = os.Lstat(path)
	}
	if err != nil {
		ln.Close()
		lock.Close()
		return nil, fmt.Errorf("listen %s: %w", path, err)
	}
	return &listener{UnixListener: ln, path: path, file: fi, lock: lock}, nil
}

// lockSocket takes the lock beside the socket at path (PATH.lock, kept:
// removing it would let two daemons hold two files) for as long as the
// listener lives. Two daemons that start at once and both find a stale
// socket would otherwise both take it for stale, and the second remove
// the first's new socket; the kernel drops the lock of a daemon that
// dies, so a stale socket's lock is free.
func lockSocket(path string) (*os.File, error) {
	f, err := os.OpenFile(path+".lock", os.O_RDWR|os.O_CREATE|syscall.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("listen %s: %w", path, err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, fmt.Errorf("another egressd is listening on %s (it holds %s.lock)", path, path)
		}
		return nil, fmt.Errorf("listen %s: lock: %w", path, err)
	}
	return f, nil
}

// clearStale removes a dead socket at path and refuses to touch a live one
// or anything that is not a socket.
func clearStale(path string) error {
	fi, err := os.Lstat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("listen %s: %w", path, err)
	}
	if fi.Mode().Type() != fs.ModeSocket {
		return fmt.Errorf("listen %s: exists and is not a socket; not removing it", path)
	}
	c, err := net.DialTimeout("unix", path, time.Second)
	switch {
	case err == nil:
		c.Close()
		return fmt.Errorf("another egressd is listening on %s", path)
	case errors.Is(err, syscall.ECONNREFUSED):
		// Nobody is bound to it: the daemon that made it is gone.
	case errors.Is(err, syscall.ENOENT):
		return nil // removed meanwhile
	default:
		// EAGAIN (a full backlog) or a timeout is a live daemon that is
		// busy; anything else is not ours to judge. Leave it.
		return fmt.Errorf("another egressd may be listening on %s: %w", path, err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove stale socket %s: %w", path, err)
	}
	return nil
}

// lookupGroup resolves a group name or numeric gid.
func lookupGroup(s string) (uint32, error) {
	if g, err := strconv.ParseUint(s, 10, 32); err == nil {
		return uint32(g), nil
	}
	g, err := user.LookupGroup(s)
	if err != nil {
		return 0, fmt.Errorf("group %q: %w", s, err)
	}
	gid, err := strconv.ParseUint(g.Gid, 10, 32)
	if err != nil {
		return 0, fmt.Errorf("group %q: gid %q: %w", s, g.Gid, err)
	}
	return uint32(gid), nil
}

func randomSuffix() string {
	b := make([]byte, 6)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// listener removes its socket on Close if the socket is still the one it
// created.
type listener struct {
	*net.UnixListener
	path string
	file fs.FileInfo
	lock *os.File // see lockSocket

	once sync.Once
	err  error
}

// Addr is the socket's path (the bound name was temporary).
func (l *listener) Addr() net.Addr { return &net.UnixAddr{Name: l.path, Net: "unix"} }

// Close unlinks the socket, then closes it: unlinking first means a new
// daemon never sees our socket refuse connections and never has its own
// socket removed by us.
func (l *listener) Close() error {
	l.once.Do(func() {
		if fi, err := os.Lstat(l.path); err == nil && os.SameFile(fi, l.file) {
			os.Remove(l.path)
		}
		l.err = l.UnixListener.Close()
		l.lock.Close()
	})
	return l.err
}
