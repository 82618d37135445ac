package sdkhttp

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sync"

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
// why it stopped, why a hedge was held back, and the executor's error (a
// *sdk.StopError; nil on success). Err is set even when RoundTrip returned
// the last attempt's response, e.g. a 503 after the attempts ran out.
type Result struct {
	Attempts   []verdict.Attempt
	Stop       sdk.StopReason
	Suppressed verdict.Suppression
	Err        error
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

// retryLayer runs each request through the policy's executor: policy, with
// sdk.RunHedged, for requests that may be hedged when it has a Hedge; plain
// (the same without its Hedge), with sdk.Run, for the rest.
type retryLayer struct {
	policy, plain sdk.Policy
	next          http.RoundTripper
}

// Idempotent reports whether req may be sent more than once at the same
// time, which is what hedging does: a GET, HEAD or OPTIONS request, or one
// carrying an Idempotency-Key header (the IETF draft's promise that the
// server does the work once however many copies arrive).
func Idempotent(req *http.Request) bool {
	switch req.Method {
	case "", http.MethodGet, http.MethodHead, http.MethodOptions:
		return true
	}
	_, ok := req.Header["Idempotency-Key"]
	return ok
}

func (t *retryLayer) RoundTrip(req *http.Request) (*http.Response, error) {
	p := &t.plain
	if t.policy.Hedge != nil && Idempotent(req) {
		p = &t.policy
	}
	body, err := newReplay(req, max(p.MaxAttempts, 1))
	if err != nil {
		return nil, err
	}
	defer body.close()
	ex := &exchange{req: req, body: body, next: t.next, hedged: p.Hedge != nil}
	ctx := req.Context()
	if p.Admit != nil {
		ctx = context.WithValue(ctx, exchangeKey{}, ex) // for admitting
	}
	var won *http.Response
	if res := resultFrom(ctx); res != nil {
		try := sdk.Try[*http.Response]
		if ex.hedged {
			try = sdk.TryHedged[*http.Response]
		}
		r := try(ctx, p, ex.attempt)
		*res = Result{Attempts: r.Attempts, Stop: r.Stop, Suppressed: r.Suppressed, Err: r.Err}
		won, err = r.Value, r.Err
	} else if ex.hedged {
		won, err = sdk.RunHedged(ctx, p, ex.attempt)
	} else {
		won, err = sdk.Run(ctx, p, ex.attempt)
	}
	return ex.finish(won, err, req.Context().Err() == nil)
}

// newRetryLayer returns the Retry step for a copy of p.
func newRetryLayer(p sdk.Policy, next http.RoundTripper) *retryLayer {
	p.Classifier = Classifier(p.Classifier)
	if p.Admit != nil {
		p.Admit = admitting(p.Admit)
	}
	plain := p
	plain.Hedge = nil
	// Admit is the one place the executor numbers attempts and says which
	// are hedges: a hedged exchange needs both, and gets a hook even when
	// the policy has none.
	if p.Hedge != nil && p.Admit == nil {
		p.Admit = admitting(nil)
	}
	return &retryLayer{policy: p, plain: plain, next: next}
}

// admitting wraps admit (nil: admit everything) to tell the exchange of
// each attempt once admit has decided on it, whatever it decided.
func admitting(admit func(context.Context, sdk.NextAttempt) verdict.Verdict) func(context.Context, sdk.NextAttempt) verdict.Verdict {
	return func(ctx context.Context, next sdk.NextAttempt) verdict.Verdict {
		var v verdict.Verdict
		if admit != nil {
			v = admit(ctx, next)
		}
		if ex, ok := ctx.Value(exchangeKey{}).(*exchange); ok {
			ex.admitting(ctx, next)
		}
		return v
	}
}

type exchangeKey struct{}

// exchange is one request's attempts, which may run at the same time when
// the policy hedges.
type exchange struct {
	req    *http.Request
	body   *replay
	next   http.RoundTripper
	hedged bool // attempts may run side by side, and lose

	mu      sync.Mutex
	n       int                     // attempts made
	numbers map[context.Context]int // attempt numbers by attempt context, from Admit
	last    *http.Response          // the latest response an attempt returned, if any
	// resps is every response not yet handed over or discarded, with its
	// attempt's number (0 when there was no Admit to tell it).
	resps map[*http.Response]int
}

// admitting is told, by the Admit hook, of the attempt about to run on
// actx. A round's first attempt drops the responses of attempts numbered
// before it: their rounds are over, and none of them is the last any more.
// It drops nothing else: a hedge of its own round, numbered after it, may
// have answered already (the first attempt can reach Admit late), and
// that answer may yet win.
func (ex *exchange) admitting(actx context.Context, next sdk.NextAttempt) {
	var stale []*http.Response
	ex.mu.Lock()
	if ex.numbers == nil {
		ex.numbers = map[context.Context]int{}
	}
	ex.numbers[actx] = next.Number
	if !next.Hedge {
		for r, n := range ex.resps {
			if n < next.Number {
				stale = append(stale, r)
				delete(ex.resps, r)
			}
		}
		if _, ok := ex.resps[ex.last]; !ok {
			ex.last = nil
		}
	}
	ex.mu.Unlock()
	for _, r := range stale {
		discard(r)
	}
}

// attempt is the executor's callback: one exchange, on the attempt's
// context actx.
func (ex *exchange) attempt(actx context.Context) (*http.Response, error) {
	if !ex.hedged {
		ex.dropLast() // attempts run one after another: this one is a new round
	}

	// The request's context is the caller's with the attempt's deadline,
	// and cancelled with the attempt's when that is (a hedge that lost),
	// but not when the callback returns, which would cut off the body the
	// caller has yet to read.
	parent := ex.req.Context()
	var rctx context.Context
	var cancel context.CancelFunc
	if d, ok := actx.Deadline(); ok {
		rctx, cancel = context.WithDeadline(parent, d)
	} else {
		rctx, cancel = context.WithCancel(parent)
	}
	if ex.hedged {
		stop := context.AfterFunc(actx, func() {
			if actx.Err() == context.Canceled {
				cancel() // lost to a hedge: cut it short, body and all
			}
		})
		defer stop()
	}
	areq := ex.req.WithContext(rctx)
	ex.mu.Lock()
	ex.n++
	number := ex.numbers[actx] // an attempt context is reused only once its attempt is done
	err := ex.body.set(areq, ex.n)
	ex.mu.Unlock()
	if err != nil {
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
	ex.mu.Lock()
	if ex.resps == nil {
		ex.resps = map[*http.Response]int{}
	}
	ex.resps[resp] = number
	ex.last = resp
	ex.mu.Unlock()
	if resp.StatusCode < http.StatusBadRequest {
		return resp, nil
	}
	bufferBody(resp)
	return resp, &sdk.StatusError{Code: resp.StatusCode, RetryAfter: resp.Header.Get("Retry-After")}
}

// dropLast closes the latest response: a new attempt starts, so it is no
// longer the one to hand back.
func (ex *exchange) dropLast() {
	ex.mu.Lock()
	last := ex.last
	ex.last = nil
	delete(ex.resps, last)
	ex.mu.Unlock()
	discard(last)
}

// finish picks what RoundTrip returns once the executor is done: the
// winning response on success; on failure the latest response, if the
// caller is still there to read it, else the executor's error. Every other
// response - a hedge's that lost the race, an earlier attempt's - is
// drained and closed, which lets go of its connection and its permits.
func (ex *exchange) finish(won *http.Response, err error, callerWaits bool) (*http.Response, error) {
	ex.mu.Lock()
	keep := won
	if err != nil {
		keep = nil
		if callerWaits {
			keep = ex.last
		}
	}
	var rest []*http.Response
	for r := range ex.resps {
		if r != keep {
			rest = append(rest, r)
		}
	}
	ex.resps = nil
	ex.mu.Unlock()
	for _, r := range rest {
		discard(r)
	}
	if keep != nil {
		return keep, nil
	}
	return nil, err
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
