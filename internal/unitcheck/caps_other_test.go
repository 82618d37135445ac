//go:build !linux

package unitcheck

// stages are Linux-only: there is no datapath elsewhere.
var stages = map[string]func(args []string) error{}
