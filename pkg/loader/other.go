//go:build !linux

package loader

// Config is unused off Linux; the datapath needs a Linux kernel.
type Config struct{}

// Datapath is unavailable off Linux.
type Datapath struct{}

// Open fails off Linux.
func Open(*Config) (*Datapath, error) { return nil, ErrNotSupported }
