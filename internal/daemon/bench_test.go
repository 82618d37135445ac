package daemon

import (
	"context"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
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
		if err := td.table.install(context.Background(), p, time.Now()); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkScrape100k scrapes the metrics of 100,000 rules on the fake
// datapath with the default bound: the daemon's own part of a scrape,
// without the kernel's reads. Each scrape is written out as Prometheus
// would receive it.
func BenchmarkScrape100k(b *testing.B) {
	td := newTestDaemon(b)
	td.fake.maxRules = 1 << 20
	if err := td.table.install(context.Background(), parse(b, manyRules(100_000, 0)), time.Now()); err != nil {
		b.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(td.metrics)
	h := promhttp.HandlerFor(reg, promhttp.HandlerOpts{})
	b.ReportAllocs()
	var size int
	for b.Loop() {
		w := httptest.NewRecorder()
		h.ServeHTTP(w, httptest.NewRequest("GET", "/metrics", nil))
		size = w.Body.Len()
	}
	b.ReportMetric(float64(size)/1e6, "MB")
}
