//go:build race

package hugeheap

// The race detector's shadow of the heap faults in pages of its own.
const raceEnabled = true
