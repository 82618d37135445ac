package sdkhttp

import (
	"context"
	"errors"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"testing/synctest"
	"time"

	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/pkg/limit"
	"github.com/egressd/egressd/pkg/sdk"
	"github.com/egressd/egressd/pkg/verdict"
)

const testHedgeDelay = 20 * time.Millisecond

// hedgePolicy hedges once, testHedgeDelay into an attempt.
func hedgePolicy(t *testing.T) *sdk.Policy {
	p := testPolicy(3)
	p.Hedge = newHedge(t, sdk.HedgeOptions{Delay: testHedgeDelay})
	return p
}

// newHedge is sdk.NewHedge for a test in a bubble. A hedge's watcher
// goroutine runs until it has looked twice and found no call, and a bubble
// ends only once every goroutine in it has: when the test ends, the
// bubble's clock is moved on for the watcher to stop.
func newHedge(t *testing.T, o sdk.HedgeOptions) *sdk.Hedge {
	t.Cleanup(func() { clocktest.Advance(time.Minute) })
	return sdk.NewHedge(o)
}

// hedgeAfter is hedgePolicy with its hedges held in Admit until first is
// closed: what the test waits for there (the first attempt reaching the
// server, taking a permit) happens before a hedge does anything, however
// late the loaded machine runs the first attempt.
func hedgeAfter(t *testing.T, first <-chan struct{}) *sdk.Policy {
	p := hedgePolicy(t)
	p.Admit = func(ctx context.Context, next sdk.NextAttempt) verdict.Verdict {
		if next.Hedge {
			select {
			case <-first:
			case <-ctx.Done():
			}
		}
		return verdict.Verdict{}
	}
	return p
}

// stall answers nothing until the request is cancelled, and counts the
// requests it saw cancelled.
func stall(cancelled *atomic.Int32) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		<-r.Context().Done()
		cancelled.Add(1)
	}
}

// The first request stalls; the hedge sent beside it answers, and the first
// is cancelled on the wire. Only idempotent requests are hedged.
func TestHedgedRequests(t *testing.T) {
	tests := []struct {
		name       string
		method     string
		header     string
		wantHedged bool
	}{
		{"GET", http.MethodGet, "", true},
		{"HEAD", http.MethodHead, "", true},
		{"OPTIONS", http.MethodOptions, "", true},
		{"POST with Idempotency-Key", http.MethodPost, "Idempotency-Key", true},
		{"PUT with Idempotency-Key", http.MethodPut, "Idempotency-Key", true},
		{"POST", http.MethodPost, "", false},
		{"DELETE", http.MethodDelete, "", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				var cancelled atomic.Int32
				reached := make(chan struct{})
				first := func(w http.ResponseWriter, r *http.Request) {
					close(reached)
					stall(&cancelled)(w, r)
				}
				srv := serve(t, first, okReply)
				c := build(t, NewStack(nil).Retry(hedgeAfter(t, reached)))
				// A request that is not hedged stalls until its deadline: a
				// short one. One that is returns when its hedge answers.
				timeout := 5 * testHedgeDelay
				if tt.wantHedged {
					timeout = time.Minute
				}
				ctx, cancel := context.WithTimeout(context.Background(), timeout)
				defer cancel()
				req := mustRequest(t, ctx, tt.method, srv.URL, strings.NewReader("payload"))
				if tt.header != "" {
					req.Header.Set(tt.header, "k1")
				}
				code, _, res, err := do(t, c, req)
				if !tt.wantHedged {
					// Never hedged: the stalled request runs into the caller's
					// deadline alone.
					if err == nil || srv.hits.Load() != 1 {
						t.Fatalf("%s: %d, %v after %d requests; want the deadline after one", tt.method, code, err, srv.hits.Load())
					}
					return
				}
				if err != nil || code != http.StatusOK {
					t.Fatalf("%s: %d, %v; want the hedge's 200", tt.method, code, err)
				}
				if got := kinds(res.Attempts); !slices.Equal(got, []string{"Permanent", "OK"}) || !res.Attempts[0].Lost() || !res.Attempts[1].Hedge() {
					t.Errorf("attempt log %v, want the first lost and the hedge OK", res.Attempts)
				}
				synctest.Wait()
				if cancelled.Load() != 1 {
					t.Errorf("%d requests cancelled at the server; want the first", cancelled.Load())
				}
				if got := srv.received(); tt.method != http.MethodHead && (len(got) != 2 || got[0] != "payload" || got[1] != "payload") {
					t.Errorf("server received bodies %q, want the payload twice", got)
				}
			})
		})
	}
}

// Both copies answer 200 at once: one wins, the other's response is drained
// and closed, and every permit the Limit step took is given back.
func TestLosingResponseIsClosed(t *testing.T) { synctest.Test(t, testLosingResponseIsClosed) }

func testLosingResponseIsClosed(t *testing.T) {
	second := make(chan struct{})
	var served atomic.Int32
	srv := serve(t,
		func(w http.ResponseWriter, r *http.Request) {
			<-second // answer together with the hedge
			served.Add(1)
			io.WriteString(w, "first")
		},
		func(w http.ResponseWriter, r *http.Request) {
			close(second)
			served.Add(1)
			io.WriteString(w, "second")
		},
	)
	bulkhead := newLimiter(t, limit.Options{Name: "pair", Concurrency: 2})
	c := build(t, NewStack(nil).Retry(hedgePolicy(t)).Limit(bulkhead))
	code, body, res, err := get(t, c, srv.URL)
	if err != nil || code != http.StatusOK || (body != "first" && body != "second") {
		t.Fatalf("GET: %d %q %v", code, body, err)
	}
	if len(res.Attempts) != 2 || !res.Attempts[1].Hedge() {
		t.Fatalf("attempt log %v, want the first attempt and a hedge", res.Attempts)
	}
	synctest.Wait()
	if served.Load() != 2 {
		t.Errorf("%d requests served; want both", served.Load())
	}
	// Both permits are free again: the winner's body was closed by get, the
	// loser's by the Retry step.
	if n := bulkhead.InFlight(); n != 0 {
		t.Errorf("%d permits held; want both given back", n)
	}
}

// The limiter inside the retry loop is asked per attempt: the hedge finds
// the bulkhead full (the first attempt holds it) and is refused, a
// self-imposed refusal in the log; the first attempt's answer is the call's.
func TestHedgeRefusedByTheLimiter(t *testing.T) { synctest.Test(t, testHedgeRefusedByTheLimiter) }

func testHedgeRefusedByTheLimiter(t *testing.T) {
	release := make(chan struct{})
	srv := serve(t, func(w http.ResponseWriter, r *http.Request) {
		<-release
		io.WriteString(w, "ok")
	})
	denied := &denials{counter: &counter{}, granted: make(chan struct{}), release: release}
	bulkhead := newLimiter(t, limit.Options{Name: "one", Concurrency: 1, Observer: denied})
	c := build(t, NewStack(nil).Retry(hedgeAfter(t, denied.granted)).Limit(bulkhead))
	code, _, res, err := get(t, c, srv.URL)
	if err != nil || code != http.StatusOK {
		t.Fatalf("GET: %d %v", code, err)
	}
	// The denial lets the server answer, which can happen before the
	// refused hedge has returned to its round: the first attempt then wins
	// first, and the hedge, answering after the winner, is logged as lost.
	got, a := kinds(res.Attempts), res.Attempts
	refused := slices.Equal(got, []string{"OK", "Throttled(self-imposed)"}) && !a[1].Lost()
	lostAfter := slices.Equal(got, []string{"OK", "Permanent"}) && a[1].Lost()
	if !refused && !lostAfter || !a[1].Hedge() {
		t.Errorf("attempt log %v, want the first OK and the hedge refused", a)
	}
	if srv.hits.Load() != 1 || denied.acquired.Load() != 1 || denied.denied.Load() != 1 {
		t.Errorf("server saw %d requests, limiter %d acquired, %d denied; want 1, 1, 1", srv.hits.Load(), denied.acquired.Load(), denied.denied.Load())
	}
}

// denials counts leases, says when the first was granted (the first
// attempt's), and lets the server answer once the limiter has refused one:
// the hedge's.
type denials struct {
	*counter
	granted, release chan struct{}
}

func (d *denials) OnLease(o limit.Outcome) {
	d.counter.OnLease(o)
	switch o {
	case limit.Acquired:
		close(d.granted)
	case limit.Denied:
		close(d.release)
	}
}

// roundTripFunc is a RoundTripper made of a function.
type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

func okResponse(r *http.Request, body string) *http.Response {
	return &http.Response{StatusCode: http.StatusOK, Header: http.Header{}, Body: io.NopCloser(strings.NewReader(body)), Request: r}
}

// bodyThrough sends a GET through a stack of Retry(p) on base, and reads
// the response's body.
func bodyThrough(t *testing.T, base http.RoundTripper, p *sdk.Policy) (string, error) {
	t.Helper()
	rt, err := NewStack(base).Retry(p).Build()
	if err != nil {
		t.Fatal(err)
	}
	resp, err := rt.RoundTrip(mustRequest(t, context.Background(), "GET", "http://example.test/", nil))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

// The first attempt answers while the hedge sent beside it is still in
// Admit: the hedge, which has lost, leaves the winner's body to the caller.
func TestLosingHedgeKeepsTheWinnersBody(t *testing.T) {
	synctest.Test(t, testLosingHedgeKeepsTheWinnersBody)
}

func testLosingHedgeKeepsTheWinnersBody(t *testing.T) {
	want := strings.Repeat("x", 100)
	answered := make(chan struct{})
	var sent atomic.Int32
	base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
		if sent.Add(1) == 1 {
			<-time.After(2 * testHedgeDelay) // until the hedge is in Admit
			close(answered)
			return okResponse(r, want), nil
		}
		<-r.Context().Done()
		return nil, r.Context().Err()
	})
	p := hedgePolicy(t)
	p.Admit = func(ctx context.Context, next sdk.NextAttempt) verdict.Verdict {
		if next.Hedge {
			<-answered // the winner is on its way back
			<-ctx.Done()
		}
		return verdict.Verdict{}
	}
	if got, err := bodyThrough(t, base, p); got != want || err != nil {
		t.Errorf("winner's body: %d bytes, %v; want %d bytes", len(got), err, len(want))
	}
}

// The first attempt leaves Admit only after the hedge sent beside it has
// answered (a slow lookup; a caller descheduled at the wrong moment): the
// first attempt of a round drops earlier rounds' responses, not those of
// its own hedges.
func TestLateFirstAttemptKeepsTheHedgesBody(t *testing.T) {
	synctest.Test(t, testLateFirstAttemptKeepsTheHedgesBody)
}

func testLateFirstAttemptKeepsTheHedgesBody(t *testing.T) {
	want := strings.Repeat("x", 100)
	hedgeAnswered := make(chan struct{})
	base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
		defer close(hedgeAnswered) // only the hedge gets here: the first attempt loses in Admit
		return okResponse(r, want), nil
	})
	p := hedgePolicy(t)
	p.Admit = func(ctx context.Context, next sdk.NextAttempt) verdict.Verdict {
		if !next.Hedge {
			<-hedgeAnswered
			<-ctx.Done() // the hedge won
		}
		return verdict.Verdict{}
	}
	if got, err := bodyThrough(t, base, p); got != want || err != nil {
		t.Errorf("hedge's body: %d bytes, %v; want %d bytes", len(got), err, len(want))
	}
}

// A hedged exchange's retry drops the previous round's response: when the
// last round gets no response, the caller gets the error, not a stale 503,
// and the 503's body is closed.
func TestHedgedRetryDropsTheEarlierResponse(t *testing.T) {
	synctest.Test(t, testHedgedRetryDropsTheEarlierResponse)
}

func testHedgedRetryDropsTheEarlierResponse(t *testing.T) {
	busy := &trackedBody{Reader: strings.NewReader("busy")}
	var sent atomic.Int32
	base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
		if sent.Add(1) == 1 {
			return &http.Response{StatusCode: http.StatusServiceUnavailable, Header: http.Header{}, Body: busy, Request: r}, nil
		}
		return nil, syscall.ECONNRESET
	})
	rt, err := NewStack(base).Retry(hedgePolicy(t)).Build()
	if err != nil {
		t.Fatal(err)
	}
	resp, err := rt.RoundTrip(mustRequest(t, context.Background(), "GET", "http://example.test/", nil))
	if resp != nil || !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("RoundTrip = %v, %v; want no response and the last attempt's error", resp, err)
	}
	if !busy.closed.Load() {
		t.Error("the first round's response was never closed")
	}
}

// Hedges that lose by scheduling alone, many calls side by side, with and
// without an Admit hook: every 200 reaches its caller with its body.
func TestLosingHedgesUnderLoadKeepTheWinnersBody(t *testing.T) {
	admitAll := func(context.Context, sdk.NextAttempt) verdict.Verdict { return verdict.Verdict{} }
	for name, admit := range map[string]func(context.Context, sdk.NextAttempt) verdict.Verdict{"no Admit": nil, "Admit": admitAll} {
		t.Run(name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				want := strings.Repeat("x", 100)
				base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
					clocktest.Latency(context.Background(), time.Millisecond) // the hedge delay: both race
					return okResponse(r, want), nil
				})
				p := testPolicy(3)
				p.Budget = nil // a hedge on every call
				p.Hedge = newHedge(t, sdk.HedgeOptions{Delay: time.Millisecond})
				p.Admit = admit
				rt, err := NewStack(base).Retry(p).Build()
				if err != nil {
					t.Fatal(err)
				}
				var bad, total atomic.Int32
				var wg sync.WaitGroup
				for range 32 {
					wg.Go(func() {
						for range 100 {
							req, _ := http.NewRequest("GET", "http://example.test/", nil)
							resp, err := rt.RoundTrip(req)
							if err != nil {
								t.Error(err)
								return
							}
							total.Add(1)
							if b, _ := io.ReadAll(resp.Body); string(b) != want {
								bad.Add(1)
							}
							resp.Body.Close()
						}
					})
				}
				wg.Wait()
				if bad.Load() > 0 {
					t.Errorf("%d of %d responses came back without their body", bad.Load(), total.Load())
				}
			})
		})
	}
}
