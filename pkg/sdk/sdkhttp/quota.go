package sdkhttp

import (
	"errors"
	"math"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/egressd/egressd/pkg/sdk"
)

// ErrQuotaExhausted is the cause the Quota step's refusals wrap: the
// *sdk.RateLimitedError matches it with errors.Is, as well as
// sdk.ErrRateLimited.
var ErrQuotaExhausted = errors.New("published quota exhausted")

// QuotaOptions configure the Quota step.
//
// The allowance a host publishes is in force until its reset time. While it
// is, each attempt the step lets through counts against it, so concurrent
// requests do not all spend the last unit; each response's headers replace
// the count with the host's own. A response that publishes a remaining
// allowance without a reset time changes nothing, because nothing says
// when a refusal would end - the host's 429 and Retry-After take over from
// there. When both header families are present, the one with less left
// wins. Epoch reset times are read on this host's clock, so a skewed clock
// refuses for longer, or shorter, than the host meant.
//
// State is kept per host for the hosts that publish something, at most
// 1024 of them with an allowance or a Retry-After in force; beyond that,
// further hosts are not guarded until one expires.
type QuotaOptions struct {
	// Reserve is the allowance kept back: attempts to a host are refused
	// while the remaining allowance it published is at or below Reserve.
	// Zero, the default, spends the whole allowance and never goes past
	// it; raise it to leave room for other clients of the same quota.
	// Negative is an error.
	Reserve int
}

func (o QuotaOptions) problems() []string {
	if o.Reserve < 0 {
		return []string{"Quota.Reserve " + strconv.Itoa(o.Reserve) + " must not be negative"}
	}
	return nil
}

// maxQuotaHosts bounds the hosts a Quota step remembers.
const maxQuotaHosts = 1024

// quotaLayer refuses attempts to a host whose published allowance is spent.
type quotaLayer struct {
	reserve int64
	next    http.RoundTripper

	mu    sync.Mutex
	hosts map[string]*hostQuota
}

func newQuotaLayer(o QuotaOptions, next http.RoundTripper) *quotaLayer {
	return &quotaLayer{reserve: int64(o.Reserve), next: next, hosts: map[string]*hostQuota{}}
}

func (q *quotaLayer) RoundTrip(req *http.Request) (*http.Response, error) {
	host := hostKey(req.URL)
	counted, wait, ok := q.admit(host, time.Now())
	if !ok {
		closeRequestBody(req)
		return nil, &sdk.RateLimitedError{Limiter: "quota:" + host, RetryAfter: wait, Err: ErrQuotaExhausted}
	}
	resp, err := q.next.RoundTrip(req)
	if err != nil {
		if !counted.IsZero() && sdk.IsRateLimited(err) {
			q.giveBack(host, counted) // refused further in: it never went out
		}
		return nil, err
	}
	q.observe(host, resp.StatusCode, resp.Header, time.Now())
	return resp, nil
}

// admit decides an attempt to host at now. counted is the reset time of the
// allowance the attempt was counted against, zero when none was in force.
func (q *quotaLayer) admit(host string, now time.Time) (counted time.Time, wait time.Duration, ok bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	h := q.hosts[host]
	if h == nil {
		return time.Time{}, 0, true
	}
	if h.expired(now) {
		delete(q.hosts, host)
		return time.Time{}, 0, true
	}
	return h.admit(now, q.reserve)
}

// giveBack returns an attempt counted against the allowance that ends at
// reset, if that allowance is still the one in force.
func (q *quotaLayer) giveBack(host string, reset time.Time) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if h := q.hosts[host]; h != nil && h.reset.Equal(reset) {
		h.remaining++
	}
}

func (q *quotaLayer) observe(host string, status int, hdr http.Header, now time.Time) {
	u, ok := readQuota(status, hdr, now)
	if !ok {
		return // nothing published: what was, stands
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	h := q.hosts[host]
	if h == nil {
		var fresh hostQuota
		if fresh.apply(u); fresh.expired(now) {
			return
		}
		if len(q.hosts) >= maxQuotaHosts {
			for k, v := range q.hosts {
				if v.expired(now) {
					delete(q.hosts, k)
				}
			}
			if len(q.hosts) >= maxQuotaHosts {
				return // full of live entries: this host goes unguarded
			}
		}
		h = &hostQuota{}
		q.hosts[host] = h
	}
	h.apply(u)
}

// hostQuota is what one host has published. Its methods take the instant as
// an argument and read no clock.
type hostQuota struct {
	remaining int64
	reset     time.Time // the allowance is in force before this
	blocked   time.Time // a Retry-After: refuse everything before this
}

// admit decides an attempt at now, with reserve kept back: go, counting the
// attempt against the allowance in force (counted is its reset time, zero
// when none is), or the time until a refusal ends.
func (h *hostQuota) admit(now time.Time, reserve int64) (counted time.Time, wait time.Duration, ok bool) {
	if now.Before(h.blocked) {
		return time.Time{}, h.blocked.Sub(now), false
	}
	if !now.Before(h.reset) {
		return time.Time{}, 0, true
	}
	if h.remaining <= reserve {
		return time.Time{}, h.reset.Sub(now), false
	}
	h.remaining--
	return h.reset, 0, true
}

// expired reports whether h refuses nothing from now on.
func (h *hostQuota) expired(now time.Time) bool {
	return !now.Before(h.reset) && !now.Before(h.blocked)
}

// quotaUpdate is what one response published.
type quotaUpdate struct {
	allowance bool // remaining and reset are set
	remaining int64
	reset     time.Time
	block     bool // blocked is set
	blocked   time.Time
}

// apply replaces what h knows with what u says; what u does not say stands.
func (h *hostQuota) apply(u quotaUpdate) {
	if u.allowance {
		h.remaining, h.reset = u.remaining, u.reset
	}
	if u.block {
		h.blocked = u.blocked
	}
}

// readQuota reads what a response of status with headers hdr published at
// now; ok is false when it published nothing. Retry-After counts on a
// status of 400 or more only: on a redirect it means something else.
func readQuota(status int, hdr http.Header, now time.Time) (u quotaUpdate, ok bool) {
	u.remaining, u.reset, u.allowance = published(hdr, now)
	if status >= http.StatusBadRequest {
		if d, ok := ParseRetryAfter(hdr.Get("Retry-After"), now); ok {
			u.blocked, u.block = addSaturating(now, d), true
		}
	}
	return u, u.allowance || u.block
}

// published returns the remaining allowance and its reset time from
// either header family, or the one with less left when both are present.
func published(hdr http.Header, now time.Time) (remaining int64, reset time.Time, ok bool) {
	if r, ok1 := parseRemaining(hdr.Get("RateLimit-Remaining")); ok1 {
		if d, ok2 := parseSeconds(hdr.Get("RateLimit-Reset")); ok2 {
			remaining, reset, ok = r, addSaturating(now, d), true
		}
	}
	if r, ok1 := parseRemaining(hdr.Get("X-RateLimit-Remaining")); ok1 {
		if t, ok2 := parseXReset(hdr.Get("X-RateLimit-Reset"), now); ok2 {
			if !ok || r < remaining || (r == remaining && t.After(reset)) {
				remaining, reset, ok = r, t, true
			}
		}
	}
	return remaining, reset, ok
}

// firstItem returns the first member of a list value ("10, 10;w=1"), with
// its parameters cut off.
func firstItem(s string) string {
	if i := strings.IndexAny(s, ",;"); i >= 0 {
		s = s[:i]
	}
	return strings.TrimSpace(s)
}

// parseRemaining reads a remaining allowance; a negative one is zero.
func parseRemaining(s string) (int64, bool) {
	n, err := strconv.ParseInt(firstItem(s), 10, 64)
	if err != nil {
		return 0, false
	}
	return max(n, 0), true
}

// parseNumber reads a non-negative, finite number.
func parseNumber(s string) (float64, bool) {
	f, err := strconv.ParseFloat(firstItem(s), 64)
	if err != nil || !(f >= 0) || math.IsInf(f, 0) {
		return 0, false
	}
	return f, true
}

// parseSeconds reads a delay in seconds (RateLimit-Reset).
func parseSeconds(s string) (time.Duration, bool) {
	f, ok := parseNumber(s)
	if !ok {
		return 0, false
	}
	return seconds(f), true
}

// Thresholds above which an X-RateLimit-Reset is a Unix time rather than
// delay seconds: 1e9 seconds is 2001, and no window is 31 years long; 1e12
// is 2001 again, in milliseconds.
const (
	epochSeconds      = 1e9
	epochMilliseconds = 1e12
)

// parseXReset reads an X-RateLimit-Reset at now: delay seconds, or a Unix
// time in seconds (above 1e9) or milliseconds (above 1e12).
func parseXReset(s string, now time.Time) (time.Time, bool) {
	f, ok := parseNumber(s)
	switch {
	case !ok:
		return time.Time{}, false
	case f > epochMilliseconds:
		return time.UnixMilli(int64(min(f, math.MaxInt64/2))), true
	case f > epochSeconds:
		sec, frac := math.Modf(f)
		return time.Unix(int64(sec), int64(frac*1e9)), true
	}
	return addSaturating(now, seconds(f)), true
}

// addSaturating is t.Add(d) for a non-negative d that may be huge.
func addSaturating(t time.Time, d time.Duration) time.Time {
	const far = 100 * 365 * 24 * time.Hour
	return t.Add(min(d, far))
}

// hostKey names the host a request goes to: host and port, lower case,
// the scheme's default port left out.
func hostKey(u *url.URL) string {
	host := strings.ToLower(u.Host)
	if p := u.Port(); (p == "80" && u.Scheme == "http") || (p == "443" && u.Scheme == "https") {
		host = strings.TrimSuffix(host, ":"+p)
	}
	return host
}
