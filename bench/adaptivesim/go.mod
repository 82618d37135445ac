module github.com/egressd/egressd/bench/adaptivesim

go 1.26.8

require (
	github.com/egressd/egressd v0.0.0
	github.com/failsafe-go/failsafe-go v0.9.8
)

require (
	github.com/bits-and-blooms/bitset v1.24.4 // indirect
	github.com/google/go-cmp v0.7.0 // indirect
	github.com/influxdata/tdigest v0.0.1 // indirect
)

replace github.com/egressd/egressd => ../..
