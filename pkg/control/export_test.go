package control

import "time"

// SetBodyTimeout shortens how long s waits for a request's body; call it
// before Serve.
func SetBodyTimeout(s *Server, d time.Duration) { s.bodyTimeout = d }
