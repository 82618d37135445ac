package serve

import (
	"strconv"
	"time"
)

// Observer is told what the middleware does, for metrics. Package
// servemetrics implements it with Prometheus. Methods are called from the
// goroutines serving requests, concurrently; they should be cheap and must
// not block.
type Observer interface {
	// Policy returns the observer of the policy named policy. New calls
	// it once per policy, so that an implementation can look its series
	// up once rather than on every request.
	Policy(policy string) PolicyObserver
	// OnHeader is called twice per request whose edge headers the
	// middleware reads, once per header, with what became of it.
	OnHeader(h Header, r HeaderResult)
}

// PolicyObserver is told what one policy does.
type PolicyObserver interface {
	// OnRequest is called once per request the policy handles, with its
	// outcome and how long admission took: time spent queued, and for a
	// shared limiter the round trip to Redis.
	OnRequest(o Outcome, admission time.Duration)
	// OnPartitions is called with how many partitions the policy holds
	// each time a partition is made or evicted. It is called with the
	// partitioned limiter's lock held.
	OnPartitions(n int)
}

// Outcome is what became of a request a policy handled.
type Outcome uint8

const (
	// Admitted: the request got a permit and went on to the handler.
	Admitted Outcome = iota
	// Refused: the limiter said no, at once or after a wait in its queue
	// (the queue was full, or a newer caller took its place), or the
	// policy holds as many partitions as it may.
	Refused
	// Cancelled: the request's context ended - the client went away, or
	// the deadline it sent passed - while it waited for a permit.
	Cancelled
	// Failed: no decision could be had (a shared limiter's Redis did not
	// answer, under FailureMode Throw), or the partition's limiter could
	// not be made.
	Failed

	outcomeLen // sentinel; keep last.
)

var outcomeNames = [outcomeLen]string{
	Admitted:  "admitted",
	Refused:   "refused",
	Cancelled: "cancelled",
	Failed:    "failed",
}

// String returns the outcome's name, the label value metrics use.
func (o Outcome) String() string {
	if o < outcomeLen {
		return outcomeNames[o]
	}
	return "Outcome(" + strconv.Itoa(int(o)) + ")"
}

// Valid reports whether o is one of the outcomes, so that an adapter can
// range over them: for o := Outcome(0); o.Valid(); o++.
func (o Outcome) Valid() bool { return o < outcomeLen }

// Header is one of the edge headers the middleware reads.
type Header uint8

const (
	// HeaderCriticality is edge.CriticalityHeader.
	HeaderCriticality Header = iota
	// HeaderTimeout is edge.TimeoutHeader.
	HeaderTimeout

	headerLen // sentinel; keep last.
)

var headerNames = [headerLen]string{
	HeaderCriticality: "criticality",
	HeaderTimeout:     "timeout",
}

// String returns the header's short name, the label value metrics use.
func (h Header) String() string {
	if h < headerLen {
		return headerNames[h]
	}
	return "Header(" + strconv.Itoa(int(h)) + ")"
}

// Valid reports whether h is one of the headers.
func (h Header) Valid() bool { return h < headerLen }

// HeaderResult is what became of one edge header of one request.
type HeaderResult uint8

const (
	// HeaderMissing: the request did not have it. The criticality is the
	// configured default; the deadline is the server's own.
	HeaderMissing HeaderResult = iota
	// HeaderAccepted: its value is in the request's context.
	HeaderAccepted
	// HeaderCapped: it asked for more than it may have - a criticality
	// above the ceiling, which was lowered to it, or a deadline later than
	// the one the request already had, which was kept.
	HeaderCapped
	// HeaderMalformed: its value was none of the allowed ones, or it was
	// sent more than once; it was ignored, as if missing.
	HeaderMalformed

	headerResultLen // sentinel; keep last.
)

var headerResultNames = [headerResultLen]string{
	HeaderMissing:   "missing",
	HeaderAccepted:  "accepted",
	HeaderCapped:    "capped",
	HeaderMalformed: "malformed",
}

// String returns the result's name, the label value metrics use.
func (r HeaderResult) String() string {
	if r < headerResultLen {
		return headerResultNames[r]
	}
	return "HeaderResult(" + strconv.Itoa(int(r)) + ")"
}

// Valid reports whether r is one of the results.
func (r HeaderResult) Valid() bool { return r < headerResultLen }
