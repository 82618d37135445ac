package control

import "time"

// SetBodyTimeout shortens how long s waits for a request's body; call it
// before Serve.
func SetBodyTimeout(s *Server, d time.Duration) { s.bodyTimeout = d }

// SetStreamWriteTimeout shortens how long one write to a stream of s may
// take; call it before Serve.
func SetStreamWriteTimeout(s *Server, d time.Duration) { s.streamWriteTimeout = d }
