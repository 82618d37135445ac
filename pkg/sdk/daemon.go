package sdk

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"sync"
	"syscall"
	"time"

	"github.com/egressd/egressd/pkg/control"
)

// A "yes" is reused for the same destination for attributedFor, a "no"
// for unattributedFor: a refusal storm is not a storm of questions, and a
// lifted limit is seen at once. A question that got no answer is not
// cached. A question waits at most askTimeout, whatever the client's
// Timeout (a reload of 100,000 rules holds the lock the answer needs for
// about a second); one left unanswered stops all questions for
// unansweredFor. docs/sdk.md ("Kernel refusals") says why each.
const (
	attributedFor   = 100 * time.Millisecond
	unattributedFor = time.Second
	askTimeout      = 2 * time.Second
	unansweredFor   = time.Second
)

// DaemonAttributor asks the local egressd, through c (nil: the default
// socket), whether an EPERM from connect(), or from a UDP send (a QUIC
// dial through [sdkquic]), was its refusal. Yes makes the
// attempt a self-imposed refusal naming the rule, with the kernel's retry
// hint (time to the next token or window segment; none for concurrency).
// No, or no daemon, leaves it Permanent: a firewall says EPERM too.
// Rules that refuse with another errno are not attributed.
func DaemonAttributor(c *control.Client) Attributor {
	if c == nil {
		c = &control.Client{}
	}
	return newDaemonAttributor(c).attribute
}

func newDaemonAttributor(c *control.Client) *daemonAttributor {
	return &daemonAttributor{client: c, cache: map[flow]attribution{}, asking: map[flow]*question{}}
}

// attribution is the daemon's answer about a destination.
type attribution struct {
	rule      string    // "": not the daemon's refusal
	refusedAt time.Time // when the latest refusal was (as late as the answer allows)
	retryAt   time.Time // when the kernel expects a permit back; zero: no hint
	until     time.Time // when to ask again
}

// vouches reports whether the refusal a cached "yes" names may be the one
// of an attempt made at start (zero: not known): one made after it was
// refused by something else, unless it was made within attributedFor of
// it, which the cache lets pass so that a refusal storm's attempts do not
// each ask the daemon.
func (c attribution) vouches(start time.Time) bool {
	return start.IsZero() || !start.After(c.refusedAt.Add(attributedFor))
}

// question is one question to the daemon about a destination, which the
// refusals to it that come meanwhile wait for rather than ask again: a
// burst of refusals is one question, and one connection to the daemon.
type question struct {
	sent     time.Time
	done     chan struct{}
	answer   attribution
	answered bool
}

// askingProcess is the pid that asks about the caller's own refusals: the
// daemon takes it from the socket's peer, in its own pid namespace, where
// a containerised service's os.Getpid() names another process.
const askingProcess = 0

type daemonAttributor struct {
	client *control.Client
	mu     sync.Mutex
	cache  map[flow]attribution
	asking map[flow]*question
	quiet  time.Time // until then the daemon is not asked: it did not answer
}

// attribute claims err, an EPERM from connect() or a UDP send, for the
// daemon when the daemon refused this process's flow to its destination
// after the
// attempt was made, or the dial for an error marked WithDialStart (see
// vouches for a cached answer). A question in flight
// when the refusal came may not have seen it: one more is asked then.
func (a *daemonAttributor) attribute(ctx context.Context, err error) (*RateLimitedError, bool) {
	dest, ok := refusedFlow(err)
	if !ok || ctx.Err() != nil {
		return nil, false
	}
	start, _ := attemptStarted(ctx)
	if dialed, ok := dialStarted(err); ok {
		start = dialed
	}
	entered := time.Now()
	for range 2 {
		now := time.Now()
		a.mu.Lock()
		cached, hit := a.cache[dest]
		if hit && !now.After(cached.until) && (cached.rule == "" || cached.vouches(start)) {
			a.mu.Unlock()
			return cached.refusal(err, now)
		}
		if now.Before(a.quiet) {
			a.mu.Unlock()
			return nil, false
		}
		q := a.ask(dest)
		a.mu.Unlock()
		// The caller may give up first (its deadline shorter than the
		// question's): the question goes on, and its answer, or the
		// daemon's silence, serves the refusals after.
		select {
		case <-q.done:
		case <-ctx.Done():
			return nil, false
		}
		if !q.answered || q.answer.rule == "" {
			return nil, false
		}
		if start.IsZero() || !q.answer.refusedAt.Before(start) {
			return q.answer.refusal(err, time.Now())
		}
		if !q.sent.Before(entered) {
			return nil, false // asked after this refusal: the daemon's is older than the attempt
		}
	}
	return nil, false
}

// refusal is err attributed to the rule of c, a "yes", at now.
func (c attribution) refusal(err error, now time.Time) (*RateLimitedError, bool) {
	if c.rule == "" {
		return nil, false
	}
	var retryAfter time.Duration
	if !c.retryAt.IsZero() {
		// The hint is the time left, not the time there was when asked:
		// a floor of a nanosecond keeps "a permit is due now" from
		// reading as "no hint".
		retryAfter = max(c.retryAt.Sub(now), time.Nanosecond)
	}
	return &RateLimitedError{Limiter: c.rule, RetryAfter: retryAfter, Err: err}, true
}

// ask returns the question about dest in flight, or asks one, on a
// context of its own bounded by askTimeout: what the caller's ends does
// not end it. Call with a.mu held.
func (a *daemonAttributor) ask(dest flow) *question {
	if q := a.asking[dest]; q != nil {
		return q
	}
	q := &question{sent: time.Now(), done: make(chan struct{})}
	a.asking[dest] = q
	go func() {
		defer close(q.done)
		qctx, cancel := context.WithTimeout(context.Background(), askTimeout)
		ans, err := a.client.Attribute(qctx, askingProcess, dest.proto, dest.addr)
		silent := errors.Is(qctx.Err(), context.DeadlineExceeded)
		cancel()
		now := time.Now() // the question took time; the hint counts from its answer
		a.mu.Lock()
		defer a.mu.Unlock()
		delete(a.asking, dest)
		if err != nil {
			if silent {
				a.quiet = now.Add(unansweredFor)
			}
			return
		}
		q.answer, q.answered = attribution{until: now.Add(unattributedFor)}, true
		if ans.Refused {
			refusedAt := now.Add(-time.Duration(ans.SecondsAgo * float64(time.Second)))
			q.answer = attribution{rule: ans.Rule, refusedAt: refusedAt, until: now.Add(attributedFor)}
			if ans.RetryAfterSeconds > 0 {
				q.answer.retryAt = now.Add(time.Duration(ans.RetryAfterSeconds * float64(time.Second)))
			}
		}
		if len(a.cache) > 1024 { // bounded: destinations come and go
			clear(a.cache)
		}
		a.cache[dest] = q.answer
	}()
	return q
}

// flow is what a refusal refused: a protocol, as the control API names it,
// to an address.
type flow struct {
	proto string
	addr  netip.AddrPort
}

// refusedFlow returns the flow whose opening failed with err, an EPERM: a
// TCP or UDP dial (the net package's connect()), or a UDP write (a send
// that would have opened a flow).
func refusedFlow(err error) (flow, bool) {
	var op *net.OpError
	if !errors.As(err, &op) || !errors.Is(err, syscall.EPERM) {
		return flow{}, false
	}
	var f flow
	switch addr := op.Addr.(type) {
	case *net.TCPAddr:
		if op.Op != "dial" {
			return flow{}, false
		}
		f = flow{"tcp", addr.AddrPort()}
	case *net.UDPAddr:
		if op.Op != "dial" && op.Op != "write" {
			return flow{}, false
		}
		f = flow{"udp", addr.AddrPort()}
	default:
		return flow{}, false
	}
	f.addr = netip.AddrPortFrom(f.addr.Addr().Unmap(), f.addr.Port())
	return f, true
}
