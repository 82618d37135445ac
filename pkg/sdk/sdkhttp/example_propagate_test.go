package sdkhttp_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"time"

	"github.com/egressd/egressd/pkg/sdk"
	"github.com/egressd/egressd/pkg/sdk/sdkhttp"
)

// Propagate sends the caller's criticality and the time the attempt has
// left, for a server behind package serve's middleware to read.
func ExampleStack_Propagate() {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		left, _ := sdk.ParseTimeout(r.Header.Get(sdk.TimeoutHeader))
		fmt.Println(r.Header.Get(sdk.CriticalityHeader), left > 0 && left <= 2*time.Second)
	}))
	defer srv.Close()

	p := sdkhttp.Defaults()
	p.AttemptTimeout = 2 * time.Second // each attempt says it has at most 2s
	rt, err := sdkhttp.NewStack(nil).Retry(p).Propagate().Build()
	if err != nil {
		fmt.Println(err)
		return
	}
	client := &http.Client{Transport: rt}

	ctx := sdk.WithCriticality(context.Background(), sdk.Sheddable)
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL, nil)
	resp, err := client.Do(req)
	if err != nil {
		fmt.Println(err)
		return
	}
	resp.Body.Close()
	// Output:
	// Sheddable true
}
