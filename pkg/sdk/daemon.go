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

// How long the daemon's answer is reused for the same destination: long
// enough that a refusal storm does not become a storm of questions to the
// daemon, short enough that a limit lifted is seen at once. Only answers
// are kept. A question that failed - the attempt's context ended, the
// socket refused or is missing - says nothing about the refusal and is
// asked again next time: a missing daemon fails at connect() on a local
// socket, about what the refused connect() that led here cost, and such
// questions come no faster than the policy lets attempts fail.
//
// A daemon that takes the question and does not answer (stopped, deadlocked)
// is the exception: waiting for it costs the attempt its deadline, or with
// none the call never returns. A question gets askTimeout, whatever the
// client's Timeout and the caller's deadline: the daemon answers from
// memory over a local socket, in tens of microseconds, but names the rule
// under the datapath's table lock, which a reload of 100,000 rules holds
// for about a second (docs/bench.md); a refusal then must still be told
// throttled, so 2s. One that was not answered in time stops the
// questions, to any destination, for unansweredFor, so that a refusal storm
// does not wait on each refusal; those refusals stay Permanent, as they
// would after the wait.
const (
	attributedFor   = 100 * time.Millisecond
	unattributedFor = time.Second
	askTimeout      = 2 * time.Second
	unansweredFor   = time.Second
)

// DaemonAttributor asks the local egressd, through c (nil: the default
// socket), whether an EPERM from connect() was its refusal. Yes makes the
// attempt a self-imposed refusal naming the rule, with the kernel's retry
// hint (time to the next token or window segment; none for concurrency).
// No, or no daemon, leaves it Permanent: a firewall says EPERM too.
// Rules that refuse with another errno are not attributed.
func DaemonAttributor(c *control.Client) Attributor {
	if c == nil {
		c = &control.Client{}
	}
	return newDaemonAttributor(c, realClock{}).attribute
}

func newDaemonAttributor(c *control.Client, clk clock) *daemonAttributor {
	return &daemonAttributor{client: c, clock: clk, cache: map[netip.AddrPort]attribution{}}
}

// attribution is the daemon's answer about a destination.
type attribution struct {
	rule    string    // "": not the daemon's refusal
	retryAt time.Time // when the kernel expects a permit back; zero: no hint
	until   time.Time // when to ask again
}

// askingProcess is the pid that asks about the caller's own refusals: the
// daemon takes it from the socket's peer, in its own pid namespace, where
// a containerised service's os.Getpid() names another process.
const askingProcess = 0

type daemonAttributor struct {
	client *control.Client
	clock  clock
	mu     sync.Mutex
	cache  map[netip.AddrPort]attribution
	quiet  time.Time // until then the daemon is not asked: it did not answer
}

func (a *daemonAttributor) attribute(ctx context.Context, err error) (*RateLimitedError, bool) {
	dest, ok := refusedDial(err)
	if !ok {
		return nil, false
	}
	now := a.clock.Now()
	a.mu.Lock()
	cached, hit := a.cache[dest]
	quiet := now.Before(a.quiet)
	a.mu.Unlock()
	if !hit || now.After(cached.until) {
		if quiet {
			return nil, false
		}
		qctx, cancel := a.clock.WithDeadline(ctx, now.Add(askTimeout))
		ans, qerr := a.client.Attribute(qctx, askingProcess, dest)
		cancel()
		if qerr != nil {
			if ctx.Err() == nil && errors.Is(qerr, context.DeadlineExceeded) { // the daemon's silence, not the caller's end
				a.mu.Lock()
				a.quiet = a.clock.Now().Add(unansweredFor)
				a.mu.Unlock()
			}
			return nil, false
		}
		now = a.clock.Now() // the question took time; the hint counts from its answer
		cached = attribution{until: now.Add(unattributedFor)}
		if ans.Refused {
			cached = attribution{rule: ans.Rule, until: now.Add(attributedFor)}
			if ans.RetryAfterSeconds > 0 {
				cached.retryAt = now.Add(time.Duration(ans.RetryAfterSeconds * float64(time.Second)))
			}
		}
		a.mu.Lock()
		if len(a.cache) > 1024 { // bounded: destinations come and go
			clear(a.cache)
		}
		a.cache[dest] = cached
		a.mu.Unlock()
	}
	if cached.rule == "" {
		return nil, false
	}
	var retryAfter time.Duration
	if !cached.retryAt.IsZero() {
		// The hint is the time left, not the time there was when asked:
		// a floor of a nanosecond keeps "a permit is due now" from
		// reading as "no hint".
		retryAfter = max(cached.retryAt.Sub(now), time.Nanosecond)
	}
	return &RateLimitedError{Limiter: cached.rule, RetryAfter: retryAfter, Err: err}, true
}

// refusedDial returns the destination of a dial that failed with EPERM.
func refusedDial(err error) (netip.AddrPort, bool) {
	var op *net.OpError
	if !errors.As(err, &op) || op.Op != "dial" || !errors.Is(err, syscall.EPERM) {
		return netip.AddrPort{}, false
	}
	tcp, ok := op.Addr.(*net.TCPAddr)
	if !ok {
		return netip.AddrPort{}, false
	}
	ap := tcp.AddrPort()
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()), true
}
