//go:build !unix

package sdnotify

// monotonicUsec is unavailable where there is no systemd to read it.
func monotonicUsec() (uint64, bool) { return 0, false }
