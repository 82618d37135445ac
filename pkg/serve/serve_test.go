package serve_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/internal/redistest"
	"github.com/egressd/egressd/pkg/limit"
	"github.com/egressd/egressd/pkg/partition"
	"github.com/egressd/egressd/pkg/sdk"
	"github.com/egressd/egressd/pkg/sdk/sdkhttp"
	"github.com/egressd/egressd/pkg/serve"
	"github.com/egressd/egressd/pkg/shared"
	"github.com/egressd/egressd/pkg/verdict"
)

func TestValidate(t *testing.T) {
	local := partition.Options{Local: &limit.Options{Concurrency: 1}}
	client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}) // never dialled
	t.Cleanup(func() { client.Close() })
	tests := []struct {
		name string
		opts serve.Options
		want []string // substrings, one per problem, in order
	}{
		{"zero", serve.Options{}, nil},
		{"names", serve.Options{Policies: []serve.Policy{{Limiter: local}, {Name: "a", Limiter: local}, {Name: "a", Limiter: local}}},
			[]string{"policy 0 has no Name", `policy "a" is defined more than once`}},
		{"limiters", serve.Options{Policies: []serve.Policy{
			{Name: "none"},
			{Name: "bad", Limiter: partition.Options{Local: &limit.Options{PerSecond: &limit.PerSecondOptions{Permits: 0}}, IdleTimeout: -1}},
			{Name: "no client", Limiter: partition.Options{Shared: &shared.Options{Concurrency: &shared.ConcurrencyOptions{Permits: 1}}}},
		}}, []string{
			`policy "none": Limiter.no limiter`,
			`policy "bad": Limiter.Local.PerSecond.Permits 0`,
			`policy "bad": Limiter.IdleTimeout -1ns`,
			// The empty Shared.Key is filled in with DefaultKeyPrefix + Name.
			`policy "no client": Limiter.Redis is required with Shared`,
		}},
		{"criticality", serve.Options{Criticality: serve.CriticalityOptions{Default: 3, Ceiling: -3}},
			[]string{"Criticality.Default Criticality(3) is none of", "Criticality.Ceiling Criticality(-3) is none of"}},
		{"default above ceiling", serve.Options{Criticality: serve.CriticalityOptions{Default: sdk.CriticalPlus}},
			[]string{"Criticality.Default CriticalPlus is above Criticality.Ceiling Critical"}},
		{"valid", serve.Options{
			Policies: []serve.Policy{
				{Name: "api", Limiter: local},
				{Name: "per-client", Partition: serve.ByClientIP, Limiter: partition.Options{
					Shared: &shared.Options{TokenBucket: &shared.TokenBucketOptions{TokenLimit: 1, TokensPerPeriod: 1, ReplenishmentPeriod: time.Second}},
					Redis:  client,
				}},
			},
			Criticality: serve.CriticalityOptions{Default: sdk.Sheddable, Ceiling: sdk.CriticalPlus},
		}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.opts.Validate()
			oe, _ := serve.AsOptionsError(err)
			var got []string
			if oe != nil {
				got = oe.Problems
			}
			if len(got) != len(tt.want) || (err != nil) != errors.Is(err, serve.ErrInvalidOptions) {
				t.Fatalf("Validate = %v, want problems %q", err, tt.want)
			}
			for i, w := range tt.want {
				if !strings.Contains(got[i], w) {
					t.Errorf("problem %d = %q, want it to contain %q", i, got[i], w)
				}
			}
			if _, err := serve.New(tt.opts); (err != nil) != (len(tt.want) > 0) {
				t.Errorf("New = %v; want an error exactly when Validate finds problems", err)
			}
		})
	}
}

func TestHandlerPanicsOnAnUnknownPolicy(t *testing.T) {
	m := newMiddleware(t, serve.Options{Policies: []serve.Policy{{Name: "api", Limiter: partition.Options{Local: &limit.Options{Concurrency: 1}}}}})
	defer func() {
		if r := fmt.Sprint(recover()); !strings.Contains(r, `no policy named "apj" (have "api")`) {
			t.Errorf("recovered %q; want a panic naming the missing policy and the ones there are", r)
		}
	}()
	m.Handler("apj", ok)
}

// One noisy client spends its own budget and nobody else's, whether clients
// are told apart by address or by a tenant header.
func TestClientsAreIsolated(t *testing.T) {
	tests := []struct {
		name      string
		partition func(*http.Request) string
		noisy     func(t *testing.T, url string) response
		quiet     func(t *testing.T, url string) response
	}{
		{"by client address", serve.ByClientIP,
			func(t *testing.T, url string) response { return get(t, clientFrom(t, "127.0.0.2"), url) },
			func(t *testing.T, url string) response { return get(t, clientFrom(t, "127.0.0.3"), url) }},
		{"by tenant header", serve.ByHeader("x-tenant"),
			func(t *testing.T, url string) response { return get(t, http.DefaultClient, url, "X-Tenant", "noisy") },
			func(t *testing.T, url string) response { return get(t, http.DefaultClient, url, "X-Tenant", "quiet") }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rec := newRecorder()
			m := newMiddleware(t, serve.Options{
				Policies: []serve.Policy{{Name: "per-client", Partition: tt.partition, Limiter: partition.Options{
					Local: &limit.Options{PerWindow: &limit.PerWindowOptions{Permits: 3, Window: time.Hour}},
				}}},
				Observer: rec,
			})
			srv := listen(t, m.Handler("per-client", ok))
			codes := map[int]int{}
			for range 10 {
				codes[tt.noisy(t, srv.URL).code]++
			}
			if codes[200] != 3 || codes[429] != 7 {
				t.Fatalf("noisy client got %v; want 3 × 200 and 7 × 429", codes)
			}
			for i := range 3 {
				if r := tt.quiet(t, srv.URL); r.code != 200 {
					t.Fatalf("quiet client's request %d = %d after the noisy one spent its budget; want 200", i+1, r.code)
				}
			}
			if a, r := rec.count("per-client", serve.Admitted), rec.count("per-client", serve.Refused); a != 6 || r != 7 {
				t.Errorf("observed %d admitted, %d refused; want 6, 7", a, r)
			}
			if n, _ := m.Partitions("per-client"); n != 2 || rec.partitions["per-client"] != 2 {
				t.Errorf("%d partitions, %d observed; want 2", n, rec.partitions["per-client"])
			}
		})
	}
}

// Retry-After is the limiter's hint in whole seconds, rounded up; a
// refusal without a hint has none.
func TestRetryAfter(t *testing.T) {
	tests := []struct {
		name    string
		local   limit.Options
		spend   int           // requests admitted first
		advance time.Duration // then the clock moves
		want    string        // the next request's Retry-After; "" for none
	}{
		{"next token in 500ms", limit.Options{PerSecond: &limit.PerSecondOptions{Permits: 2}}, 2, 0, "1"},
		{"next token in 100ms", limit.Options{PerSecond: &limit.PerSecondOptions{Permits: 2}}, 2, 400 * time.Millisecond, "1"},
		{"next token in 1s exactly", limit.Options{PerSecond: &limit.PerSecondOptions{Permits: 1}}, 1, 0, "1"},
		{"a burst spent", limit.Options{PerSecond: &limit.PerSecondOptions{Permits: 1, Burst: 5}}, 5, 0, "1"},
		{"window of 10s", limit.Options{PerWindow: &limit.PerWindowOptions{Permits: 3, Window: 10 * time.Second}}, 3, 0, "10"},
		{"7.5s left of the window", limit.Options{PerWindow: &limit.PerWindowOptions{Permits: 3, Window: 10 * time.Second}}, 3, 2500 * time.Millisecond, "8"},
		{"a minute's window", limit.Options{PerWindow: &limit.PerWindowOptions{Permits: 1, Window: time.Minute, Segments: 1}}, 1, time.Millisecond, "60"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				m := newMiddleware(t, serve.Options{Policies: []serve.Policy{{Name: "api", Limiter: partition.Options{Local: &tt.local}}}})
				c := inProcess(m.Handler("api", ok))
				for i := range tt.spend {
					if r := get(t, c, inProcessURL); r.code != 200 {
						t.Fatalf("request %d = %d; want 200", i+1, r.code)
					}
				}
				clocktest.Advance(tt.advance)
				r := get(t, c, inProcessURL)
				if r.code != 429 || r.retryAfter != tt.want || r.hasRetry != (tt.want != "") {
					t.Errorf("refusal = %d with Retry-After %q (set %v); want 429 with %q", r.code, r.retryAfter, r.hasRetry, tt.want)
				}
			})
		})
	}
}

func TestFormatRetryAfter(t *testing.T) {
	tests := []struct {
		d    time.Duration
		want string // "" for no header
	}{
		{-time.Second, ""},
		{0, ""},
		{time.Nanosecond, "1"},
		{999 * time.Millisecond, "1"},
		{time.Second, "1"},
		{time.Second + time.Nanosecond, "2"},
		{2500 * time.Millisecond, "3"},
		{time.Hour, "3600"},
		{1<<63 - 1, "9223372037"},
	}
	for _, tt := range tests {
		got, ok := serve.FormatRetryAfter(tt.d)
		if got != tt.want || ok != (tt.want != "") {
			t.Errorf("FormatRetryAfter(%v) = %q, %v; want %q", tt.d, got, ok, tt.want)
		}
	}
}

// blocking is a handler that holds each request until release is closed,
// saying on entered when one has come in.
type blocking struct {
	entered chan struct{}
	release chan struct{}
}

func newBlocking(t *testing.T) *blocking {
	b := &blocking{entered: make(chan struct{}, 16), release: make(chan struct{})}
	t.Cleanup(b.open)
	return b
}

func (b *blocking) open() {
	select {
	case <-b.release:
	default:
		close(b.release)
	}
}

func (b *blocking) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	b.entered <- struct{}{}
	select {
	case <-b.release:
	case <-time.After(30 * time.Second): // a failsafe, far past any test
	}
	io.WriteString(w, "done")
}

// Without a queue a request that finds no permit is refused at once: the
// refusal arrives while the request holding the permit is still held.
func TestNoQueueRefusesAtOnce(t *testing.T) {
	rec := newRecorder()
	m := newMiddleware(t, serve.Options{
		Policies: []serve.Policy{{Name: "uploads", Limiter: partition.Options{Local: &limit.Options{Concurrency: 1}}}},
		Observer: rec,
	})
	b := newBlocking(t)
	srv := listen(t, m.Handler("uploads", b))
	first := background(http.DefaultClient, srv.URL)
	<-b.entered

	r := get(t, http.DefaultClient, srv.URL)
	if r.code != 429 || r.hasRetry {
		t.Errorf("second request = %d, Retry-After %q; want 429 and none: a concurrency refusal has no hint", r.code, r.retryAfter)
	}
	b.open()
	if r := <-first; r.code != 200 || r.body != "done" {
		t.Errorf("first request = %d %q; want 200", r.code, r.body)
	}
	if rec.count("uploads", serve.Refused) != 1 || rec.count("uploads", serve.Admitted) != 1 {
		t.Errorf("observed %v; want one admitted, one refused", rec.requests["uploads"])
	}
}

// With a queue a request waits for a permit no longer than its context:
// here the deadline its caller sent, which ends the wait while the permit
// is still held. A request that can wait gets the permit when it is free.
func TestQueueWaitsNoLongerThanTheRequest(t *testing.T) {
	synctest.Test(t, testQueueWaitsNoLongerThanTheRequest)
}

func testQueueWaitsNoLongerThanTheRequest(t *testing.T) {
	rec := newRecorder()
	m := newMiddleware(t, serve.Options{
		Policies: []serve.Policy{{Name: "uploads", Limiter: partition.Options{Local: &limit.Options{Concurrency: 1, QueueLimit: 1}}}},
		Observer: rec,
	})
	b := newBlocking(t)
	c := inProcess(m.Handler("uploads", b))
	first := background(c, inProcessURL)
	<-b.entered

	start := time.Now()
	r := get(t, c, inProcessURL, sdk.TimeoutHeader, "100")
	if r.code != 429 || rec.count("uploads", serve.Cancelled) != 1 || time.Since(start) != 100*time.Millisecond {
		t.Fatalf("request with 100ms to wait = %d after %v, observed %v; want 429 after 100ms, cancelled",
			r.code, time.Since(start), rec.requests["uploads"])
	}
	select {
	case r := <-first:
		t.Fatalf("the first request finished (%d) before it was released", r.code)
	default:
	}

	third := background(c, inProcessURL)
	synctest.Wait() // the third request is queued
	b.open()
	if r := <-first; r.code != 200 {
		t.Errorf("first = %d", r.code)
	}
	if r := <-third; r.code != 200 || r.body != "done" {
		t.Errorf("a request free to wait = %d %q; want 200 once the permit is free", r.code, r.body)
	}
}

// A custom hook answers rejections, told everything about them.
func TestRejectHook(t *testing.T) { synctest.Test(t, testRejectHook) }

func testRejectHook(t *testing.T) {
	var got *serve.Rejection
	m := newMiddleware(t, serve.Options{
		Policies: []serve.Policy{{Name: "search", Partition: serve.ByHeader("X-Api-Key"), Limiter: partition.Options{
			Local: &limit.Options{PerWindow: &limit.PerWindowOptions{Permits: 1, Window: 90 * time.Second, Segments: 1}},
		}}},
		Reject: func(w http.ResponseWriter, r *http.Request, rej *serve.Rejection) {
			got = rej
			w.Header().Set("Content-Type", "application/json")
			if v, ok := serve.FormatRetryAfter(rej.RetryAfter); ok {
				w.Header().Set("Retry-After", v)
			}
			w.WriteHeader(http.StatusTooManyRequests)
			fmt.Fprintf(w, `{"policy":%q}`, rej.Policy)
		},
	})
	c := inProcess(m.Handler("search", ok))
	get(t, c, inProcessURL, "X-Api-Key", "k1")
	r := get(t, c, inProcessURL, "X-Api-Key", "k1")
	if r.code != 429 || r.retryAfter != "90" || r.body != `{"policy":"search"}` {
		t.Fatalf("refusal = %d %q, Retry-After %q", r.code, r.body, r.retryAfter)
	}
	rl, isRL := sdk.AsRateLimited(got.Err)
	if got.Policy != "search" || got.Partition != "k1" || got.Outcome != serve.Refused || got.RetryAfter != 90*time.Second || !isRL || rl.Limiter != "search" {
		t.Errorf("hook told %+v; want policy search, partition k1, refused, 90s, a refusal naming the policy", got)
	}
}

// A shared limiter that cannot reach Redis, under FailureMode Throw, gives
// no decision: 503, without Retry-After.
func TestStoreFailure(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close() // nothing listens there now
	rdb := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1, DialTimeout: time.Second, DialerRetries: 1})
	t.Cleanup(func() { rdb.Close() })
	rec := newRecorder()
	m := newMiddleware(t, serve.Options{
		Policies: []serve.Policy{{Name: "api", Limiter: partition.Options{
			Shared: &shared.Options{FixedWindow: &shared.FixedWindowOptions{Permits: 10, Window: time.Second}},
			Redis:  rdb,
		}}},
		Observer: rec,
	})
	srv := listen(t, m.Handler("api", ok))
	if r := get(t, http.DefaultClient, srv.URL); r.code != 503 || r.hasRetry {
		t.Errorf("with Redis down = %d, Retry-After %q; want 503 and none", r.code, r.retryAfter)
	}
	if rec.count("api", serve.Failed) != 1 {
		t.Errorf("observed %v; want one failed", rec.requests["api"])
	}
}

// A refusal reaches a client of package sdkhttp as a self-imposed-looking
// throttle it can honour: Throttled, with the server's Retry-After.
func TestSDKClientReadsTheRefusal(t *testing.T) { synctest.Test(t, testSDKClientReadsTheRefusal) }

func testSDKClientReadsTheRefusal(t *testing.T) {
	m := newMiddleware(t, serve.Options{Policies: []serve.Policy{{Name: "api", Limiter: partition.Options{
		Local: &limit.Options{PerSecond: &limit.PerSecondOptions{Permits: 1}},
	}}}})
	rt, err := sdkhttp.NewStack(handlerTransport{m.Handler("api", ok)}).Retry(&sdk.Policy{MaxAttempts: 1}).Build()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(rt.CloseIdleConnections)
	client := &http.Client{Transport: rt}
	get(t, client, inProcessURL)
	var res sdkhttp.Result
	req, _ := http.NewRequestWithContext(sdkhttp.WithResult(context.Background(), &res), http.MethodGet, inProcessURL, nil)
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 429 || len(res.Attempts) != 1 {
		t.Fatalf("%d after %d attempts; want 429 after 1", resp.StatusCode, len(res.Attempts))
	}
	if a := res.Attempts[0]; a.Verdict().String() != "Throttled(retry after 1s)" {
		t.Errorf("the client's verdict = %v; want Throttled, retry after 1s", a.Verdict())
	}
}

// The edge headers a server reads, as its handler sees them.
func TestEdgeHeaders(t *testing.T) {
	type seen struct {
		criticality sdk.Criticality
		deadline    bool
		left        time.Duration
		raw         []string // edge headers left on the request
	}
	trusting := serve.CriticalityOptions{Default: sdk.SheddablePlus, Ceiling: sdk.CriticalPlus}
	tests := []struct {
		name    string
		opts    serve.CriticalityOptions
		headers []string
		want    sdk.Criticality
		within  time.Duration // the deadline is at most this far; 0: none
		results [2]serve.HeaderResult
	}{
		{"none", serve.CriticalityOptions{}, nil, sdk.Critical, 0, [2]serve.HeaderResult{serve.HeaderMissing, serve.HeaderMissing}},
		{"none, other default", trusting, nil, sdk.SheddablePlus, 0, [2]serve.HeaderResult{serve.HeaderMissing, serve.HeaderMissing}},
		{"sheddable", serve.CriticalityOptions{}, []string{sdk.CriticalityHeader, "Sheddable"}, sdk.Sheddable, 0,
			[2]serve.HeaderResult{serve.HeaderAccepted, serve.HeaderMissing}},
		{"critical plus over the ceiling", serve.CriticalityOptions{}, []string{sdk.CriticalityHeader, "CriticalPlus"}, sdk.Critical, 0,
			[2]serve.HeaderResult{serve.HeaderCapped, serve.HeaderMissing}},
		{"critical plus, trusted", trusting, []string{sdk.CriticalityHeader, "criticalplus"}, sdk.CriticalPlus, 0,
			[2]serve.HeaderResult{serve.HeaderAccepted, serve.HeaderMissing}},
		{"unknown name", trusting, []string{sdk.CriticalityHeader, "Urgent"}, sdk.SheddablePlus, 0,
			[2]serve.HeaderResult{serve.HeaderMalformed, serve.HeaderMissing}},
		{"sent twice", trusting, []string{sdk.CriticalityHeader, "Sheddable", sdk.CriticalityHeader, "CriticalPlus"}, sdk.SheddablePlus, 0,
			[2]serve.HeaderResult{serve.HeaderMalformed, serve.HeaderMissing}},
		{"timeout", serve.CriticalityOptions{}, []string{sdk.TimeoutHeader, "5000"}, sdk.Critical, 5 * time.Second,
			[2]serve.HeaderResult{serve.HeaderMissing, serve.HeaderAccepted}},
		{"negative timeout", serve.CriticalityOptions{}, []string{sdk.TimeoutHeader, "-1"}, sdk.Critical, 0,
			[2]serve.HeaderResult{serve.HeaderMissing, serve.HeaderMalformed}},
		{"timeout with a unit", serve.CriticalityOptions{}, []string{sdk.TimeoutHeader, "5s"}, sdk.Critical, 0,
			[2]serve.HeaderResult{serve.HeaderMissing, serve.HeaderMalformed}},
		{"both", serve.CriticalityOptions{}, []string{sdk.CriticalityHeader, "SheddablePlus", sdk.TimeoutHeader, "60000"}, sdk.SheddablePlus, time.Minute,
			[2]serve.HeaderResult{serve.HeaderAccepted, serve.HeaderAccepted}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rec := newRecorder()
			m := newMiddleware(t, serve.Options{Criticality: tt.opts, Observer: rec})
			got := make(chan seen, 1)
			srv := listen(t, m.Edge(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				d, has := r.Context().Deadline()
				got <- seen{
					criticality: sdk.CriticalityFrom(r.Context()),
					deadline:    has,
					left:        time.Until(d),
					raw:         append(r.Header.Values(sdk.CriticalityHeader), r.Header.Values(sdk.TimeoutHeader)...),
				}
			})))
			get(t, http.DefaultClient, srv.URL, tt.headers...)
			s := <-got
			if s.criticality != tt.want || s.deadline != (tt.within > 0) || (s.deadline && (s.left <= 0 || s.left > tt.within)) {
				t.Errorf("handler saw %v, deadline %v in %v; want %v, a deadline within %v", s.criticality, s.deadline, s.left, tt.want, tt.within)
			}
			if len(s.raw) != 0 {
				t.Errorf("edge headers %q left on the request; want them removed once read", s.raw)
			}
			for i, h := range []serve.Header{serve.HeaderCriticality, serve.HeaderTimeout} {
				if rec.header(h, tt.results[i]) != 1 {
					t.Errorf("%v header: observed %v; want one %v", h, rec.headers[h], tt.results[i])
				}
			}
		})
	}
}

// Edge and a policy together read a request's headers once.
func TestEdgeAndPolicyReadOnce(t *testing.T) {
	rec := newRecorder()
	m := newMiddleware(t, serve.Options{
		Policies: []serve.Policy{{Name: "api", Limiter: partition.Options{Local: &limit.Options{Concurrency: 10}}}},
		Observer: rec,
	})
	var saw sdk.Criticality
	srv := listen(t, m.Edge(m.Handler("api", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		saw = sdk.CriticalityFrom(r.Context())
	}))))
	get(t, http.DefaultClient, srv.URL, sdk.CriticalityHeader, "Sheddable")
	if saw != sdk.Sheddable || rec.header(serve.HeaderCriticality, serve.HeaderAccepted) != 1 {
		t.Errorf("handler saw %v, headers observed %v; want Sheddable, read once", saw, rec.headers)
	}
}

// hop is what one server in a chain saw of a request.
type hop struct {
	header      string // the criticality header as it arrived
	timeout     time.Duration
	criticality sdk.Criticality
	admitted    sdk.Criticality // what the Admit hook of its own call saw
}

// Criticality and deadline cross two hops: a caller's level reaches the
// Admit hook of the middle server's own call and the last server, never
// above the middle server's ceiling; the deadline shrinks along the way.
func TestEdgeAcrossTwoHops(t *testing.T) {
	tests := []struct {
		name      string
		ctx       func(context.Context) context.Context // the first caller's
		middle    serve.CriticalityOptions
		wantFirst string // the header as the middle server gets it
		want      sdk.Criticality
	}{
		{"sheddable", func(ctx context.Context) context.Context { return sdk.WithCriticality(ctx, sdk.Sheddable) },
			serve.CriticalityOptions{}, "Sheddable", sdk.Sheddable},
		{"critical plus, capped", func(ctx context.Context) context.Context { return sdk.WithCriticality(ctx, sdk.CriticalPlus) },
			serve.CriticalityOptions{}, "CriticalPlus", sdk.Critical},
		{"unlabelled takes the middle default", func(ctx context.Context) context.Context { return ctx },
			serve.CriticalityOptions{Default: sdk.SheddablePlus}, "", sdk.SheddablePlus},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			middleSaw, lastSaw := make(chan hop, 1), make(chan hop, 1)

			// The last server: Edge, then a handler that reports.
			lastMW := newMiddleware(t, serve.Options{Criticality: serve.CriticalityOptions{Ceiling: sdk.CriticalPlus}})
			last := listen(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				h := hop{header: r.Header.Get(sdk.CriticalityHeader)}
				h.timeout, _ = sdk.ParseTimeout(r.Header.Get(sdk.TimeoutHeader))
				lastMW.Edge(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					h.criticality = sdk.CriticalityFrom(r.Context())
				})).ServeHTTP(w, r)
				lastSaw <- h
			}))

			// The middle server: a policy, then a handler that calls the
			// last through a stack with retries, an Admit hook and
			// Propagate, on the request's context.
			var admitted atomic.Int32
			p := &sdk.Policy{MaxAttempts: 1, Admit: func(ctx context.Context, next sdk.NextAttempt) (v verdict.Verdict) {
				admitted.Store(int32(next.Criticality))
				return v
			}}
			rt, err := sdkhttp.NewStack(nil).Retry(p).Propagate().Build()
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(rt.CloseIdleConnections)
			onward := &http.Client{Transport: rt}
			middleMW := newMiddleware(t, serve.Options{
				Policies:    []serve.Policy{{Name: "api", Limiter: partition.Options{Local: &limit.Options{Concurrency: 10}}}},
				Criticality: tt.middle,
			})
			middle := listen(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				h := hop{header: r.Header.Get(sdk.CriticalityHeader)}
				h.timeout, _ = sdk.ParseTimeout(r.Header.Get(sdk.TimeoutHeader))
				middleMW.Handler("api", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					h.criticality = sdk.CriticalityFrom(r.Context())
					resp, err := fetch(onward, r.Context(), last.URL)
					h.admitted = sdk.Criticality(admitted.Load())
					if err != nil {
						http.Error(w, err.Error(), http.StatusBadGateway)
						return
					}
					w.WriteHeader(resp.code)
				})).ServeHTTP(w, r)
				middleSaw <- h
			}))

			// The first caller: Propagate alone.
			rt0, err := sdkhttp.NewStack(nil).Propagate().Build()
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(rt0.CloseIdleConnections)
			ctx, cancel := context.WithTimeout(tt.ctx(context.Background()), time.Minute)
			defer cancel()
			if r, err := fetch(&http.Client{Transport: rt0}, ctx, middle.URL); err != nil || r.code != 200 {
				t.Fatalf("chain answered %d %q, %v", r.code, r.body, err)
			}

			m, l := <-middleSaw, <-lastSaw
			if m.header != tt.wantFirst || m.criticality != tt.want || m.admitted != tt.want {
				t.Errorf("middle got header %q, ran at %v, its Admit hook saw %v; want %q, %v, %v", m.header, m.criticality, m.admitted, tt.wantFirst, tt.want, tt.want)
			}
			if l.header != tt.want.String() || l.criticality != tt.want {
				t.Errorf("last got header %q, ran at %v; want %v", l.header, l.criticality, tt.want)
			}
			if m.timeout <= 0 || m.timeout > time.Minute || l.timeout <= 0 || l.timeout > m.timeout {
				t.Errorf("timeouts sent: %v to the middle, %v to the last; want 0 < last <= middle <= 1m", m.timeout, l.timeout)
			}
		})
	}
}

// The retry budget of a call made while serving a request reads the level
// its caller sent: work below Critical may not spend the last half.
func TestRetryBudgetSeesTheCallersLevel(t *testing.T) {
	m := newMiddleware(t, serve.Options{})
	srv := listen(t, m.Edge(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p := &sdk.Policy{
			MaxAttempts: 10,
			Backoff:     sdk.Backoff{Transient: sdk.Curve{Initial: time.Microsecond, Multiplier: 1}},
			Budget:      sdk.NewRetryBudget(0.1, 4), // 4 retries; 2 below Critical
		}
		res := sdk.Try(r.Context(), p, func(context.Context) (int, error) {
			return 0, &net.OpError{Op: "dial", Err: errors.New("connection refused")} // Transient
		})
		fmt.Fprint(w, len(res.Attempts), " ", res.Stop)
	})))
	tests := []struct {
		level string
		want  string
	}{
		{"Sheddable", "3 retry budget exhausted"},
		{"Critical", "5 retry budget exhausted"},
	}
	for _, tt := range tests {
		if r := get(t, http.DefaultClient, srv.URL, sdk.CriticalityHeader, tt.level); r.body != tt.want {
			t.Errorf("%s: %q; want %q", tt.level, r.body, tt.want)
		}
	}
}

// Two replicas share each tenant's budget through Redis, and tenants do not
// share theirs.
func TestSharedPolicyAcrossReplicas(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	replica := func() string {
		m := newMiddleware(t, serve.Options{Policies: []serve.Policy{{
			Name:      "per-tenant",
			Partition: serve.ByHeader("X-Tenant"),
			Limiter: partition.Options{
				// Three tokens, one more an hour: nothing refills during
				// the test.
				Shared: &shared.Options{TokenBucket: &shared.TokenBucketOptions{TokenLimit: 3, TokensPerPeriod: 1, ReplenishmentPeriod: time.Hour}},
				Redis:  rdb,
			},
		}}})
		return listen(t, m.Handler("per-tenant", ok)).URL
	}
	one, two := replica(), replica()
	tests := []struct {
		url, tenant string
		code        int
	}{
		{one, "acme", 200},
		{one, "acme", 200},
		{two, "acme", 200},
		{two, "acme", 429},
		{one, "acme", 429},
		{two, "globex", 200},
		{one, "globex", 200},
	}
	for i, tt := range tests {
		r := get(t, http.DefaultClient, tt.url, "X-Tenant", tt.tenant)
		if r.code != tt.code {
			t.Fatalf("request %d (%s) = %d; want %d", i+1, tt.tenant, r.code, tt.code)
		}
		if secs, err := strconv.Atoi(r.retryAfter); r.code == 429 && (err != nil || secs < 1 || secs > 3600) {
			t.Errorf("request %d: Retry-After %q; want the time to the next token, at most an hour", i+1, r.retryAfter)
		}
	}
	keys, err := rdb.Keys(context.Background(), "egressd/serve/*").Result()
	if err != nil || len(keys) != 2 {
		t.Errorf("Redis keys %q (%v); want egressd/serve/per-tenant/acme and …/globex", keys, err)
	}
}
