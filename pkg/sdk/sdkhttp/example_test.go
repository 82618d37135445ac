package sdkhttp_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sync/atomic"

	"github.com/egressd/egressd/pkg/limit"
	"github.com/egressd/egressd/pkg/sdk/sdkhttp"
)

// Retry outermost, the guards inside it: each attempt takes its own permit,
// and the Result in the request's context holds the attempt log.
func ExampleStack() {
	var calls atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if calls.Add(1) == 1 {
			w.Header().Set("Retry-After", "0") // shedding load: come back now
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		io.WriteString(w, "hello")
	}))
	defer srv.Close()

	rt, err := sdkhttp.NewStack(nil).
		Retry(sdkhttp.Defaults()).
		Quota(sdkhttp.QuotaOptions{}).
		Limit(limit.PerSecond(100)).
		Build()
	if err != nil {
		fmt.Println(err)
		return
	}
	client := &http.Client{Transport: rt}

	var res sdkhttp.Result
	req, _ := http.NewRequestWithContext(sdkhttp.WithResult(context.Background(), &res), http.MethodGet, srv.URL, nil)
	resp, err := client.Do(req)
	if err != nil {
		fmt.Println(err)
		return
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()

	fmt.Println(resp.StatusCode, string(body), res.Stop)
	for _, a := range res.Attempts {
		fmt.Println(a.Verdict())
	}
	// Output:
	// 200 hello success
	// Throttled(retry after 0s)
	// OK
}

// A limiter added before the retries would take one permit for a request
// that makes several attempts; Build refuses it.
func ExampleStack_Build() {
	_, err := sdkhttp.NewStack(nil).
		Limit(limit.PerSecond(100)).
		Retry(sdkhttp.Defaults()).
		Build()
	fmt.Println(err)
	// Output:
	// invalid http stack: Limit("perSecond") is outside Retry: steps run outermost first, so it would take one permit for a request that makes several attempts; add Retry first
}
