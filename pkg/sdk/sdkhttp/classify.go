package sdkhttp

import (
	"errors"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/egressd/egressd/pkg/sdk"
	"github.com/egressd/egressd/pkg/verdict"
)

// Defaults returns sdk.HTTPDefaults with sdk.DaemonAttributor(nil) in its
// classifier: an EPERM from a dial is put to the local egressd, over its
// default socket, and becomes a self-imposed refusal naming the rule when
// the daemon refused it; otherwise (a firewall, no daemon) it stays
// Permanent. The question is asked only on an EPERM, and its answer is
// cached briefly per destination. For another socket, set
//
//	p.Classifier = p.Classifier.WithAttributor(sdk.DaemonAttributor(&control.Client{Socket: path}))
//
// The Retry step extends the classifier with Classifier itself; a policy
// used with sdk.Run directly can be given it the same way.
func Defaults() *sdk.Policy {
	p := sdk.HTTPDefaults()
	p.Classifier = p.Classifier.WithAttributor(sdk.DaemonAttributor(nil))
	return p
}

// Classifier returns c (nil: the default classifier) with one rule added
// after its own: a 503 with a Retry-After is Throttled, honouring it - the
// server is shedding load, not failing, so it is no evidence against it and
// takes the throttled curve. Everything else about an *sdk.StatusError is
// sdk.DefaultVerdict's: 429 Throttled; 408, 500, 502, 503 and 504
// Transient; any other code Permanent; a Retry-After on a retryable code is
// its hint.
func Classifier(c *sdk.Classifier) *sdk.Classifier {
	return c.OnRule(sheddingRule)
}

func sheddingRule(err error) (verdict.Verdict, bool) {
	var se *sdk.StatusError
	if !errors.As(err, &se) || se.Code != http.StatusServiceUnavailable {
		return verdict.Verdict{}, false
	}
	d, ok := ParseRetryAfter(se.RetryAfter, time.Now())
	if !ok {
		return verdict.Verdict{}, false // Transient, by the defaults
	}
	return verdict.New(verdict.Throttled).WithRetryAfter(d), true
}

// ParseRetryAfter reads a Retry-After value at now: delay seconds, or an
// HTTP-date in any of the three forms of RFC 9110 (a date already past means
// retry now). ok is false for an empty or malformed value.
func ParseRetryAfter(s string, now time.Time) (d time.Duration, ok bool) {
	s = strings.TrimSpace(s)
	if s == "" {
		return 0, false
	}
	if secs, err := strconv.ParseUint(s, 10, 64); err == nil {
		return seconds(float64(secs)), true
	}
	if t, err := http.ParseTime(s); err == nil {
		return max(t.Sub(now), 0), true
	}
	return 0, false
}

// seconds converts a non-negative number of seconds to a Duration,
// saturating rather than overflowing.
func seconds(s float64) time.Duration {
	ns := s * float64(time.Second)
	if ns >= float64(math.MaxInt64) { // 2^63 as a float64: one past the largest
		return math.MaxInt64
	}
	return time.Duration(ns)
}
