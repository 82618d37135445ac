package controlserver

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"slices"
	"strconv"
)

// Peer is the process at the other end of a control connection, as the
// kernel reported it when the peer connected.
type Peer struct {
	PID    int32    // 0 when the peer's pid namespace is not visible to the daemon
	UID    uint32   // effective uid
	GID    uint32   // effective gid
	Groups []uint32 // supplementary groups; nil when they could not be read
}

func (p Peer) String() string {
	return fmt.Sprintf("pid %d uid %d gid %d", p.PID, p.UID, p.GID)
}

//go:generate go tool stringer -type=Access -linecomment

// Access is what a peer may do.
type Access uint8

const (
	// AccessNone: nothing; the peer's credentials could not be read.
	AccessNone Access = iota // none
	// AccessRead: routes whose Write is false.
	AccessRead // read
	// AccessWrite: every route.
	AccessWrite // write
)

// accessPolicy is the input of permit besides the peer.
type accessPolicy struct {
	self     uint32 // the daemon's effective uid
	group    uint32 // members may write, if hasGroup
	hasGroup bool
}

// permit decides what a peer may do. Root, the daemon's own uid and members
// of the configured group (primary or supplementary) write; anyone else who
// got a connection reads. See the package documentation for why.
func permit(p Peer, pol accessPolicy) Access {
	switch {
	case p.UID == 0, p.UID == pol.self:
		return AccessWrite
	case pol.hasGroup && (p.GID == pol.group || slices.Contains(p.Groups, pol.group)):
		return AccessWrite
	}
	return AccessRead
}

type peerKey struct{}

type accessKey struct{}

// peerInfo is what a connection's context carries: the peer, or why there is
// none.
type peerInfo struct {
	peer Peer
	err  error
}

// WithPeer returns a context that carries p as the caller, for testing
// handlers through Server.ServeHTTP without a socket. The server sets it
// from the connection's credentials; nothing a client sends can.
func WithPeer(ctx context.Context, p Peer) context.Context {
	return context.WithValue(ctx, peerKey{}, &peerInfo{peer: p})
}

func withPeerError(ctx context.Context, err error) context.Context {
	return context.WithValue(ctx, peerKey{}, &peerInfo{err: err})
}

func peerInfoFrom(ctx context.Context) *peerInfo {
	pi, _ := ctx.Value(peerKey{}).(*peerInfo)
	return pi
}

// PeerFrom returns the process that sent the request whose context this is.
func PeerFrom(ctx context.Context) (Peer, bool) {
	pi := peerInfoFrom(ctx)
	if pi == nil || pi.err != nil {
		return Peer{}, false
	}
	return pi.peer, true
}

// AccessFrom returns what the caller of the request may do.
func AccessFrom(ctx context.Context) Access {
	a, _ := ctx.Value(accessKey{}).(Access)
	return a
}

// parseStatusGroups reads the supplementary groups from the text of
// /proc/PID/status ("Groups:\t4 24 27 \n").
func parseStatusGroups(status []byte) ([]uint32, error) {
	sc := bufio.NewScanner(bytes.NewReader(status))
	for sc.Scan() {
		rest, ok := bytes.CutPrefix(sc.Bytes(), []byte("Groups:"))
		if !ok {
			continue
		}
		fields := bytes.Fields(rest)
		groups := make([]uint32, 0, len(fields))
		for _, f := range fields {
			g, err := strconv.ParseUint(string(f), 10, 32)
			if err != nil {
				return nil, fmt.Errorf("groups: bad gid %q", f)
			}
			groups = append(groups, uint32(g))
		}
		return groups, nil
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	return nil, fmt.Errorf("groups: no Groups line")
}
