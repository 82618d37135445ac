package sdkquic_test

import (
	"fmt"
	"io"
	"net/http"

	"github.com/quic-go/quic-go/http3"

	"github.com/egressd/egressd/pkg/sdk"
	"github.com/egressd/egressd/pkg/sdk/sdkhttp"
	"github.com/egressd/egressd/pkg/sdk/sdkquic"
)

// An HTTP/3 client behind the SDK's executor: a request egressd refuses
// (its QUIC flow's first datagram fails with EPERM) is retried as a
// self-imposed refusal naming the rule, without spending the retry budget
// or tripping the breaker.
func Example_http3() {
	tr := &http3.Transport{Dial: sdkquic.DialEarly}
	defer tr.Close()
	rt, err := sdkhttp.NewStack(tr).Retry(sdkhttp.Defaults()).Build()
	if err != nil {
		panic(err)
	}
	client := &http.Client{Transport: rt}
	resp, err := client.Get("https://payments.internal/v1/health")
	if rl, ok := sdk.AsRateLimited(err); ok {
		fmt.Println("refused by egressd rule", rl.Limiter)
		return
	}
	if err != nil {
		fmt.Println(err)
		return
	}
	defer resp.Body.Close()
	io.Copy(io.Discard, resp.Body)
}
