package controlserver

import (
	"context"
	"net"
	"time"
)

// SetBodyTimeout shortens how long s waits for a request's body; call it
// before Serve.
func SetBodyTimeout(s *Server, d time.Duration) { s.bodyTimeout = d }

// SetWriteTimeout shortens how long one write of a response of s, to a
// stream or not, may wait for the peer; call it before Serve.
func SetWriteTimeout(s *Server, d time.Duration) { s.writeTimeout, s.hs.WriteTimeout = d, d }

// ServeAs is Serve with p the peer of every connection, for a listener
// whose connections carry no credentials: an in-memory one, which a
// synctest bubble needs (a goroutine blocked on a unix socket keeps the
// bubble's clock still).
func ServeAs(s *Server, ln net.Listener, p Peer) error {
	s.hs.ConnContext = func(ctx context.Context, _ net.Conn) context.Context { return WithPeer(ctx, p) }
	return s.Serve(ln)
}
