package serve

import "time"

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

//go:generate go tool stringer -type=Outcome -linecomment

// Outcome is what became of a request a policy handled. Its String is the
// label value metrics use.
type Outcome uint8

const (
	// Admitted: the request got a permit and went on to the handler.
	Admitted Outcome = iota // admitted
	// Refused: the limiter said no, at once or after a wait in its queue
	// (the queue was full, or a newer caller took its place), or the
	// policy holds as many partitions as it may.
	Refused // refused
	// Cancelled: the request's context ended - the client went away, or
	// the deadline it sent passed - while it waited for a permit.
	Cancelled // cancelled
	// Failed: no decision could be had (a shared limiter's Redis did not
	// answer, under FailureMode Throw), or the partition's limiter could
	// not be made.
	Failed // failed

	outcomeLen = iota // sentinel, untyped for stringer; keep last.
)

// Valid reports whether o is one of the outcomes, so that an adapter can
// range over them: for o := Outcome(0); o.Valid(); o++.
func (o Outcome) Valid() bool { return o < outcomeLen }

//go:generate go tool stringer -type=Header -linecomment

// Header is one of the edge headers the middleware reads. Its String, the
// header's short name, is the label value metrics use.
type Header uint8

const (
	// HeaderCriticality is edge.CriticalityHeader.
	HeaderCriticality Header = iota // criticality
	// HeaderTimeout is edge.TimeoutHeader.
	HeaderTimeout // timeout

	headerLen = iota // sentinel, untyped for stringer; keep last.
)

// Valid reports whether h is one of the headers.
func (h Header) Valid() bool { return h < headerLen }

//go:generate go tool stringer -type=HeaderResult -linecomment

// HeaderResult is what became of one edge header of one request. Its
// String is the label value metrics use.
type HeaderResult uint8

const (
	// HeaderMissing: the request did not have it. The criticality is the
	// configured default; the deadline is the server's own.
	HeaderMissing HeaderResult = iota // missing
	// HeaderAccepted: its value is in the request's context.
	HeaderAccepted // accepted
	// HeaderCapped: it asked for more than it may have - a criticality
	// above the ceiling, which was lowered to it, or a deadline later than
	// the one the request already had, which was kept.
	HeaderCapped // capped
	// HeaderMalformed: its value was none of the allowed ones, or it was
	// sent more than once; it was ignored, as if missing.
	HeaderMalformed // malformed

	headerResultLen = iota // sentinel, untyped for stringer; keep last.
)

// Valid reports whether r is one of the results.
func (r HeaderResult) Valid() bool { return r < headerResultLen }
