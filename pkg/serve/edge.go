package serve

import (
	"context"
	"net/http"
	"time"

	"github.com/egressd/egressd/pkg/edge"
)

// edgeKey marks a request context whose edge headers were read, so that a
// request through Edge and a policy, or through two policies, is read once.
type edgeKey struct{}

func noop() {}

// edge reads r's edge headers into its context: the criticality, always
// (the header's, within the ceiling, or the default), and a deadline no
// later than the one it has, when the timeout header gives one. It removes
// both headers from r, so that a handler forwarding the request (a reverse
// proxy) does not pass the caller's claims on unchecked; a client stack
// with sdkhttp's Propagate sends what the context now holds. Call the
// returned cancel when the request is done.
func (m *Middleware) edge(r *http.Request) (*http.Request, context.CancelFunc) {
	ctx := r.Context()
	if ctx.Value(edgeKey{}) != nil {
		return r, noop
	}
	c, cres := m.crit.Level(r.Header.Values(edge.CriticalityHeader))
	ctx = edge.WithCriticality(ctx, c)
	deadline, bounded := ctx.Deadline()
	d, tres := Timeout(r.Header.Values(edge.TimeoutHeader), time.Now(), deadline, bounded)
	cancel := context.CancelFunc(noop)
	if tres == HeaderAccepted {
		ctx, cancel = context.WithTimeout(ctx, d)
	}
	ctx = context.WithValue(ctx, edgeKey{}, true)
	r.Header.Del(edge.CriticalityHeader)
	r.Header.Del(edge.TimeoutHeader)
	if m.obs != nil {
		m.obs.OnHeader(HeaderCriticality, cres)
		m.obs.OnHeader(HeaderTimeout, tres)
	}
	return r.WithContext(ctx), cancel
}

// Level decides a request's criticality from its header's values: missing
// or malformed (sent more than once, or not one of the four names) is the
// default; a level above the ceiling is the ceiling. Other servers of the
// edge headers (package servegrpc's, from metadata) decide by it too.
func (o CriticalityOptions) Level(values []string) (edge.Criticality, HeaderResult) {
	switch len(values) {
	case 0:
		return o.Default, HeaderMissing
	case 1:
	default:
		return o.Default, HeaderMalformed
	}
	c, ok := edge.ParseCriticality(values[0])
	switch {
	case !ok:
		return o.Default, HeaderMalformed
	case c > o.Ceiling:
		return o.Ceiling, HeaderCapped
	}
	return c, HeaderAccepted
}

// Timeout decides, at now, what a request's timeout header's values ask
// for: HeaderAccepted with the time to apply, or another result with
// nothing to apply - missing, malformed (sent more than once, or not whole
// milliseconds), or capped (no sooner than the deadline the request has).
func Timeout(values []string, now, deadline time.Time, bounded bool) (time.Duration, HeaderResult) {
	switch len(values) {
	case 0:
		return 0, HeaderMissing
	case 1:
	default:
		return 0, HeaderMalformed
	}
	d, ok := edge.ParseTimeout(values[0])
	switch {
	case !ok:
		return 0, HeaderMalformed
	case bounded && !now.Add(d).Before(deadline):
		return 0, HeaderCapped
	}
	return d, HeaderAccepted
}
