module github.com/egressd/egressd/bench/sdkcompare

go 1.26.8

require (
	github.com/egressd/egressd v0.0.0
	github.com/failsafe-go/failsafe-go v0.9.8
	golang.org/x/time v0.16.0
)

require (
	github.com/bits-and-blooms/bitset v1.24.4 // indirect
	golang.org/x/sys v0.50.0 // indirect
)

replace github.com/egressd/egressd => ../..
