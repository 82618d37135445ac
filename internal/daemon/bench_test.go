package daemon

import (
	"context"
	"fmt"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/egressd/egressd/pkg/policy"
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

// BenchmarkKube10k changes the Kubernetes rules of a node of 100 pods
// under 100 limits that select them all (10,000 rules), one limit's
// concurrency each time, on the fake datapath: the daemon's own part of
// an EgressLimit edited, its rules saved for a restart included. The
// refresh a pod's cgroup appearing or going asks for, when no scope
// moved, is reported as refresh-ms.
func BenchmarkKube10k(b *testing.B) {
	td := newTestDaemon(b)
	ctx := context.Background()
	if err := td.table.install(ctx, parse(b, "rules: []\n"), time.Now()); err != nil {
		b.Fatal(err)
	}
	kubeOf := func(concurrency int) kubeRules {
		var k kubeRules
		for l := range 100 {
			limit := 10
			if l == 0 {
				limit = concurrency
			}
			r := parse(b, fmt.Sprintf("rules:\n  - {name: x, destination: 10.0.0.1, port: %d, concurrency: %d}\n", 1000+l, limit)).Rules[0]
			for p := range 100 {
				r.Name, r.Scope = fmt.Sprintf("k8s:ns/l%d/p%d", l, p), policy.Scope{Cgroup: fmt.Sprintf("/kubepods/pod%d", p)}
				k.rules, k.sources = append(k.rules, r), append(k.sources, fmt.Sprintf("k8s:ns/l%d", l))
			}
		}
		return k
	}
	k0, k1 := kubeOf(5), kubeOf(6)
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		k := k0
		if i%2 == 1 {
			k = k1
		}
		if _, err := td.table.setKube(ctx, k, time.Now()); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	t0 := time.Now()
	for range 10 {
		td.table.refresh(ctx, time.Now(), true)
	}
	b.ReportMetric(float64(time.Since(t0).Microseconds())/10/1000, "refresh-ms")
}
