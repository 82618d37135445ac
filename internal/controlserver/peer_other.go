//go:build !linux

package controlserver

import (
	"errors"
	"net"
)

// peerOf has no implementation outside Linux: every request is refused
// there. The client side of the package works everywhere.
func peerOf(net.Conn) (Peer, error) {
	return Peer{}, errors.New("peer credentials: only supported on Linux")
}
