package sdk

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"os"
	"sync"
	"syscall"
	"time"

	"github.com/egressd/egressd/pkg/control"
)

// How long an attribution is reused for the same destination: long enough
// that a refusal storm does not become a storm of questions to the daemon,
// short enough that a limit lifted is seen at once.
const (
	attributedFor   = 100 * time.Millisecond
	unattributedFor = time.Second
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
	a := &daemonAttributor{client: c, pid: os.Getpid(), cache: map[netip.AddrPort]attribution{}}
	return a.attribute
}

type attribution struct {
	rule       string
	retryAfter time.Duration
	until      time.Time
}

type daemonAttributor struct {
	client *control.Client
	pid    int
	mu     sync.Mutex
	cache  map[netip.AddrPort]attribution
}

func (a *daemonAttributor) attribute(ctx context.Context, err error) (*RateLimitedError, bool) {
	dest, ok := refusedDial(err)
	if !ok {
		return nil, false
	}
	now := time.Now()
	a.mu.Lock()
	cached, hit := a.cache[dest]
	a.mu.Unlock()
	if !hit || now.After(cached.until) {
		cached = attribution{until: now.Add(unattributedFor)}
		if ans, err := a.client.Attribute(ctx, a.pid, dest); err == nil && ans.Refused {
			cached = attribution{
				rule:       ans.Rule,
				retryAfter: time.Duration(ans.RetryAfterSeconds * float64(time.Second)),
				until:      now.Add(attributedFor),
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
	return &RateLimitedError{Limiter: cached.rule, RetryAfter: cached.retryAfter, Err: err}, true
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
