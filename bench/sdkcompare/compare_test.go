package main

import "testing"

// BenchmarkPerSecond prints each pair side by side:
//
//	go test -bench . -benchmem
func BenchmarkPerSecond(b *testing.B) {
	for _, p := range pairs {
		b.Run(p.name+"/limit", p.limit)
		b.Run(p.name+"/x-time-rate", p.rate)
	}
}
