package serve_test

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"time"

	"github.com/egressd/egressd/pkg/limit"
	"github.com/egressd/egressd/pkg/partition"
	"github.com/egressd/egressd/pkg/sdk"
	"github.com/egressd/egressd/pkg/serve"
)

// Policies per route on the standard mux: each tenant may POST twice a
// minute; a refusal is 429 with Retry-After in whole seconds.
func Example() {
	m, err := serve.New(serve.Options{Policies: []serve.Policy{
		{Name: "status", Limiter: partition.Options{Local: &limit.Options{Concurrency: 100}}},
		{Name: "per-tenant", Partition: serve.ByHeader("X-Tenant"), Limiter: partition.Options{
			Local: &limit.Options{PerWindow: &limit.PerWindowOptions{Permits: 2, Window: time.Minute, Segments: 1}},
		}},
	}})
	if err != nil {
		fmt.Println(err)
		return
	}
	mux := http.NewServeMux()
	mux.Handle("GET /status", m.Handler("status", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "ok")
	})))
	mux.Handle("POST /work", m.Handler("per-tenant", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusAccepted)
	})))
	srv := httptest.NewServer(m.Edge(mux))
	defer srv.Close()

	for _, tenant := range []string{"acme", "acme", "acme", "globex"} {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/work", nil)
		req.Header.Set("X-Tenant", tenant)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			fmt.Println(err)
			return
		}
		resp.Body.Close()
		if ra := resp.Header.Get("Retry-After"); ra != "" {
			fmt.Println(tenant, resp.StatusCode, "Retry-After:", ra)
			continue
		}
		fmt.Println(tenant, resp.StatusCode)
	}
	// Output:
	// acme 202
	// acme 202
	// acme 429 Retry-After: 60
	// globex 202
}

// Edge puts the caller's criticality in the request's context, never above
// the ceiling, and ignores what it cannot read.
func ExampleMiddleware_Edge() {
	m, _ := serve.New(serve.Options{}) // default Critical, ceiling Critical
	srv := httptest.NewServer(m.Edge(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, sdk.CriticalityFrom(r.Context()).String())
	})))
	defer srv.Close()

	for _, sent := range []string{"", "Sheddable", "CriticalPlus", "urgent!"} {
		req, _ := http.NewRequest(http.MethodGet, srv.URL, nil)
		if sent != "" {
			req.Header.Set(sdk.CriticalityHeader, sent)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			fmt.Println(err)
			return
		}
		got, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		fmt.Printf("%q -> %s\n", sent, got)
	}
	// Output:
	// "" -> Critical
	// "Sheddable" -> Sheddable
	// "CriticalPlus" -> Critical
	// "urgent!" -> Critical
}

// A client is its address; an IPv6 client is its /64.
func ExampleByClientIP() {
	for _, addr := range []string{"192.0.2.7:51234", "[2001:db8:1:2:3:4:5:6]:443", "[::ffff:192.0.2.7]:80"} {
		fmt.Println(serve.ByClientIP(&http.Request{RemoteAddr: addr}))
	}
	// Output:
	// 192.0.2.7
	// 2001:db8:1:2::/64
	// 192.0.2.7
}

// Retry-After is whole seconds, rounded up: a client that waits as long as
// it is told does not come back early.
func ExampleFormatRetryAfter() {
	for _, d := range []time.Duration{0, 300 * time.Millisecond, time.Second, 7500 * time.Millisecond} {
		v, ok := serve.FormatRetryAfter(d)
		fmt.Printf("%v: %q %v\n", d, v, ok)
	}
	// Output:
	// 0s: "" false
	// 300ms: "1" true
	// 1s: "1" true
	// 7.5s: "8" true
}
