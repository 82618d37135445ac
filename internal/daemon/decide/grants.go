package decide

import (
	"math"
	"time"

	"github.com/egressd/egressd/pkg/shared"
)

// GrantsConfig is a rate share's settings.
type GrantsConfig struct {
	// Batch is how many permits are claimed at once: a small stretch of
	// the whole budget's rate, so an idle host holds little and a busy one
	// asks Redis a few times a second.
	Batch uint64
	// Window is a sliding window's length, 0 for a token bucket. A permit
	// claimed longer ago than that has stopped counting in the window, so
	// it is not handed back.
	Window time.Duration
	// Margin is how long before Window's end a claim stops being handed
	// back: at least the longest a tick can take.
	Margin time.Duration
	// Idle is how long a host goes without a connection or a refusal
	// before it hands its unspent permits back, but one.
	Idle time.Duration
	// RateWindow is how far back the rate a host claimed is measured, for
	// FailureMode throw to keep it.
	RateWindow time.Duration
	Mode       Mode
}

// GrantsObs is what the kernel shows of a rate share's rule.
type GrantsObs struct {
	// Granted and Spent are the rule's permits granted and spent since
	// it was made.
	Granted, Spent uint64
	Refused        uint64
	Live           int
}

// GrantsOp is what a tick asks of Redis.
type GrantsOp uint8

const (
	// Hold: enough unspent permits; nothing to do.
	Hold GrantsOp = iota
	// Claim N permits, then grant what came to the kernel.
	Claim
	// Return: take the unspent permits but Keep back from the kernel
	// (loader's Reclaim), then hand them to Redis.
	Return
)

// GrantsPlan is a tick's decision.
type GrantsPlan struct {
	Op   GrantsOp
	N    uint64 // Claim: permits to claim
	Keep uint64 // Return: unspent permits the kernel keeps
	base uint64 // Claim: the grant total the claim adds to
}

// GrantsKernel is how the kernel rule enforces the share.
type GrantsKernel struct {
	// Granted is the rule's grant total: the kernel admits while its
	// spent permits are below it.
	Granted uint64
	// PerSecond, when not 0, replaces the grant while Redis is
	// unreachable under FailureMode throw: a bucket of PerSecond a second
	// and Burst at once, the rate the host claimed lately.
	PerSecond, Burst uint32
	// Own, under FailureMode allow, puts the rule's own shape (the whole
	// budget) in place of the grant while Redis is unreachable.
	Own bool
	// Closed, under FailureMode deny, admits no new connection while
	// Redis is unreachable: the unspent permits are lost.
	Closed bool
}

// Grants is one host's share of a shared rate budget: permits claimed from
// Redis in batches ahead of demand and granted to the kernel, which admits
// a connection per permit; unspent ones go back when the host is idle. A
// permit reaches the kernel only after Redis gave it (and, when replicas
// are asked for, after they confirmed it). It is not safe for concurrent
// use.
type Grants struct {
	cfg GrantsConfig

	kernel GrantsKernel
	outage Outage
	claims []claim // recent claims, oldest first

	active             time.Time
	lastRefused, spent uint64

	// Counters: permits claimed and granted, handed back, and claimed but
	// not confirmed by replicas (never granted).
	claimed, returned, unconfirmed uint64
}

type claim struct {
	at  time.Time
	seg int64 // the window's segment Redis counted it in
	n   uint64
}

// NewGrants returns a share with nothing granted.
func NewGrants(cfg GrantsConfig, now time.Time) *Grants {
	return &Grants{cfg: cfg, active: now}
}

// Adopt starts the share from the kernel rule a previous daemon left: its
// unspent permits came from Redis and stay the kernel's.
func (g *Grants) Adopt(o GrantsObs) {
	g.kernel.Granted = o.Granted
	g.lastRefused, g.spent = o.Refused, o.Spent
}

// Inherit carries on from old, a share of the same budget: the permits
// granted are the kernel's still.
func (g *Grants) Inherit(old *Grants) {
	cfg := g.cfg
	*g = *old
	g.cfg = cfg
	g.claims = append([]claim(nil), old.claims...)
}

// Plan decides a tick: while the host is busy it keeps a batch granted
// ahead of demand, plus as many as were refused since the last tick;
// idle, it hands back its unspent permits but one, so that the next
// connection after an idle spell is not refused for want of a claim.
// While Redis is unreachable every tick claims: that is how a share finds
// it back.
func (g *Grants) Plan(o GrantsObs, now time.Time) GrantsPlan {
	refused := o.Refused - min(o.Refused, g.lastRefused)
	if refused > 0 || o.Live > 0 || o.Spent > g.spent {
		g.active = now
	}
	g.lastRefused, g.spent = o.Refused, o.Spent
	idle := now.Sub(g.active) >= g.cfg.Idle
	base := max(o.Granted, o.Spent)
	if g.outage.Failing() {
		// The kernel spent nothing from the grant while the fallback
		// was in force: grant from what it has spent.
		base = o.Spent
	}
	unspent := base - o.Spent
	switch {
	case g.outage.Failing():
	case idle && unspent > 1:
		return GrantsPlan{Op: Return, Keep: 1}
	case idle || unspent > g.cfg.Batch/2:
		return GrantsPlan{Op: Hold}
	}
	return GrantsPlan{Op: Claim, N: g.cfg.Batch + min(refused, g.cfg.Batch), base: base}
}

// Claimed takes Redis's answer to a Claim, or the error that stood for
// it. It returns how the kernel rule is to enforce the share now.
func (g *Grants) Claimed(p GrantsPlan, r shared.Claimed, err error, now time.Time) (GrantsKernel, Event) {
	if err != nil {
		return g.fail(err, now)
	}
	var ev Event
	if g.outage.Failing() {
		ev |= Recovered
	}
	g.outage = Outage{}
	got := uint64(r.Got)
	if !r.Confirmed && got > 0 {
		g.unconfirmed += got
		got, ev = 0, ev|Unconfirmed
	}
	g.claimed += got
	g.kernel = GrantsKernel{Granted: p.base + got}
	if got > 0 {
		g.claims = append(g.claims, claim{at: now, seg: r.Segment, n: got})
	}
	g.prune(now)
	return g.kernel, ev
}

// Reclaimed takes what the kernel gave back to a Return plan (taken
// permits, its grant now) and returns how many may go to Redis, and the
// window's segment of the oldest claim they came from (Return's bound).
// The kernel spends its grant oldest first and a Return keeps the oldest
// unspent, so the taken permits are those of the newest claims (a claim an
// earlier Return took from is below every claim since, and this Return
// takes no more than those). Under a sliding window only
// those claimed within the window go; the rest are dropped: they no
// longer count.
func (g *Grants) Reclaimed(taken, granted uint64, now time.Time) (n uint64, since int64) {
	g.kernel.Granted = granted
	g.prune(now)
	if g.cfg.Window == 0 {
		return taken, 0
	}
	for i := len(g.claims) - 1; i >= 0 && taken > 0; i-- {
		c := g.claims[i]
		k := min(taken, c.n)
		taken -= k
		if now.Sub(c.at) < g.cfg.Window-g.cfg.Margin {
			n, since = n+k, c.seg
		}
	}
	return n, since
}

// Returned takes Redis's answer to handing n permits back. A failure
// loses them (they stay spent in Redis), which is safe; it does not put
// the failure mode in force, the next claim will if Redis is away.
func (g *Grants) Returned(n uint64, err error) {
	if err == nil {
		g.returned += n
	}
}

// fail puts the failure mode in force.
func (g *Grants) fail(err error, now time.Time) (GrantsKernel, Event) {
	var ev Event
	if !g.outage.Failing() {
		ev = Failed
		g.outage.Since = now
		var n uint64
		for _, c := range g.claims {
			if now.Sub(c.at) <= g.cfg.RateWindow {
				n += c.n
			}
		}
		rate := uint32(max(1, math.Ceil(float64(n)/g.cfg.RateWindow.Seconds())))
		switch g.cfg.Mode {
		case KeepShare:
			g.kernel = GrantsKernel{Granted: g.kernel.Granted, PerSecond: rate, Burst: uint32(min(g.cfg.Batch, math.MaxUint32))}
		case Allow:
			g.kernel = GrantsKernel{Granted: g.kernel.Granted, Own: true}
		case Deny:
			g.kernel = GrantsKernel{Granted: g.kernel.Granted, Closed: true}
		}
	}
	g.outage.Err = err
	return g.kernel, ev
}

func (g *Grants) prune(now time.Time) {
	keep := max(g.cfg.Window, g.cfg.RateWindow)
	i := 0
	for i < len(g.claims) && now.Sub(g.claims[i].at) > keep {
		i++
	}
	g.claims = g.claims[i:]
}

// GrantsView is what the API and the metrics show of a rate share.
type GrantsView struct {
	Kernel                         GrantsKernel
	Outage                         Outage
	Claimed, Returned, Unconfirmed uint64
}

// View returns the share as it stands.
func (g *Grants) View() GrantsView {
	return GrantsView{Kernel: g.kernel, Outage: g.outage, Claimed: g.claimed, Returned: g.returned, Unconfirmed: g.unconfirmed}
}
