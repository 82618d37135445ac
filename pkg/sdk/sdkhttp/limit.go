package sdkhttp

import (
	"net/http"

	"github.com/egressd/egressd/pkg/limit"
)

var noLease limit.Lease

// limitLayer takes one permit per attempt, on the attempt's context, and
// holds it until the response body is done with.
type limitLayer struct {
	limiter limit.Limiter
	next    http.RoundTripper
}

func (t *limitLayer) RoundTrip(req *http.Request) (*http.Response, error) {
	lease, err := t.limiter.Acquire(req.Context())
	if err != nil {
		closeRequestBody(req)
		return nil, err
	}
	resp, err := t.next.RoundTrip(req)
	if err != nil {
		lease.Release()
		return nil, err
	}
	wrapResponse(resp, nil, lease)
	return resp, nil
}
