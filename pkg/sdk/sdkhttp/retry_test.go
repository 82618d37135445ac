package sdkhttp

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"testing/synctest"
	"time"

	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/pkg/control"
	"github.com/egressd/egressd/pkg/limit"
	"github.com/egressd/egressd/pkg/sdk"
	"github.com/egressd/egressd/pkg/verdict"
)

// A server that fails twice and then answers costs three permits: one per
// attempt, each released before the next attempt asks for its own.
func TestOnePermitPerAttempt(t *testing.T) {
	tests := []struct {
		name string
		opts limit.Options
	}{
		{"concurrency", limit.Options{Concurrency: 1}},
		{"per second", limit.Options{PerSecond: &limit.PerSecondOptions{Permits: 100}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				var count counter
				tt.opts.Observer = &count
				l := newLimiter(t, tt.opts)
				var maxHeld atomic.Int64
				held := func(w http.ResponseWriter, r *http.Request) {
					maxHeld.Store(max(maxHeld.Load(), int64(l.InFlight())))
				}
				srv := serve(t,
					func(w http.ResponseWriter, r *http.Request) { held(w, r); reply(503, "busy")(w, r) },
					func(w http.ResponseWriter, r *http.Request) { held(w, r); reply(500, "oops")(w, r) },
					func(w http.ResponseWriter, r *http.Request) { held(w, r); okReply(w, r) },
				)
				c := build(t, NewStack(nil).Retry(testPolicy(3)).Limit(l))

				code, body, res, err := get(t, c, srv.URL)
				if err != nil || code != 200 || body != "ok" {
					t.Fatalf("GET = %d %q, %v", code, body, err)
				}
				if got, want := kinds(res.Attempts), []string{"Transient", "Transient", "OK"}; !slices.Equal(got, want) || res.Stop != sdk.StopSuccess {
					t.Errorf("attempts %v, stop %v; want %v, success", got, res.Stop, want)
				}
				if n := count.acquired.Load(); n != 3 || srv.hits.Load() != 3 || count.denied.Load() != 0 {
					t.Errorf("%d permits acquired, %d denied, for %d requests; want 3, 0, 3", n, count.denied.Load(), srv.hits.Load())
				}
				if maxHeld.Load() > 1 || l.InFlight() != 0 {
					t.Errorf("held at most %d permits during the call, %d after; want 1 and 0", maxHeld.Load(), l.InFlight())
				}
			})
		})
	}
}

// A retried request sends the same body every time: from GetBody when the
// request has one, from memory when it is short enough to buffer.
func TestBodyReplay(t *testing.T) {
	const payload = `{"amount": 42}`
	tests := []struct {
		name string
		req  func(t *testing.T, url string) *http.Request
	}{
		{"GetBody", func(t *testing.T, url string) *http.Request {
			return mustRequest(t, context.Background(), http.MethodPost, url, strings.NewReader(payload))
		}},
		{"buffered", func(t *testing.T, url string) *http.Request {
			req := mustRequest(t, context.Background(), http.MethodPost, url, nil)
			req.Body, req.GetBody, req.ContentLength = io.NopCloser(strings.NewReader(payload)), nil, -1
			return req
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				srv := serve(t, reply(503, ""), reply(502, ""), okReply)
				c := build(t, NewStack(nil).Retry(testPolicy(3)))
				code, _, _, err := do(t, c, tt.req(t, srv.URL))
				if err != nil || code != 200 {
					t.Fatalf("POST = %d, %v", code, err)
				}
				if got := srv.received(); !slices.Equal(got, []string{payload, payload, payload}) {
					t.Errorf("server received %q, want the payload three times", got)
				}
			})
		})
	}
}

// A body that can be neither re-made nor buffered is refused before
// anything is sent - unless the policy makes one attempt, which needs no
// replay - and the request's body is closed either way.
func TestLongBodyWithoutGetBody(t *testing.T) {
	long := strings.Repeat("x", MaxBufferedBody+1)
	tests := []struct {
		name     string
		attempts int
		length   int64
		wantErr  bool
		wantHits int32
	}{
		{"known length, retried", 3, int64(len(long)), true, 0},
		{"unknown length, retried", 3, -1, true, 0},
		{"one attempt", 1, -1, false, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				srv := serve(t, okReply)
				c := build(t, NewStack(nil).Retry(testPolicy(tt.attempts)))
				body := &trackedBody{Reader: strings.NewReader(long)}
				req := mustRequest(t, context.Background(), http.MethodPut, srv.URL, nil)
				req.Body, req.ContentLength = body, tt.length
				_, _, _, err := do(t, c, req)
				if errors.Is(err, ErrBodyNotReplayable) != tt.wantErr || srv.hits.Load() != tt.wantHits {
					t.Errorf("err %v, %d requests reached the server; want ErrBodyNotReplayable %v, %d", err, srv.hits.Load(), tt.wantErr, tt.wantHits)
				}
				if !body.closed.Load() {
					t.Error("request body left open")
				}
			})
		})
	}
}

// A request no attempt sends - every attempt refused by Admit - still has
// its body closed: the RoundTripper owns it.
func TestUnsentBodyIsClosed(t *testing.T) { synctest.Test(t, testUnsentBodyIsClosed) }

func testUnsentBodyIsClosed(t *testing.T) {
	srv := serve(t, okReply)
	p := testPolicy(2)
	p.Admit = func(context.Context, sdk.NextAttempt) verdict.Verdict { return verdict.Refused(0) }
	c := build(t, NewStack(nil).Retry(p))
	body := &trackedBody{Reader: strings.NewReader("payload")}
	req := mustRequest(t, context.Background(), http.MethodPost, srv.URL, nil)
	req.Body = body
	req.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(strings.NewReader("payload")), nil }
	if _, _, _, err := do(t, c, req); !errors.Is(err, sdk.ErrNotAdmitted) {
		t.Fatalf("err %v, want not admitted", err)
	}
	if !body.closed.Load() || srv.hits.Load() != 0 {
		t.Errorf("body closed %v, %d requests sent; want true, 0", body.closed.Load(), srv.hits.Load())
	}
}

// When the last attempt is one Admit refused, the call ends with that
// refusal, not with an earlier attempt's response, which is closed.
func TestAdmitRefusingTheLastAttempt(t *testing.T) { synctest.Test(t, testAdmitRefusingTheLastAttempt) }

func testAdmitRefusingTheLastAttempt(t *testing.T) {
	srv := serve(t, reply(503, "busy"))
	p := testPolicy(2)
	p.Admit = func(_ context.Context, next sdk.NextAttempt) verdict.Verdict {
		if next.Number == 2 {
			return verdict.Refused(0)
		}
		return verdict.Verdict{}
	}
	l := limit.Concurrency(1)
	c := build(t, NewStack(nil).Retry(p).Limit(l))
	_, _, res, err := get(t, c, srv.URL)
	if !errors.Is(err, sdk.ErrNotAdmitted) || !slices.Equal(kinds(res.Attempts), []string{"Transient", "Throttled(self-imposed)"}) {
		t.Errorf("err %v, attempts %v; want the refusal of attempt 2", err, kinds(res.Attempts))
	}
	if l.InFlight() != 0 {
		t.Errorf("%d permits held", l.InFlight())
	}
}

// Status codes become verdicts; a Retry-After is the hint, and the hint
// wins over the curve (capped by MaxDelay).
func TestStatusVerdictsAndRetryAfter(t *testing.T) {
	// An HTTP-date an hour from when the server answers, on the bubble's
	// clock: whole seconds, as the format is, and no time passes between
	// the answer and its reading.
	inAnHour := func(w http.ResponseWriter, r *http.Request) {
		reply(503, "", "Retry-After", time.Now().Add(time.Hour).UTC().Format(http.TimeFormat))(w, r)
	}
	tests := []struct {
		name      string
		first     http.HandlerFunc
		wantKind  verdict.Kind
		wantHint  time.Duration // -1: none
		tolerance time.Duration
		wantDelay time.Duration
	}{
		{"429 takes the throttled curve", reply(429, ""), verdict.Throttled, -1, 0, throttledDelay},
		{"429 Retry-After 0 beats the curve", reply(429, "", "Retry-After", "0"), verdict.Throttled, 0, 0, 0},
		{"429 Retry-After 1 capped by MaxDelay", reply(429, "", "Retry-After", "1"), verdict.Throttled, time.Second, 0, maxDelay},
		{"503 Retry-After is throttled", reply(503, "", "Retry-After", "0"), verdict.Throttled, 0, 0, 0},
		{"503 Retry-After HTTP-date", inAnHour, verdict.Throttled, time.Hour, 0, maxDelay},
		{"503 alone is transient", reply(503, ""), verdict.Transient, -1, 0, transientDelay},
		{"500 is transient", reply(500, ""), verdict.Transient, -1, 0, transientDelay},
		{"500 Retry-After is its hint", reply(500, "", "Retry-After", "0"), verdict.Transient, 0, 0, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				srv := serve(t, tt.first, okReply)
				c := build(t, NewStack(nil).Retry(testPolicy(2)))
				code, _, res, err := get(t, c, srv.URL)
				if err != nil || code != 200 || len(res.Attempts) != 2 {
					t.Fatalf("GET = %d, %v after %d attempts", code, err, len(res.Attempts))
				}
				first := res.Attempts[0]
				v := first.Verdict()
				hint, has := v.RetryAfter()
				if !has {
					hint = -1
				}
				if v.Kind() != tt.wantKind || v.SelfImposed() || (hint-tt.wantHint).Abs() > tt.tolerance || first.Delay() != tt.wantDelay {
					t.Errorf("first attempt %v then %v; want %v, hint %v, delay %v", v, first.Delay(), tt.wantKind, tt.wantHint, tt.wantDelay)
				}
			})
		})
	}
}

// Whatever the verdicts, the caller gets the last attempt's response - the
// status and the whole body, however long - and the Result says why the
// executor stopped.
func TestLastResponseIsReturned(t *testing.T) {
	long := strings.Repeat("b", 3*maxErrorBody)
	tests := []struct {
		name     string
		reply    http.HandlerFunc
		wantCode int
		wantBody string
		wantStop sdk.StopReason
		wantErr  error
		wantHits int32
	}{
		{"attempts exhausted", reply(503, "busy"), 503, "busy", sdk.StopAttemptsExhausted, sdk.ErrAttemptsExhausted, 3},
		{"long body", reply(502, long), 502, long, sdk.StopAttemptsExhausted, sdk.ErrAttemptsExhausted, 3},
		{"permanent", reply(404, "nope"), 404, "nope", sdk.StopPermanent, nil, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				srv := serve(t, tt.reply)
				c := build(t, NewStack(nil).Retry(testPolicy(3)))
				code, body, res, err := get(t, c, srv.URL)
				if err != nil || code != tt.wantCode || body != tt.wantBody {
					t.Fatalf("GET = %d, %d bytes, %v; want %d, %d bytes", code, len(body), err, tt.wantCode, len(tt.wantBody))
				}
				se, isStop := sdk.AsStop(res.Err)
				if res.Stop != tt.wantStop || !isStop || (tt.wantErr != nil && !errors.Is(res.Err, tt.wantErr)) || srv.hits.Load() != tt.wantHits {
					t.Errorf("stop %v, err %v, %d requests; want %v, %v, %d", res.Stop, res.Err, srv.hits.Load(), tt.wantStop, tt.wantErr, tt.wantHits)
				}
				var status *sdk.StatusError
				if !errors.As(se, &status) || status.Code != tt.wantCode {
					t.Errorf("stop error %v does not carry status %d", se, tt.wantCode)
				}
			})
		})
	}
}

// A failed response's body is read and closed inside its attempt, so its
// permit is free during the backoff; a body too long to read into memory
// is closed when the next attempt starts, before that attempt asks for its
// permit. Either way a bulkhead of one lets every attempt through.
func TestFailedResponsesFreeTheirPermit(t *testing.T) {
	synctest.Test(t, testFailedResponsesFreeTheirPermit)
}

func testFailedResponsesFreeTheirPermit(t *testing.T) {
	long := strings.Repeat("b", 2*maxErrorBody)
	l := limit.Concurrency(1)
	// Each failure is followed by a 150ms backoff; look 50ms into it.
	heldDuringBackoff := make(chan int, 2)
	look := func() {
		time.AfterFunc(50*time.Millisecond, func() { heldDuringBackoff <- l.InFlight() })
	}
	srv := serve(t,
		// Look from when the handler starts: on the tests' network a long
		// body is written only as the client reads it.
		func(w http.ResponseWriter, r *http.Request) { look(); reply(503, "short")(w, r) },
		func(w http.ResponseWriter, r *http.Request) { look(); reply(503, long)(w, r) },
		okReply,
	)
	p := testPolicy(3)
	p.Backoff = sdk.Backoff{Transient: sdk.Curve{Initial: 150 * time.Millisecond}}
	c := build(t, NewStack(nil).Retry(p).Limit(l))
	code, _, res, err := get(t, c, srv.URL)
	if err != nil || code != 200 || srv.hits.Load() != 3 {
		t.Fatalf("GET = %d, %v after %d requests (%v)", code, err, srv.hits.Load(), kinds(res.Attempts))
	}
	if got := []int{<-heldDuringBackoff, <-heldDuringBackoff}; !slices.Equal(got, []int{0, 1}) {
		t.Errorf("permits held during the backoff after a short and a long failed body: %v, want [0 1]", got)
	}
	if l.InFlight() != 0 {
		t.Errorf("%d permits held after the body was closed", l.InFlight())
	}
}

// However the caller finishes with a response, or the attempt fails without
// one, the permit comes back: nothing leaks.
func TestLeasesReleased(t *testing.T) {
	tests := []struct {
		name   string
		dead   bool // the server is closed: connection refused
		finish func(resp *http.Response)
	}{
		{"read and closed", false, func(r *http.Response) { io.ReadAll(r.Body); r.Body.Close() }},
		{"closed unread", false, func(r *http.Response) { r.Body.Close() }},
		{"read to the end, never closed", false, func(r *http.Response) { io.ReadAll(r.Body) }},
		{"transport error", true, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				srv := serve(t, okReply)
				if tt.dead {
					srv.Close()
				}
				l := limit.Concurrency(2)
				c := build(t, NewStack(nil).Retry(testPolicy(2)).Limit(l))
				resp, err := c.Get(srv.URL)
				if (err == nil) != (tt.finish != nil) {
					t.Fatalf("GET: %v", err)
				}
				if err == nil {
					tt.finish(resp)
				}
				if n := l.InFlight(); n != 0 {
					t.Errorf("%d permits held", n)
				}
			})
		})
	}
}

// Many callers at once through a small bulkhead: some are refused, some
// retried, and when all are done no permit is held.
func TestConcurrentCallersLeakNothing(t *testing.T) {
	synctest.Test(t, testConcurrentCallersLeakNothing)
}

func testConcurrentCallersLeakNothing(t *testing.T) {
	srv := serve(t, func(w http.ResponseWriter, r *http.Request) {
		clocktest.Latency(r.Context(), time.Millisecond)
		okReply(w, r)
	})
	l := limit.Concurrency(3)
	c := build(t, NewStack(nil).Retry(testPolicy(5)).Limit(l))
	done := make(chan error)
	for range 20 {
		go func() {
			resp, err := c.Get(srv.URL)
			if err == nil {
				io.ReadAll(resp.Body)
				resp.Body.Close()
			} else if !sdk.IsRateLimited(err) {
				done <- err
				return
			}
			done <- nil
		}()
	}
	for range 20 {
		if err := <-done; err != nil {
			t.Error(err)
		}
	}
	if l.InFlight() != 0 {
		t.Errorf("%d permits held after every caller finished", l.InFlight())
	}
}

// A limiter's refusal never reaches the dependency: every attempt is a
// self-imposed refusal, retried at the limiter's hint, and the call ends
// with the limiter's *sdk.RateLimitedError.
func TestLimiterRefusal(t *testing.T) { synctest.Test(t, testLimiterRefusal) }

func testLimiterRefusal(t *testing.T) {
	srv := serve(t, okReply)
	l := newLimiter(t, limit.Options{Name: "payments", Concurrency: 1})
	held, _ := l.Acquire(context.Background())
	t.Cleanup(held.Release)
	p := testPolicy(3)
	p.Budget = sdk.NewRetryBudget(0.1, 10)
	tokens := p.Budget.Tokens()
	c := build(t, NewStack(nil).Retry(p).Limit(l))

	_, _, res, err := get(t, c, srv.URL)
	rl, isRL := sdk.AsRateLimited(err)
	if !isRL || rl.Limiter != "payments" || !errors.Is(err, sdk.ErrAttemptsExhausted) {
		t.Fatalf("err %v, want the limiter's refusal after the attempts ran out", err)
	}
	if got := kinds(res.Attempts); !slices.Equal(got, []string{"Throttled(self-imposed)", "Throttled(self-imposed)", "Throttled(self-imposed)"}) {
		t.Errorf("attempts %v", got)
	}
	if srv.hits.Load() != 0 || p.Budget.Tokens() != tokens {
		t.Errorf("%d requests sent, budget %v -> %v; want none and untouched", srv.hits.Load(), tokens, p.Budget.Tokens())
	}
}

// Cancelling the caller's context ends the call, during an attempt or
// during the backoff after one, and frees the attempt's permit.
func TestCancellation(t *testing.T) {
	tests := []struct {
		name    string
		handler http.HandlerFunc
		curve   time.Duration // the backoff a cancellation must cut short
	}{
		{"during an attempt", func(w http.ResponseWriter, r *http.Request) { <-r.Context().Done() }, 0},
		{"during the backoff", reply(503, ""), time.Minute},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				arrived := make(chan struct{}, 10)
				srv := serve(t, func(w http.ResponseWriter, r *http.Request) {
					arrived <- struct{}{}
					tt.handler(w, r)
				})
				l := limit.Concurrency(1)
				p := testPolicy(3)
				p.Backoff = sdk.Backoff{Transient: sdk.Curve{Initial: tt.curve}}
				c := build(t, NewStack(nil).Retry(p).Limit(l))
				ctx, cancel := context.WithCancel(context.Background())
				go func() {
					<-arrived
					time.AfterFunc(10*time.Millisecond, cancel)
				}()
				start := time.Now()
				_, _, res, err := do(t, c, mustRequest(t, ctx, http.MethodGet, srv.URL, nil))
				if !errors.Is(err, context.Canceled) || res.Stop != sdk.StopCancelled {
					t.Errorf("err %v, stop %v; want cancelled", err, res.Stop)
				}
				if took := time.Since(start); took != 10*time.Millisecond {
					t.Errorf("took %v to notice the cancellation; want the 10ms until it", took)
				}
				if srv.hits.Load() != 1 || l.InFlight() != 0 {
					t.Errorf("%d requests, %d permits held; want 1, 0", srv.hits.Load(), l.InFlight())
				}
			})
		})
	}
}

// The attempt timeout bounds an attempt that hangs, which is Transient and
// retried; and the body of an attempt that answered in time is not cut off
// when the executor ends the attempt.
func TestAttemptTimeout(t *testing.T) { synctest.Test(t, testAttemptTimeout) }

func testAttemptTimeout(t *testing.T) {
	srv := serve(t,
		func(w http.ResponseWriter, r *http.Request) {
			select {
			case <-r.Context().Done():
			case <-time.After(5 * time.Second):
			}
		},
		func(w http.ResponseWriter, r *http.Request) {
			io.WriteString(w, "hello, ")
			w.(http.Flusher).Flush()
			clocktest.Latency(r.Context(), 30*time.Millisecond) // after RoundTrip has returned
			io.WriteString(w, "world")
		},
	)
	p := testPolicy(2)
	p.AttemptTimeout = time.Second / 4
	c := build(t, NewStack(nil).Retry(p))
	code, body, res, err := get(t, c, srv.URL)
	if err != nil || code != 200 || body != "hello, world" {
		t.Fatalf("GET = %d %q, %v", code, body, err)
	}
	if got := kinds(res.Attempts); !slices.Equal(got, []string{"Transient", "OK"}) {
		t.Errorf("attempts %v, want a timed-out attempt then OK", got)
	}
}

// The attempt's deadline goes on bounding the body after RoundTrip
// returns, as http.Client.Timeout does.
func TestAttemptDeadlineBoundsTheBody(t *testing.T) {
	synctest.Test(t, testAttemptDeadlineBoundsTheBody)
}

func testAttemptDeadlineBoundsTheBody(t *testing.T) {
	srv := serve(t, func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "hello, ")
		w.(http.Flusher).Flush()
		select {
		case <-r.Context().Done():
		case <-time.After(5 * time.Second):
		}
	})
	p := testPolicy(1)
	p.AttemptTimeout = 50 * time.Millisecond
	c := build(t, NewStack(nil).Retry(p))
	resp, err := c.Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if _, err := io.ReadAll(resp.Body); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("reading a body that hangs past the attempt's deadline: %v, want a deadline error", err)
	}
}

// An EPERM from the transport's dial is put to the attributor: the daemon's
// refusal is a self-imposed one, retried and named after the rule; without
// a daemon to claim it, it is Permanent.
func TestKernelRefusalAttributed(t *testing.T) {
	refusingDial := &http.Transport{DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
		return nil, eperm()
	}}
	daemonSays := func(ctx context.Context, err error) (*sdk.RateLimitedError, bool) {
		return &sdk.RateLimitedError{Limiter: "web", RetryAfter: time.Millisecond}, true
	}
	noDaemon := testPolicy(3)
	noDaemon.Classifier = Defaults().Classifier.WithAttributor(sdk.DaemonAttributor(&control.Client{Socket: t.TempDir() + "/none.sock"}))
	attributed := testPolicy(3)
	attributed.Classifier = sdk.DefaultClassifier().WithAttributor(daemonSays)

	tests := []struct {
		name      string
		policy    *sdk.Policy
		wantKinds []string
		wantRule  string
	}{
		{"the daemon refused it", attributed, []string{"Throttled(self-imposed)", "Throttled(self-imposed)", "Throttled(self-imposed)"}, "web"},
		{"nobody claims it", noDaemon, []string{"Permanent"}, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := build(t, NewStack(refusingDial).Retry(tt.policy))
			_, _, res, err := get(t, c, "http://127.0.0.1:9/")
			rl, _ := sdk.AsRateLimited(err)
			rule := ""
			if rl != nil {
				rule = rl.Limiter
			}
			if got := kinds(res.Attempts); !slices.Equal(got, tt.wantKinds) || rule != tt.wantRule || !errors.Is(err, syscall.EPERM) {
				t.Errorf("attempts %v, rule %q, err %v; want %v, %q, an EPERM", got, rule, err, tt.wantKinds, tt.wantRule)
			}
		})
	}
}

// Without a Retry step a Result is left alone and a refusal reaches the
// caller as the limiter's error.
func TestLimitWithoutRetry(t *testing.T) { synctest.Test(t, testLimitWithoutRetry) }

func testLimitWithoutRetry(t *testing.T) {
	srv := serve(t, okReply)
	l := limit.Concurrency(1)
	held, _ := l.Acquire(context.Background())
	c := build(t, NewStack(nil).Limit(l))
	_, _, res, err := get(t, c, srv.URL)
	if !sdk.IsRateLimited(err) || len(res.Attempts) != 0 || srv.hits.Load() != 0 {
		t.Errorf("err %v, %d attempts logged, %d sent; want a refusal, none, none", err, len(res.Attempts), srv.hits.Load())
	}
	held.Release()
	if code, _, _, err := get(t, c, srv.URL); err != nil || code != 200 || l.InFlight() != 0 {
		t.Errorf("after release: %d, %v, %d held", code, err, l.InFlight())
	}
}
