package sdkgrpc

import (
	"errors"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/egressd/egressd/pkg/edge"
	"github.com/egressd/egressd/pkg/sdk"
	"github.com/egressd/egressd/pkg/verdict"
)

// PushbackKey is the trailer in which a server tells a client when to
// retry, in whole milliseconds (gRPC's retry design, A6): a non-negative
// value is a delay to honour, a negative or malformed one means "do not
// retry". It is edge.PushbackKey, which package servegrpc sends.
const PushbackKey = edge.PushbackKey

// Edge metadata: sdk.CriticalityHeader and sdk.TimeoutHeader in the lower
// case gRPC metadata keys are, with the same values.
var (
	criticalityKey = strings.ToLower(sdk.CriticalityHeader)
	timeoutKey     = strings.ToLower(sdk.TimeoutHeader)
)

// StatusError is a gRPC status error an attempt came to, with the retry
// pushback the server sent in its trailers. It is what the client
// interceptors hand the executor's classifier, and it keeps the status:
// status.Code and status.FromError read it, through the *sdk.StopError a
// failed call returns too.
type StatusError struct {
	// Err is the status error the call returned.
	Err error
	// Pushback is the PushbackKey trailer as the server sent it; empty
	// when it sent none.
	Pushback string
	// dial is a refused dial's EPERM, for a call that reached no
	// connection: what a kernel refusal surfaces as behind UNAVAILABLE.
	dial error
}

func (e *StatusError) Error() string { return e.Err.Error() }

// Unwrap returns the status error and, behind an UNAVAILABLE, the dial
// error that caused it when that was an EPERM, so that an sdk.Attributor
// can claim it.
func (e *StatusError) Unwrap() []error {
	if e.dial != nil {
		return []error{e.Err, e.dial}
	}
	return []error{e.Err}
}

// GRPCStatus returns the status.
func (e *StatusError) GRPCStatus() *status.Status { return status.Convert(e.Err) }

// Classifier returns c (nil: the default classifier) with gRPC's status
// codes classified after its own rules, as gRPC's retry design reads them:
//
//   - RESOURCE_EXHAUSTED is Throttled: the server (or a proxy) is shedding
//     load. A pushback trailer is its hint, honoured verbatim;
//   - UNAVAILABLE is Transient - the one code gRPC calls safe to retry -
//     with the pushback as its hint, if any;
//   - DEADLINE_EXCEEDED that the server sent is Transient, like a gateway
//     timeout; one the attempt's own deadline caused never gets here: the
//     executor reads it first, as an attempt timeout (Transient) or the
//     call's deadline (the end of the call);
//   - a pushback that is negative or malformed makes either Permanent;
//   - every other code is Permanent: the others say the request is wrong
//     (INVALID_ARGUMENT, NOT_FOUND, ...), or want a retry at a higher level
//     than one call (ABORTED), or report a bug (INTERNAL, UNKNOWN,
//     DATA_LOSS);
//   - an EPERM from the connection's dial that the classifier's Attributor
//     did not claim is Permanent, as in sdk.DefaultVerdict: a firewall says
//     EPERM too. One it claims is a self-imposed refusal before any rule.
func Classifier(c *sdk.Classifier) *sdk.Classifier { return c.OnRule(statusRule) }

func statusRule(err error) (verdict.Verdict, bool) {
	if errors.Is(err, syscall.EPERM) {
		return verdict.New(verdict.Permanent), true
	}
	st, ok := status.FromError(err)
	if !ok {
		return verdict.Verdict{}, false
	}
	var v verdict.Verdict
	switch st.Code() {
	case codes.OK:
		return verdict.Verdict{}, true
	case codes.ResourceExhausted:
		v = verdict.New(verdict.Throttled)
	case codes.Unavailable, codes.DeadlineExceeded:
		v = verdict.New(verdict.Transient)
	default:
		return verdict.New(verdict.Permanent), true
	}
	var se *StatusError
	if !errors.As(err, &se) || se.Pushback == "" {
		return v, true
	}
	d, ok := ParsePushback(se.Pushback)
	if !ok {
		return verdict.New(verdict.Permanent), true // the server said: do not retry
	}
	return v.WithRetryAfter(d), true
}

// ParsePushback reads a PushbackKey value: ok is false for a negative or
// malformed one, which means "do not retry" (edge.ParsePushback).
func ParsePushback(s string) (time.Duration, bool) { return edge.ParsePushback(s) }

// Defaults returns sdk.HTTPDefaults (a 10s attempt timeout, a 30s deadline,
// retries, a budget and a breaker of its own) with sdk.DaemonAttributor(nil)
// in its classifier, so that a connection egressd refused is a
// self-imposed refusal naming the rule. The interceptors add Classifier.
func Defaults() *sdk.Policy {
	p := sdk.HTTPDefaults()
	p.Classifier = p.Classifier.WithAttributor(sdk.DaemonAttributor(nil))
	return p
}
