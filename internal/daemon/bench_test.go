package daemon

import (
	"context"
	"fmt"
	"strings"
	"testing"
)

// BenchmarkInstall100k installs a policy of 100,000 rules in which every
// rule changed since the last install, on the fake datapath: the daemon's
// own part of a start or a reload, after the parse and without the kernel.
func BenchmarkInstall100k(b *testing.B) {
	td := newTestDaemon(b)
	var pols [2]string
	for v := range pols {
		var s strings.Builder
		s.WriteString("rules:\n")
		for i := range 100_000 {
			fmt.Fprintf(&s, "  - {name: r%d, destination: 10.%d.%d.%d, port: %d, concurrency: %d}\n", i, i>>16&255, i>>8&255, i&255, 1+i%2000, 100+v)
		}
		pols[v] = s.String()
	}
	p0, p1 := parse(b, pols[0]), parse(b, pols[1])
	td.fake.maxRules = 1 << 20
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		p := p0
		if i%2 == 1 {
			p = p1
		}
		if err := td.install(context.Background(), p); err != nil {
			b.Fatal(err)
		}
	}
}
