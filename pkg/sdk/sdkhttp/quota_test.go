package sdkhttp

import (
	"context"
	"errors"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/pkg/limit"
	"github.com/egressd/egressd/pkg/sdk"
)

var t0 = time.Unix(1_750_000_000, 0)

func header(kv ...string) http.Header {
	h := http.Header{}
	for i := 0; i+1 < len(kv); i += 2 {
		h.Set(kv[i], kv[i+1])
	}
	return h
}

func TestPublished(t *testing.T) {
	tests := []struct {
		name          string
		hdr           http.Header
		wantOK        bool
		wantRemaining int64
		wantReset     time.Time
	}{
		{"IETF", header("RateLimit-Remaining", "5", "RateLimit-Reset", "30"), true, 5, t0.Add(30 * time.Second)},
		{"IETF list", header("RateLimit-Remaining", "5, 50;w=60", "RateLimit-Reset", "30"), true, 5, t0.Add(30 * time.Second)},
		{"X- delay seconds", header("X-RateLimit-Remaining", "7", "X-RateLimit-Reset", "60"), true, 7, t0.Add(time.Minute)},
		{"X- epoch seconds", header("X-RateLimit-Remaining", "7", "X-RateLimit-Reset", "1750000100"), true, 7, t0.Add(100 * time.Second)},
		{"X- fractional epoch", header("X-RateLimit-Remaining", "7", "X-RateLimit-Reset", "1750000100.5"), true, 7, t0.Add(100500 * time.Millisecond)},
		{"X- epoch milliseconds", header("X-RateLimit-Remaining", "7", "X-RateLimit-Reset", "1750000100250"), true, 7, t0.Add(100250 * time.Millisecond)},
		{"X- epoch in the past", header("X-RateLimit-Remaining", "0", "X-RateLimit-Reset", "1700000000"), true, 0, time.Unix(1_700_000_000, 0)},
		{"exactly 1e9 is still seconds", header("X-RateLimit-Remaining", "1", "X-RateLimit-Reset", "1000000000"), true, 1, t0.Add(1e9 * time.Second)},
		{"both: less left wins", header("RateLimit-Remaining", "5", "RateLimit-Reset", "30", "X-RateLimit-Remaining", "3", "X-RateLimit-Reset", "60"), true, 3, t0.Add(time.Minute)},
		{"both equal: later reset wins", header("RateLimit-Remaining", "3", "RateLimit-Reset", "90", "X-RateLimit-Remaining", "3", "X-RateLimit-Reset", "60"), true, 3, t0.Add(90 * time.Second)},
		{"negative remaining is zero", header("RateLimit-Remaining", "-2", "RateLimit-Reset", "1"), true, 0, t0.Add(time.Second)},
		{"remaining without reset", header("RateLimit-Remaining", "0"), false, 0, time.Time{}},
		{"reset without remaining", header("X-RateLimit-Reset", "10"), false, 0, time.Time{}},
		{"malformed reset", header("RateLimit-Remaining", "0", "RateLimit-Reset", "soon"), false, 0, time.Time{}},
		{"negative reset", header("RateLimit-Remaining", "0", "RateLimit-Reset", "-5"), false, 0, time.Time{}},
		{"infinite reset", header("RateLimit-Remaining", "0", "RateLimit-Reset", "Inf"), false, 0, time.Time{}},
		{"nothing", header(), false, 0, time.Time{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			remaining, reset, ok := published(tt.hdr, t0)
			if ok != tt.wantOK || remaining != tt.wantRemaining || !reset.Equal(tt.wantReset) {
				t.Errorf("published = %d, %v, %v; want %d, %v, %v", remaining, reset, ok, tt.wantRemaining, tt.wantReset, tt.wantOK)
			}
		})
	}
}

func TestHostQuotaAdmit(t *testing.T) {
	tests := []struct {
		name          string
		h             hostQuota
		at            time.Time
		reserve       int64
		wantWait      time.Duration
		wantOK        bool
		wantRemaining int64
	}{
		{"above the reserve: go, and count it", hostQuota{remaining: 2, reset: t0.Add(time.Minute)}, t0, 1, 0, true, 1},
		{"at the reserve: refuse until reset", hostQuota{remaining: 1, reset: t0.Add(time.Minute)}, t0, 1, time.Minute, false, 1},
		{"spent: refuse until reset", hostQuota{remaining: 0, reset: t0.Add(time.Minute)}, t0.Add(15 * time.Second), 0, 45 * time.Second, false, 0},
		{"reset passed: go, uncounted", hostQuota{remaining: 0, reset: t0}, t0, 0, 0, true, 0},
		{"Retry-After: refuse until then", hostQuota{remaining: 9, reset: t0.Add(time.Minute), blocked: t0.Add(5 * time.Second)}, t0, 0, 5 * time.Second, false, 9},
		{"Retry-After passed", hostQuota{remaining: 9, reset: t0.Add(time.Minute), blocked: t0}, t0, 0, 0, true, 8},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := tt.h
			_, wait, ok := h.admit(tt.at, tt.reserve)
			if wait != tt.wantWait || ok != tt.wantOK || h.remaining != tt.wantRemaining {
				t.Errorf("admit = %v, %v, remaining %d; want %v, %v, %d", wait, ok, h.remaining, tt.wantWait, tt.wantOK, tt.wantRemaining)
			}
		})
	}
}

func TestParseRetryAfter(t *testing.T) {
	now := time.Date(1994, time.November, 6, 8, 48, 37, 0, time.UTC)
	tests := []struct {
		in     string
		want   time.Duration
		wantOK bool
	}{
		{"", 0, false},
		{"0", 0, true},
		{"120", 2 * time.Minute, true},
		{" 5 ", 5 * time.Second, true},
		{"18446744073709551615", 1<<63 - 1, true},
		{"-1", 0, false},
		{"1.5", 0, false},
		{"Sun, 06 Nov 1994 08:49:37 GMT", time.Minute, true},  // IMF-fixdate
		{"Sunday, 06-Nov-94 08:49:37 GMT", time.Minute, true}, // RFC 850
		{"Sun Nov  6 08:49:37 1994", time.Minute, true},       // asctime
		{"Sun, 06 Nov 1994 08:00:00 GMT", 0, true},            // past: retry now
		{"tomorrow", 0, false},
	}
	for _, tt := range tests {
		got, ok := ParseRetryAfter(tt.in, now)
		if got != tt.want || ok != tt.wantOK {
			t.Errorf("ParseRetryAfter(%q) = %v, %v; want %v, %v", tt.in, got, ok, tt.want, tt.wantOK)
		}
	}
}

func TestHostKey(t *testing.T) {
	tests := []struct{ url, want string }{
		{"https://API.example.com/v1", "api.example.com"},
		{"https://api.example.com:443/v1", "api.example.com"},
		{"http://api.example.com:80/", "api.example.com"},
		{"http://api.example.com:443/", "api.example.com:443"},
		{"http://127.0.0.1:8080/", "127.0.0.1:8080"},
		{"https://[::1]:443/", "[::1]"},
		{"https://[::1]:8443/", "[::1]:8443"},
	}
	for _, tt := range tests {
		u, err := url.Parse(tt.url)
		if err != nil {
			t.Fatal(err)
		}
		if got := hostKey(u); got != tt.want {
			t.Errorf("hostKey(%s) = %q, want %q", tt.url, got, tt.want)
		}
	}
}

// quotaServer publishes an allowance that the test sets, spending one unit
// per request, in the header family publish writes.
type quotaServer struct {
	*server
	remaining atomic.Int64
}

func serveQuota(t *testing.T, publish func(h http.Header, remaining int64, now time.Time)) *quotaServer {
	t.Helper()
	q := &quotaServer{}
	q.server = serve(t, func(w http.ResponseWriter, r *http.Request) {
		n := max(q.remaining.Add(-1), 0)
		publish(w.Header(), n, time.Now())
		okReply(w, r)
	})
	return q
}

const window = 30 * time.Second

// toThePresent moves the clock of a bubble, which starts in 2000, on to
// 2025: an X-RateLimit-Reset is a Unix time only above 1e9 seconds (2001).
func toThePresent() { clocktest.Advance(time.Until(time.Unix(1_750_000_000, 0))) }

func ietf(h http.Header, remaining int64, _ time.Time) {
	h.Set("RateLimit-Remaining", strconv.FormatInt(remaining, 10))
	h.Set("RateLimit-Reset", "30")
}

func xDelay(h http.Header, remaining int64, _ time.Time) {
	h.Set("X-RateLimit-Remaining", strconv.FormatInt(remaining, 10))
	h.Set("X-RateLimit-Reset", "30")
}

func xEpoch(h http.Header, remaining int64, now time.Time) {
	h.Set("X-RateLimit-Remaining", strconv.FormatInt(remaining, 10))
	h.Set("X-RateLimit-Reset", strconv.FormatInt(now.Add(window).Unix(), 10))
}

// Once what is left is inside the reserve, attempts to the host are refused
// before they are sent - a self-imposed refusal naming the host, until the
// reset - and go again once the reset has passed.
func TestQuotaRefusesInsideTheReserveUntilReset(t *testing.T) {
	tests := []struct {
		name     string
		publish  func(http.Header, int64, time.Time)
		reserve  int
		admitted int // requests that get through an allowance of 3
	}{
		{"IETF, reserve 0", ietf, 0, 3},
		{"IETF, reserve 1", ietf, 1, 2},
		{"X- delay seconds", xDelay, 0, 3},
		{"X- epoch", xEpoch, 0, 3},
		{"X- epoch, reserve 2", xEpoch, 2, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				toThePresent()
				srv := serveQuota(t, tt.publish)
				srv.remaining.Store(3)
				c := build(t, NewStack(nil).Retry(testPolicy(1)).Quota(QuotaOptions{Reserve: tt.reserve}))

				for i := range tt.admitted {
					if code, _, _, err := get(t, c, srv.URL); err != nil || code != 200 {
						t.Fatalf("request %d: %d, %v", i+1, code, err)
					}
				}
				clocktest.Advance(10 * time.Second)
				_, _, res, err := get(t, c, srv.URL)
				rl, isRL := sdk.AsRateLimited(err)
				if !isRL || rl.Limiter != "quota:"+srv.host() || rl.RetryAfter != window-10*time.Second || !errors.Is(err, ErrQuotaExhausted) {
					t.Fatalf("inside the reserve: err %v, want a refusal by quota:%s for 20s", err, srv.host())
				}
				if got := kinds(res.Attempts); !slices.Equal(got, []string{"Throttled(self-imposed)"}) || srv.hits.Load() != int32(tt.admitted) {
					t.Errorf("attempts %v, %d requests sent; want one self-imposed refusal, %d", got, srv.hits.Load(), tt.admitted)
				}

				clocktest.Advance(20 * time.Second) // the reset
				srv.remaining.Store(3)
				if code, _, _, err := get(t, c, srv.URL); err != nil || code != 200 {
					t.Errorf("after the reset: %d, %v", code, err)
				}
			})
		})
	}
}

// A Retry-After refuses the host until it passes, whatever the allowance.
func TestQuotaHonoursRetryAfter(t *testing.T) { synctest.Test(t, testQuotaHonoursRetryAfter) }

func testQuotaHonoursRetryAfter(t *testing.T) {
	srv := serve(t, reply(429, "", "Retry-After", "5", "RateLimit-Remaining", "100", "RateLimit-Reset", "60"), okReply)
	c := build(t, NewStack(nil).Retry(testPolicy(1)).Quota(QuotaOptions{}))
	if code, _, _, err := get(t, c, srv.URL); err != nil || code != 429 {
		t.Fatalf("first: %d, %v", code, err)
	}
	clocktest.Advance(2 * time.Second)
	_, _, _, err := get(t, c, srv.URL)
	if rl, isRL := sdk.AsRateLimited(err); !isRL || rl.RetryAfter != 3*time.Second {
		t.Fatalf("during the Retry-After: %v, want a refusal for 3s", err)
	}
	clocktest.Advance(3 * time.Second)
	if code, _, _, err := get(t, c, srv.URL); err != nil || code != 200 || srv.hits.Load() != 2 {
		t.Errorf("after it: %d, %v, %d requests", code, err, srv.hits.Load())
	}
}

// One host's spent allowance refuses nothing to another.
func TestQuotaIsPerHost(t *testing.T) { synctest.Test(t, testQuotaIsPerHost) }

func testQuotaIsPerHost(t *testing.T) {
	spent := serve(t, reply(200, "", "RateLimit-Remaining", "0", "RateLimit-Reset", "60"))
	other := serve(t, reply(200, "", "RateLimit-Remaining", "50", "RateLimit-Reset", "60"))
	silent := serve(t, okReply)
	c := build(t, NewStack(nil).Retry(testPolicy(1)).Quota(QuotaOptions{}))

	if _, _, _, err := get(t, c, spent.URL); err != nil {
		t.Fatal(err)
	}
	_, _, _, err := get(t, c, spent.URL)
	if rl, isRL := sdk.AsRateLimited(err); !isRL || rl.Limiter != "quota:"+spent.host() {
		t.Fatalf("spent host: %v, want its quota's refusal", err)
	}
	for _, s := range []*server{other, silent, other, silent} {
		if code, _, _, err := get(t, c, s.URL); err != nil || code != 200 {
			t.Errorf("%s: %d, %v", s.host(), code, err)
		}
	}
}

// Inside the retry loop a quota refusal is a self-imposed refusal like any
// limiter's: retried at its hint (capped by MaxDelay), no charge to the
// retry budget, no evidence for the breaker.
func TestQuotaRefusalInsideRetries(t *testing.T) { synctest.Test(t, testQuotaRefusalInsideRetries) }

func testQuotaRefusalInsideRetries(t *testing.T) {
	toThePresent()
	srv := serve(t, reply(200, "", "X-RateLimit-Remaining", "0", "X-RateLimit-Reset", strconv.FormatInt(time.Now().Add(time.Hour).Unix(), 10)))
	p := testPolicy(3)
	p.Budget = sdk.NewRetryBudget(0.1, 10)
	p.Breaker = sdk.NewBreaker(sdk.BreakerOptions{FailureThreshold: 1})
	c := build(t, NewStack(nil).Retry(p).Quota(QuotaOptions{}))
	if _, _, _, err := get(t, c, srv.URL); err != nil {
		t.Fatal(err)
	}
	tokens := p.Budget.Tokens()

	_, _, res, err := get(t, c, srv.URL)
	if !errors.Is(err, ErrQuotaExhausted) || res.Stop != sdk.StopAttemptsExhausted {
		t.Fatalf("err %v, stop %v; want the quota's refusal after every attempt", err, res.Stop)
	}
	for i, a := range res.Attempts {
		// The reset is an hour from the first request; each retry waits
		// MaxDelay of it.
		hint, _ := a.Verdict().RetryAfter()
		if want := time.Hour - time.Duration(i)*maxDelay; !a.SelfImposed() || hint != want || (i < 2 && a.Delay() != maxDelay) {
			t.Errorf("attempt %d: %v, want self-imposed, hinting %v, retried after MaxDelay", i+1, a, want)
		}
	}
	if srv.hits.Load() != 1 || p.Budget.Tokens() != tokens || p.Breaker.State(time.Now()) != sdk.BreakerClosed {
		t.Errorf("%d requests, budget %v -> %v, breaker %v; want 1, untouched, closed", srv.hits.Load(), tokens, p.Budget.Tokens(), p.Breaker.State(time.Now()))
	}
}

// Concurrent attempts count against the allowance as they go, so a burst
// does not all spend the last unit.
func TestQuotaCountsAttemptsInFlight(t *testing.T) { synctest.Test(t, testQuotaCountsAttemptsInFlight) }

func testQuotaCountsAttemptsInFlight(t *testing.T) {
	release := make(chan struct{})
	srv := serve(t, reply(200, "", "RateLimit-Remaining", "2", "RateLimit-Reset", "60"), func(w http.ResponseWriter, r *http.Request) {
		<-release
		reply(200, "", "RateLimit-Remaining", "0", "RateLimit-Reset", "60")(w, r)
	})
	var once sync.Once
	letGo := func() { once.Do(func() { close(release) }) }
	t.Cleanup(letGo) // before the server closes: cleanups run last first
	c := build(t, NewStack(nil).Retry(testPolicy(1)).Quota(QuotaOptions{}))
	if _, _, _, err := get(t, c, srv.URL); err != nil {
		t.Fatal(err)
	}
	results := make(chan error, 5)
	for range 5 {
		go func() {
			_, _, _, err := do(t, c, mustRequest(t, context.Background(), http.MethodGet, srv.URL, nil))
			results <- err
		}()
	}
	refused := 0
	for range 3 { // two go out and wait; three are refused at once
		select {
		case err := <-results:
			if sdk.IsRateLimited(err) {
				refused++
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("%d refused; the rest went out (%d requests sent)", refused, srv.hits.Load())
		}
	}
	letGo()
	for range 2 {
		if err := <-results; err != nil {
			t.Errorf("admitted request: %v", err)
		}
	}
	if refused != 3 || srv.hits.Load() != 3 {
		t.Errorf("%d refused, %d requests sent; want 3 refused and 1+2 sent", refused, srv.hits.Load())
	}
}

// An attempt the quota let through and a limiter further in refused never
// went out, so it is given back to the allowance.
func TestQuotaGivesBackAttemptsRefusedFurtherIn(t *testing.T) {
	synctest.Test(t, testQuotaGivesBackAttemptsRefusedFurtherIn)
}

func testQuotaGivesBackAttemptsRefusedFurtherIn(t *testing.T) {
	srv := serve(t, reply(200, "", "RateLimit-Remaining", "1", "RateLimit-Reset", "60"))
	l := limit.Concurrency(1)
	c := build(t, NewStack(nil).Retry(testPolicy(1)).Quota(QuotaOptions{}).Limit(l))
	if _, _, _, err := get(t, c, srv.URL); err != nil {
		t.Fatal(err)
	}
	held, _ := l.Acquire(context.Background())
	for range 3 {
		_, _, _, err := get(t, c, srv.URL)
		if rl, isRL := sdk.AsRateLimited(err); !isRL || rl.Limiter != "concurrency" {
			t.Fatalf("with the bulkhead full: %v, want its refusal, not the quota's", err)
		}
	}
	held.Release()
	if code, _, _, err := get(t, c, srv.URL); err != nil || code != 200 || srv.hits.Load() != 2 {
		t.Errorf("the last unit of the allowance: %d, %v, %d requests", code, err, srv.hits.Load())
	}
}
