package policy

import (
	"fmt"
	"slices"
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

// BenchmarkReload100k is a Reader's read of the 100,000-rule policy after
// an edit that added a rule at its end, the reload tests/ measures: the
// reads alternate between the file with the rule and the file without.
func BenchmarkReload100k(b *testing.B) {
	data := manyRules(100_000)
	edited := append(slices.Clip(data), "  - {name: added, destination: 10.200.0.1, concurrency: 1}\n"...)
	var r Reader
	if _, err := r.Parse(data); err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(data)))
	for i := 0; b.Loop(); i++ {
		if _, err := r.Parse([][]byte{edited, data}[i%2]); err != nil {
			b.Fatal(err)
		}
	}
}
