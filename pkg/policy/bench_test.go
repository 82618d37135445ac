package policy

import (
	"fmt"
	"strings"
	"testing"
)

// manyRules is a policy of n concurrency rules to 10.0.0.0/8 addresses,
// mixed ports, written as tests/scale_bench_test.go writes it.
func manyRules(n int) []byte {
	var b strings.Builder
	b.WriteString("rules:\n")
	for i := range n {
		fmt.Fprintf(&b, "  - {name: r%d, destination: 10.%d.%d.%d, port: %d, concurrency: 100}\n", i, i>>16&255, i>>8&255, i&255, 1+i%2000)
	}
	return []byte(b.String())
}

// BenchmarkParse100k is the parse alone of the 100,000-rule policy whose
// start to enforcement tests/ measures.
func BenchmarkParse100k(b *testing.B) {
	data := manyRules(100_000)
	b.SetBytes(int64(len(data)))
	for b.Loop() {
		if _, err := Parse(data); err != nil {
			b.Fatal(err)
		}
	}
}
