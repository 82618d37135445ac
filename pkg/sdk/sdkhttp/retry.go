package sdkhttp

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"

	"github.com/egressd/egressd/pkg/sdk"
	"github.com/egressd/egressd/pkg/verdict"
)

// MaxBufferedBody is the longest request body without GetBody that the
// Retry step reads into memory to replay; a longer one is refused with
// ErrBodyNotReplayable.
const MaxBufferedBody = 1 << 20

// ErrBodyNotReplayable is returned, before anything is sent, for a request
// that may be retried and whose body can be neither re-made (no GetBody)
// nor buffered (longer than MaxBufferedBody).
var ErrBodyNotReplayable = errors.New("request body cannot be replayed")

// Result is what the Retry step knows about one request: the attempt log,
// why it stopped, and the executor's error (a *sdk.StopError; nil on
// success). Err is set even when RoundTrip returned the last attempt's
// response, e.g. a 503 after the attempts ran out.
type Result struct {
	Attempts []verdict.Attempt
	Stop     sdk.StopReason
	Err      error
}

type resultKey struct{}

// WithResult returns a context that has the Retry step fill r for the
// request it is given to. Use one Result per request. A stack without
// Retry leaves r alone.
func WithResult(ctx context.Context, r *Result) context.Context {
	return context.WithValue(ctx, resultKey{}, r)
}

func resultFrom(ctx context.Context) *Result {
	r, _ := ctx.Value(resultKey{}).(*Result)
	return r
}

// retryLayer runs each request through the policy's executor.
type retryLayer struct {
	policy sdk.Policy
	next   http.RoundTripper
}

func (t *retryLayer) RoundTrip(req *http.Request) (*http.Response, error) {
	body, err := newReplay(req, max(t.policy.MaxAttempts, 1))
	if err != nil {
		return nil, err
	}
	defer body.close()
	ex := &exchange{req: req, body: body, next: t.next}
	ctx := req.Context()
	if t.policy.Admit != nil {
		ctx = context.WithValue(ctx, exchangeKey{}, ex) // for admitting
	}
	if res := resultFrom(ctx); res != nil {
		r := sdk.Try(ctx, &t.policy, ex.attempt)
		*res = Result{Attempts: r.Attempts, Stop: r.Stop, Err: r.Err}
		err = r.Err
	} else {
		_, err = sdk.Run(ctx, &t.policy, ex.attempt)
	}
	if ex.last != nil && (err == nil || req.Context().Err() == nil) {
		return ex.last, nil
	}
	discard(ex.last) // the caller gave up: it gets its context's error
	return nil, err
}

// newRetryLayer returns the Retry step for a copy of p.
func newRetryLayer(p sdk.Policy, next http.RoundTripper) *retryLayer {
	p.Classifier = Classifier(p.Classifier)
	if admit := p.Admit; admit != nil {
		p.Admit = func(ctx context.Context, next sdk.NextAttempt) verdict.Verdict {
			// A new attempt starts here, whether or not admit lets it
			// through: the previous one's response is no longer the last.
			if ex, ok := ctx.Value(exchangeKey{}).(*exchange); ok {
				ex.dropLast()
			}
			return admit(ctx, next)
		}
	}
	return &retryLayer{policy: p, next: next}
}

type exchangeKey struct{}

// exchange is one request's attempts.
type exchange struct {
	req  *http.Request
	body *replay
	next http.RoundTripper
	n    int            // attempts made
	last *http.Response // the latest attempt's response, if it got one
}

// attempt is the executor's callback: one exchange, on the attempt's
// context actx.
func (ex *exchange) attempt(actx context.Context) (*http.Response, error) {
	ex.dropLast()
	ex.n++

	// The request's context is the caller's with the attempt's deadline,
	// not actx itself: the executor cancels actx when the callback returns,
	// which would cut off the body the caller has yet to read.
	parent := ex.req.Context()
	var rctx context.Context
	var cancel context.CancelFunc
	if d, ok := actx.Deadline(); ok {
		rctx, cancel = context.WithDeadline(parent, d)
	} else {
		rctx, cancel = context.WithCancel(parent)
	}
	areq := ex.req.WithContext(rctx)
	if err := ex.body.set(areq, ex.n); err != nil {
		cancel()
		return nil, err
	}

	resp, err := ex.next.RoundTrip(areq)
	if err != nil {
		if rctx.Err() != nil {
			// rctx ends with actx (same deadline, same parent): let the
			// executor see its own attempt timeout, not a race with it.
			<-actx.Done()
		}
		cancel()
		return nil, err
	}
	wrapResponse(resp, cancel, noLease)
	ex.last = resp
	if resp.StatusCode < http.StatusBadRequest {
		return resp, nil
	}
	bufferBody(resp)
	return resp, &sdk.StatusError{Code: resp.StatusCode, RetryAfter: resp.Header.Get("Retry-After")}
}

// dropLast closes the previous attempt's response.
func (ex *exchange) dropLast() {
	discard(ex.last)
	ex.last = nil
}

// replay hands each attempt its own copy of the request body.
type replay struct {
	orig     io.ReadCloser // the request's Body; nil when it has none
	handed   bool          // orig was given to an attempt
	get      func() (io.ReadCloser, error)
	buf      []byte
	buffered bool
}

// newReplay prepares req's body for up to maxAttempts attempts.
func newReplay(req *http.Request, maxAttempts int) (*replay, error) {
	if req.Body == nil || req.Body == http.NoBody {
		return &replay{}, nil
	}
	r := &replay{orig: req.Body, get: req.GetBody}
	if r.get != nil || maxAttempts == 1 {
		return r, nil
	}
	defer req.Body.Close()
	if req.ContentLength > MaxBufferedBody {
		return nil, fmt.Errorf("%w: %d bytes without GetBody (at most %d are buffered)", ErrBodyNotReplayable, req.ContentLength, MaxBufferedBody)
	}
	buf, err := io.ReadAll(io.LimitReader(req.Body, MaxBufferedBody+1))
	if err != nil {
		return nil, fmt.Errorf("read request body: %w", err)
	}
	if len(buf) > MaxBufferedBody {
		return nil, fmt.Errorf("%w: more than %d bytes without GetBody", ErrBodyNotReplayable, MaxBufferedBody)
	}
	r.buf, r.buffered = buf, true
	return r, nil
}

// set gives areq, attempt n's request, its body.
func (r *replay) set(areq *http.Request, n int) error {
	switch {
	case r.orig == nil:
		return nil
	case r.buffered:
		areq.Body = io.NopCloser(bytes.NewReader(r.buf))
		areq.ContentLength = int64(len(r.buf))
		areq.GetBody = r.copy
		return nil
	case !r.handed:
		r.handed = true
		areq.Body = r.orig
		return nil
	case r.get == nil: // not reached: newReplay buffers when it may retry
		return fmt.Errorf("attempt %d: %w", n, ErrBodyNotReplayable)
	}
	rc, err := r.get()
	if err != nil {
		return fmt.Errorf("request body for attempt %d: %w", n, err)
	}
	areq.Body = rc
	return nil
}

func (r *replay) copy() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(r.buf)), nil }

// close closes the request's own body if no attempt was given it (an Admit
// hook or the breaker stopped the call first): the RoundTripper owns it.
func (r *replay) close() {
	if r.orig != nil && !r.handed && !r.buffered {
		r.orig.Close()
	}
}
