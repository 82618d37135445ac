package sdkhttp

import (
	"net/http"
	"time"

	"github.com/egressd/egressd/pkg/sdk"
)

// Propagate makes the stack send, on every attempt, the caller's
// criticality (sdk.CriticalityHeader, when the request's context carries
// one: see sdk.LookupCriticality) and the time the attempt has left
// (sdk.TimeoutHeader, when its context has a deadline), so that a server
// behind package serve's middleware puts the same level and a deadline no
// later than the caller's into the context its handler runs with.
//
// It is off unless asked for, because the headers are for servers that
// read them: a third-party API has no use for this process's priorities or
// timeouts. Headers the request already has are left as they are.
//
// Unlike the other steps its place in the chain does not matter: it always
// runs innermost, next to the base transport, so that the time left is
// measured after any wait for a permit, when the request leaves.
func (s *Stack) Propagate() *Stack {
	s.propagate = true
	return s
}

// propagateLayer sets the edge headers on a copy of each request.
type propagateLayer struct {
	next http.RoundTripper
}

func (t *propagateLayer) RoundTrip(req *http.Request) (*http.Response, error) {
	ctx := req.Context()
	c, labelled := sdk.LookupCriticality(ctx)
	_, named := sdk.ParseCriticality(c.String()) // one of the four
	setC := labelled && named && !hasHeader(req.Header, sdk.CriticalityHeader)
	deadline, bounded := ctx.Deadline()
	setT := bounded && !hasHeader(req.Header, sdk.TimeoutHeader)
	if !setC && !setT {
		return t.next.RoundTrip(req)
	}
	// A RoundTripper must not change the caller's request, and the Retry
	// step's attempts share its header map: copy it.
	r := new(http.Request)
	*r = *req
	r.Header = req.Header.Clone()
	if r.Header == nil {
		r.Header = make(http.Header, 2)
	}
	if setC {
		r.Header.Set(sdk.CriticalityHeader, c.String())
	}
	if setT {
		r.Header.Set(sdk.TimeoutHeader, sdk.FormatTimeout(time.Until(deadline)))
	}
	return t.next.RoundTrip(r)
}

func hasHeader(h http.Header, name string) bool {
	_, ok := h[name] // name is canonical
	return ok
}
