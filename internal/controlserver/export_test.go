package controlserver

import "time"

// SetBodyTimeout shortens how long s waits for a request's body; call it
// before Serve.
func SetBodyTimeout(s *Server, d time.Duration) { s.bodyTimeout = d }

// SetWriteTimeout shortens how long one write of a response of s, to a
// stream or not, may wait for the peer; call it before Serve.
func SetWriteTimeout(s *Server, d time.Duration) { s.writeTimeout, s.hs.WriteTimeout = d, d }
