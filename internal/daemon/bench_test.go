package daemon

import (
	"context"
	"strings"
	"testing"
)

// BenchmarkInstall100k installs a policy of 100,000 rules in which every
// rule changed since the last install, on the fake datapath: the daemon's
// own part of a start or a reload, after the parse and without the kernel.
func BenchmarkInstall100k(b *testing.B) {
	td := newTestDaemon(b)
	rules := manyRules(100_000, 0)
	p0, p1 := parse(b, rules), parse(b, strings.ReplaceAll(rules, "concurrency: 10}", "concurrency: 11}"))
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
