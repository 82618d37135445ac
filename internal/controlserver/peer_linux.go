//go:build linux

package controlserver

import (
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"unsafe"

	"golang.org/x/sys/unix"
)

// peerOf reads the credentials of the process at the other end of a unix
// stream connection. Anything else has no trustworthy peer: the kernel
// answers SO_PEERCRED on a TCP socket with the overflow uid, which must not
// pass for a user.
func peerOf(c net.Conn) (Peer, error) {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return Peer{}, fmt.Errorf("peer credentials: %T is not a unix socket connection", c)
	}
	raw, err := uc.SyscallConn()
	if err != nil {
		return Peer{}, fmt.Errorf("peer credentials: %w", err)
	}
	var (
		cred      *unix.Ucred
		credErr   error
		groups    []uint32
		groupsErr error
	)
	err = raw.Control(func(fd uintptr) {
		cred, credErr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
		if credErr == nil {
			groups, groupsErr = peerGroups(int(fd))
		}
	})
	if err == nil {
		err = credErr
	}
	if err != nil {
		return Peer{}, fmt.Errorf("peer credentials: %w", err)
	}
	p := Peer{PID: cred.Pid, UID: cred.Uid, GID: cred.Gid, Groups: groups}
	if groupsErr != nil && p.PID > 0 {
		// Kernels before 4.13 have no SO_PEERGROUPS. /proc describes the
		// process now rather than at connect, which is the best left.
		if status, err := os.ReadFile("/proc/" + strconv.Itoa(int(p.PID)) + "/status"); err == nil {
			p.Groups, _ = parseStatusGroups(status)
		}
	}
	return p, nil
}

// peerGroups reads SO_PEERGROUPS: the peer's supplementary groups as they
// were at connect. x/sys has no helper for it (GetsockoptString stops at the
// first zero byte), so this is the raw call.
func peerGroups(fd int) ([]uint32, error) {
	buf := make([]uint32, 32)
	for {
		size := uint32(len(buf) * 4)
		_, _, errno := unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(fd), unix.SOL_SOCKET, unix.SO_PEERGROUPS,
			uintptr(unsafe.Pointer(&buf[0])), uintptr(unsafe.Pointer(&size)), 0)
		switch {
		case errno == unix.ERANGE && int(size/4) > len(buf):
			buf = make([]uint32, size/4) // size is what it needs
			continue
		case errno != 0:
			return nil, errno
		case size%4 != 0 || int(size/4) > len(buf):
			return nil, errors.New("SO_PEERGROUPS: bad length " + strconv.Itoa(int(size)))
		}
		return buf[: size/4 : size/4], nil
	}
}
