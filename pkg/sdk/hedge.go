package sdk

import (
	"context"
	"fmt"
	"math"
	"math/bits"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/egressd/egressd/pkg/verdict"
)

// HedgeOptions configure a Hedge.
type HedgeOptions struct {
	// Delay is how long an attempt runs before a hedge is sent, and how
	// long after it the next hedge is. With Percentile set it is the delay
	// used until the percentile has been learned; zero then means no
	// hedges until it has. Without Percentile it is required.
	Delay time.Duration
	// Percentile, if set, learns the delay online: the given quantile (in
	// (0, 1), e.g. 0.95) of the latencies of the recent first attempts of
	// this hedge's calls that came to OK, or below it when the latencies
	// show a slower mode starting there (see docs/sdk.md), never below
	// MinDelay. A first attempt a hedge cut short is known only to be slower
	// than it ran, so the delay moves only as far as such attempts let it
	// be sure of: a few slow attempts seen in full never lift it into a slow
	// mode. It is learned from the last thousand or two latencies of first
	// attempts sampled by when they start (see docs/sdk.md), older ones
	// weighing less.
	Percentile float64
	// MinDelay is the floor under a learned delay: hedging sooner would race
	// every call a scheduling hiccup slows. Zero means 1ms.
	MinDelay time.Duration
	// MaxHedges is the most hedges sent in one round (a first attempt or a
	// retry); zero means 1. Hedges count towards the policy's MaxAttempts.
	MaxHedges int
	// Observer, if set, is told about every hedge sent, won and suppressed.
	Observer HedgeObserver
}

// HedgeObserver is told what a Hedge does, for metrics; package sdkmetrics
// implements it with Prometheus. Methods are called from the executor's
// goroutines, concurrently; they must be cheap and must not block.
type HedgeObserver interface {
	// OnHedgeSent: a hedge passed the gate and its attempt started. Its
	// Admit hook, or a limiter in the callback, may still refuse it.
	OnHedgeSent()
	// OnHedgeWon: a hedge's answer was the call's.
	OnHedgeWon()
	// OnHedgeSuppressed: a hedge came due and the gate held it back.
	OnHedgeSuppressed(reason verdict.Suppression)
}

const (
	defaultMinDelay = time.Millisecond
	// A learned delay needs this many latencies, and forgets the older half
	// of them once it holds twice latencyWindow.
	minLatencies  = 100
	latencyWindow = 1000
	// The longest the watcher of a hedge that learns its delay waits
	// between two looks while calls run, and how often it looks while no
	// delay is known yet.
	lookTick = 10 * time.Millisecond
	// Sampled latencies wait for the watcher in a ring of sampleRing. The
	// share of first attempts sampled is set so that about sampleTarget
	// arrive between two looks, judged over adaptLooks looks, and halved at
	// once when a look finds more than half a ring.
	sampleRing   = 256
	sampleTarget = 16
	adaptLooks   = 64
)

// Hedge sends hedged attempts in the calls made with RunHedged or
// TryHedged (Run and Try refuse a policy with one, see
// ErrHedgeNeedsRunHedged): when an attempt has run for the hedge's
// delay without an answer, another copy is started beside it, up to
// MaxHedges; the first acceptable answer (OK, or a Permanent one, which
// stops the call whatever the others say) wins, and the others are
// cancelled through their contexts. Hedges are attempts like any other:
// each takes its own breaker permit, asks Admit, runs the callback with its
// own attempt timeout under the call's deadline, and has its entry in the
// attempt log. RunHedged returns once every attempt of the round has
// returned.
//
// Before each hedge the gate is asked, and holds the hedge back - saying
// why in the attempt log, Result.Suppressed and the observer - when:
//
//   - the work is below Critical (see Criticality): nobody is waiting for
//     it, so no copy of it is raced;
//   - an attempt of the round was refused by this process or host: the
//     dependency was not even asked, and a copy would ask the same limit;
//   - the call has made MaxAttempts attempts, hedges included;
//   - the breaker is not closed;
//   - the retry budget is down to half: a hedge spends a token like a
//     retry, and never takes the last half of the bucket.
//
// A hedge can only help if the attempt it races can be cut short, so the
// callback must return when its context is cancelled; and with a Hedge the
// callback runs concurrently with itself. Share one Hedge per dependency, as
// with a Breaker; copies of a Policy share it. While calls are running it
// keeps one goroutine, which starts the hedges and learns the delay, and
// which ends once calls stop.
type Hedge struct {
	delay      time.Duration // fixed, or until learned
	percentile float64
	minDelay   time.Duration
	maxHedges  int
	obs        HedgeObserver

	origin time.Time // slot words hold microseconds since this

	table    atomic.Pointer[[]*slot]
	growMu   sync.Mutex
	watching atomic.Bool
	learned  atomic.Int64 // the delay in force, nanoseconds; 0: none

	// The latencies of sampled first attempts (see sampled), on their way
	// to the watcher: sampleNext counts those written, each to samples at
	// that count modulo sampleRing, as a word of sample.
	sampleMask atomic.Uint64
	sampleNext atomic.Uint64
	samples    [sampleRing]atomic.Uint64

	// What scan keeps: one goroutine at a time, the watcher's.
	scanMu         sync.Mutex
	lat            latencies
	rounds         []hedgeRound
	sampleSeen     uint64 // sampleNext when the watcher last looked
	looks, arrived uint64 // looks, and latencies sampled, since sampleMask last changed
}

// NewHedge returns a Hedge. It panics on options that cannot work: a
// Percentile outside (0, 1), neither a Percentile nor a positive Delay, or
// a negative value.
func NewHedge(o HedgeOptions) *Hedge {
	var problems []string
	if o.Percentile < 0 || o.Percentile >= 1 || math.IsNaN(o.Percentile) {
		problems = append(problems, fmt.Sprintf("Percentile %v is outside (0, 1)", o.Percentile))
	}
	if o.Percentile == 0 && o.Delay <= 0 {
		problems = append(problems, "neither a Percentile nor a positive Delay")
	}
	if o.Delay < 0 || o.MinDelay < 0 || o.MaxHedges < 0 {
		problems = append(problems, "negative Delay, MinDelay or MaxHedges")
	}
	if len(problems) > 0 {
		panic("sdk: NewHedge: " + strings.Join(problems, "; "))
	}
	h := &Hedge{
		delay:      o.Delay,
		percentile: o.Percentile,
		minDelay:   o.MinDelay,
		maxHedges:  o.MaxHedges,
		obs:        o.Observer,
		origin:     time.Now(),
	}
	if h.minDelay == 0 {
		h.minDelay = defaultMinDelay
	}
	if h.maxHedges == 0 {
		h.maxHedges = 1
	}
	h.learned.Store(int64(h.delay))
	t := make([]*slot, 16)
	for i := range t {
		t[i] = new(slot)
	}
	h.table.Store(&t)
	return h
}

// Delay returns the delay in force: the fixed one, or the learned one; zero
// while a Percentile hedge has learned nothing and has no Delay to start
// from.
func (h *Hedge) Delay() time.Duration { return time.Duration(h.learned.Load()) }

// The gate's decision before the budget is asked, a pure function of what
// the executor knows when a hedge comes due. Order matters only for which
// reason is reported when several hold.
func hedgeGate(c Criticality, roundRefused, attemptsLeft, breakerClosed bool) verdict.Suppression {
	switch {
	case c < Critical:
		return verdict.SuppressedCriticality
	case roundRefused:
		return verdict.SuppressedRefused
	case !attemptsLeft:
		return verdict.SuppressedAttempts
	case !breakerClosed:
		return verdict.SuppressedBreaker
	}
	return verdict.SuppressedNone
}

// A slot's word is a value in microseconds shifted over a phase: a first
// attempt registers there while it runs, so that the watcher can find it
// when a hedge comes due.
const (
	phaseFree    = iota // nothing
	phaseClaimed        // being filled in; the watcher ignores it
	phaseActive         // a first attempt started at the value
	phaseFiring         // a hedge came due: the round is the watcher's and the caller's

	phaseBits = 2
	phaseMask = 1<<phaseBits - 1
)

// slot is where one running first attempt is registered.
type slot struct {
	word atomic.Uint64
	// cache is the *hedgedCall[T] of whoever holds the slot, kept for the next
	// holder of the same T so that registering allocates nothing. Only the
	// holder writes it; the watcher reads it after taking the slot from
	// phaseActive to phaseFiring, which the holder's store of phaseActive
	// published.
	cache any
	_     [40]byte // a cache line of its own
}

func word(phase, v uint64) uint64 { return v<<phaseBits | phase }

// micros returns t as microseconds since the hedge's origin.
func (h *Hedge) micros(t time.Time) uint64 {
	return uint64(max(t.Sub(h.origin), 0) / time.Microsecond)
}

// sampled reports whether the delay learns from the latency of a first
// attempt that starts at startUS (microseconds). That is decided when the
// attempt starts, by a hash of its start, never by how long it takes or
// when it ends: a sampler that keeps what fits between two looks keeps a
// quiet spell's latencies and loses most of a burst's, and a closed loop
// calling a dependency with a slow mode makes bursts of fast calls
// between slow ones. Every attempt is sampled until more than
// sampleTarget arrive between two looks; then one start in two, four...
// as the watcher sets sampleMask.
func (h *Hedge) sampled(startUS uint64) bool {
	return h.percentile > 0 && startUS*0x9e3779b97f4a7c15>>40&h.sampleMask.Load() == 0
}

// sample hands the watcher the latency d of a sampled first attempt,
// censored if a hedge cut it short: in microseconds over two bits, the
// censored one and one that marks a word as holding a latency.
func (h *Hedge) sample(censored bool, d time.Duration) {
	v := uint64(max(d, 0)/time.Microsecond)<<2 | 1
	if censored {
		v |= 2
	}
	h.samples[(h.sampleNext.Add(1)-1)%sampleRing].Store(v)
}

// readSamples adds the latencies sampled since the last look to the
// histogram, sets the share of first attempts sampled (see sampled), and
// reports whether there were any.
func (h *Hedge) readSamples() bool {
	for i := range h.samples {
		if h.samples[i].Load() == 0 {
			continue
		}
		if v := h.samples[i].Swap(0); v&2 == 0 {
			h.lat.add(v >> 2)
		} else {
			h.lat.addCensored(v >> 2)
		}
	}
	next := h.sampleNext.Load()
	n := next - h.sampleSeen
	h.sampleSeen = next
	h.looks++
	h.arrived += n
	mask := h.sampleMask.Load()
	switch {
	case n > sampleRing/2:
		mask = mask<<1 | 1
	case h.looks < adaptLooks:
		return n > 0
	case h.arrived > sampleTarget*adaptLooks:
		mask = mask<<1 | 1
	case h.arrived < sampleTarget*adaptLooks/4:
		mask >>= 1
	}
	h.looks, h.arrived = 0, 0
	h.sampleMask.Store(mask)
	return n > 0
}

// tryClaim takes s if it is free; hedged tries the slot an attempt's start
// picks this way, and only then claim.
func (s *slot) tryClaim() bool {
	w := s.word.Load()
	return w&phaseMask == phaseFree && s.word.CompareAndSwap(w, phaseClaimed)
}

// claim takes a free slot for an attempt starting at start (microseconds):
// the first free one from where start hashes, the table doubling only once
// every slot is taken. Calls that start in the same microsecond hash
// alike; growing when the few slots after theirs were taken doubled the
// table again and again for as long as those calls ran.
func (h *Hedge) claim(start uint64) *slot {
	for {
		t := *h.table.Load()
		n := uint64(len(t))
		i := (start ^ start>>7) & (n - 1) // spread concurrent calls
		for probe := range n {
			if s := t[(i+probe)&(n-1)]; s.tryClaim() {
				return s
			}
		}
		h.grow(len(t))
	}
}

// grow doubles the table from size n, unless another caller already has.
func (h *Hedge) grow(n int) {
	h.growMu.Lock()
	defer h.growMu.Unlock()
	t := *h.table.Load()
	if len(t) != n {
		return
	}
	g := make([]*slot, 2*n)
	copy(g, t)
	for i := n; i < len(g); i++ {
		g[i] = new(slot)
	}
	h.table.Store(&g)
}

// watch makes sure the watcher runs. A caller registers before it asks,
// and the watcher, before it ends, says so and looks again, so that one of
// the two sees the other.
func (h *Hedge) watch() {
	if !h.watching.Load() {
		h.startWatcher()
	}
}

func (h *Hedge) startWatcher() {
	if h.watching.CompareAndSwap(false, true) {
		go h.watcher()
	}
}

// hedgeRound is a round the watcher has started hedging, for the hedges
// after the first.
type hedgeRound interface {
	// more sends the next hedge if it is due at now, and returns when the
	// one after it is due; ok is false once the round wants no more.
	more(now time.Time) (due time.Time, ok bool)
}

// hedgeable is a *hedgedCall[T] the watcher can start hedging.
type hedgeable interface {
	startRound(h *Hedge, now time.Time) hedgeRound
}

// watcher starts hedges as they come due and learns the delay, for as long
// as calls are running.
func (h *Hedge) watcher() {
	t := time.NewTimer(time.Hour)
	t.Stop()
	defer t.Stop()
	idle := 0
	for {
		now := time.Now()
		next, busy := h.scan(now)
		if busy {
			idle = 0
		} else if idle++; idle >= 2 {
			h.watching.Store(false)
			// A call that registered after the scan but saw the watcher
			// still running is seen here.
			if next, busy = h.scan(now); !busy || !h.watching.CompareAndSwap(false, true) {
				return
			}
			idle = 0
		}
		t.Reset(time.Until(next))
		<-t.C
	}
}

// scan sends the hedges due at now, learns from the latencies sampled,
// and returns when it should look next and whether anything was running.
func (h *Hedge) scan(now time.Time) (next time.Time, busy bool) {
	h.scanMu.Lock()
	defer h.scanMu.Unlock()
	nowUS := h.micros(now)
	d := h.Delay()
	// A fixed delay needs a look only when a hedge comes due; a learned one
	// also reads the latencies sampled meanwhile.
	tick := d
	if h.percentile > 0 && (d <= 0 || d > lookTick) {
		tick = lookTick
	}
	next = now.Add(tick)
	dueUS := uint64(d / time.Microsecond)
	for _, s := range *h.table.Load() {
		w := s.word.Load()
		switch w & phaseMask {
		case phaseClaimed, phaseFiring:
			busy = true
		case phaseActive:
			busy = true
			if d <= 0 {
				continue
			}
			start := w >> phaseBits
			if start+dueUS > nowUS {
				if due := h.origin.Add(time.Duration(start+dueUS) * time.Microsecond); due.Before(next) {
					next = due
				}
				continue
			}
			if s.word.CompareAndSwap(w, word(phaseFiring, start)) {
				r := s.cache.(hedgeable).startRound(h, now)
				h.rounds = append(h.rounds, r)
			}
		}
	}
	kept := h.rounds[:0]
	for _, r := range h.rounds {
		if due, ok := r.more(now); ok {
			kept = append(kept, r)
			if due.Before(next) {
				next = due
			}
		}
	}
	clear(h.rounds[len(kept):])
	h.rounds = kept
	if len(kept) > 0 {
		busy = true
	}
	if h.percentile > 0 {
		if h.readSamples() {
			busy = true
		}
		if d, ok := h.lat.delay(h.percentile, h.Delay()); ok {
			h.learned.Store(int64(max(d, h.minDelay)))
		}
	}
	return next, busy
}

// latencies is a histogram of microseconds with about 6% resolution (16
// buckets per power of two) that forgets its older half as it fills: the
// latencies of first attempts seen in full, and beside them the censored
// ones - first attempts a hedge cut short - by how long they ran, which is
// all they say: that they would have taken longer. The watcher's alone.
type latencies struct {
	counts   [latencyBuckets]uint32 // weights, seen in full
	censored [latencyBuckets]uint32 // weights, censored, by how long they ran
	total    uint32                 // weight, counts and censored
	sinceQ   uint32                 // latencies added since delay last computed
}

// A latency weighs two, so that forgetting - halving every weight, rounding
// down - keeps a lone old latency once, at half its weight, and drops it
// the next time. Rounding a weight of one up instead would keep it forever:
// a bucket that ever held a latency would never be empty again, and the
// gap below a slower mode would fill up with the stragglers of a long run.
const sampleWeight = 2

const latencyBuckets = 16 * 62

func bucketOf(us uint64) int {
	if us < 16 {
		return int(us)
	}
	shift := bits.Len64(us) - 5 // us>>shift is in [16, 32)
	return min(16*shift+int(us>>shift), latencyBuckets-1)
}

// bucketTop is the largest value in bucket b.
func bucketTop(b int) uint64 {
	if b < 16 {
		return uint64(b)
	}
	shift, m := b/16-1, uint64(b%16+16)
	return (m+1)<<shift - 1
}

func (l *latencies) add(us uint64) {
	l.counts[bucketOf(us)] += sampleWeight
	l.count()
}

// addCensored counts a first attempt cut short after it ran us.
func (l *latencies) addCensored(us uint64) {
	l.censored[bucketOf(us)] += sampleWeight
	l.count()
}

func (l *latencies) count() {
	l.total += sampleWeight
	l.sinceQ++
	if l.total < 2*latencyWindow*sampleWeight {
		return
	}
	l.total = 0
	for i := range l.counts {
		l.counts[i] /= 2
		l.censored[i] /= 2
		l.total += l.counts[i] + l.censored[i]
	}
}

// delay returns the delay to hedge at, given the one in force, cur. Its
// target is the q-quantile of the latencies at the top of its bucket, unless
// a bucket below it and above the quantile less a margin - a quarter of the
// tail, 1-q, and two standard deviations of sampling noise - is empty; then
// the top of the bucket under the gap. The gap matters when the slowest 1-q
// of a dependency's calls are a separate, slower mode, the shape hedging is
// for: the exact quantile then sits on the edge of that mode, and noise
// alone would put it inside, where hedging stops helping. Stopping below
// the gap hedges the slow mode and little else; the margin bounds how far
// down a gap is looked for.
//
// Censored latencies are known only to be longer than they ran, and which
// first attempts past the delay are seen in full depends on how slow they
// were (a slow one is cut short by its hedge; one whose hedge the budget
// held back, or that beat a slow hedge, is not), so those seen in full say
// nothing of where the censored ones lie. The target is therefore only
// bounded: counting the censored as slower than any gives the most it can
// be, counting them as ending when they were cut short the least. The delay
// moves no further than the bounds make it: down to the most when it is
// above it; up when it is below the least, to the least or by half,
// whichever is further, but not past the most; and otherwise it stays.
// Without censored latencies the bounds agree and the delay is the target.
// A few slow attempts seen in full thus never lift the delay into a slow
// mode, while a dependency that got slower is followed, by half a delay a
// recomputation at least. ok is false until minLatencies have been seen,
// and between recomputations.
func (l *latencies) delay(q float64, cur time.Duration) (time.Duration, bool) {
	if l.total < minLatencies*sampleWeight || l.sinceQ < latencyWindow/20 && cur > 0 {
		return 0, false
	}
	l.sinceQ = 0
	w := float64(l.total)
	margin := (1-q)/4 + 2*math.Sqrt(q*(1-q)/(w/sampleWeight))
	// Ranks are in weight, as the counts are.
	rank := uint32(max(math.Ceil((q-margin)*w), 1))
	rankQ := uint32(max(math.Ceil(q*w), 1))
	most := l.target(rank, rankQ, false)
	if most <= cur || cur <= 0 {
		return most, most != never
	}
	if least := min(l.target(rank, rankQ, true), most); least > cur {
		return min(most, max(least, cur+cur/2)), true
	}
	return cur, true
}

// never is the target of latencies that do not reach its rank.
const never = time.Duration(math.MaxInt64)

// target is the target of delay at ranks rank to rankQ, in weight, of the
// latencies seen in full and, with cut, of the censored ones at how long
// they ran; never if they do not reach rank.
func (l *latencies) target(rank, rankQ uint32, cut bool) time.Duration {
	weight := func(b int) uint32 {
		if cut {
			return l.counts[b] + l.censored[b]
		}
		return l.counts[b]
	}
	var seen uint32
	for b := range latencyBuckets {
		if seen += weight(b); seen < rank {
			continue
		}
		// Up to the quantile itself, as long as no empty bucket says a
		// slower mode starts past b.
		for ; seen < rankQ && b+1 < latencyBuckets && weight(b+1) > 0; b++ {
			seen += weight(b + 1)
		}
		return time.Duration(bucketTop(b)) * time.Microsecond
	}
	return never
}

// hedgeContext is a first attempt's context on a hedged call for which the
// executor derives none of its own: the caller's, made cancellable so that
// the attempt can be cut short when a hedge answers first.
//
// It costs nothing until something waits on it. Until Done is called (or
// Value after a cancellation) it answers from the caller's context; then it
// makes a context.WithCancel of it and answers from that, so that contexts
// derived from it are children of a real cancelCtx. A hedgeContext nobody
// waited on and nobody cancelled is used again for the next call with the
// very same caller's context - same values, same deadline - which is what
// makes a hedged call allocate nothing. One somebody waited on is released
// when its attempt returns (see release), and never used again. A callback
// that keeps its context after it returns may therefore see it cancelled
// then, or later, when an attempt of another call with the same context
// loses a race: an attempt's context is only good until the attempt returns.
type hedgeContext struct {
	parent context.Context
	// comparable: parent can be compared with == without panicking, which
	// is what reusing c takes. Checked once, here, not on every call.
	comparable bool
	cancelled  atomic.Bool
	inner      atomic.Pointer[innerContext]
	mu         sync.Mutex
}

func newHedgeContext(parent context.Context) *hedgeContext {
	return &hedgeContext{parent: parent, comparable: comparableValue(parent)}
}

// comparableValue reports whether v can be compared with == without panicking.
// Only a struct or an array can hide an uncomparable value behind a
// comparable type (in an interface field); for anything else, a pointer
// above all, the type says, and reflect.Value.Comparable, which allocates,
// is not asked.
func comparableValue(v any) bool {
	switch t := reflect.TypeOf(v); {
	case t == nil:
		return false
	case t.Kind() == reflect.Struct || t.Kind() == reflect.Array:
		return reflect.ValueOf(v).Comparable()
	default:
		return t.Comparable()
	}
}

type innerContext struct {
	ctx    context.Context
	cancel context.CancelFunc
}

// reusable reports whether c may serve a call with caller's context ctx.
// Comparing with == cannot panic when parent's value is comparable: a ctx
// of another dynamic type is unequal, and one of the same type has, field
// by field, either other dynamic types or parent's comparable ones.
func (c *hedgeContext) reusable(ctx context.Context) bool {
	return c != nil && c.comparable && c.parent == ctx && c.inner.Load() == nil && !c.cancelled.Load()
}

func (c *hedgeContext) Deadline() (time.Time, bool) { return c.parent.Deadline() }

func (c *hedgeContext) Done() <-chan struct{} { return c.materialize().Done() }

func (c *hedgeContext) Err() error {
	if in := c.inner.Load(); in != nil {
		return in.ctx.Err()
	}
	if c.cancelled.Load() {
		return context.Canceled
	}
	return c.parent.Err()
}

func (c *hedgeContext) Value(key any) any {
	if in := c.inner.Load(); in != nil {
		return in.ctx.Value(key)
	}
	if c.cancelled.Load() { // so that context.Cause agrees with Err
		return c.materialize().Value(key)
	}
	return c.parent.Value(key)
}

func (c *hedgeContext) String() string { return "sdk.hedgeContext" }

func (c *hedgeContext) materialize() context.Context {
	if in := c.inner.Load(); in != nil {
		return in.ctx
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if in := c.inner.Load(); in != nil {
		return in.ctx
	}
	ctx, cancel := context.WithCancel(c.parent)
	if c.cancelled.Load() {
		cancel()
	}
	c.inner.Store(&innerContext{ctx, cancel})
	return ctx
}

// release is called when c's attempt has returned. A context.WithCancel
// that something waited on stays registered on the caller's context until
// cancelled, and the caller's may live as long as the process: cancelling
// it lets it go. c is not reused once it has one (see reusable), so no other
// attempt sees it cancelled.
func (c *hedgeContext) release() {
	if in := c.inner.Load(); in != nil {
		in.cancel()
	}
}

func (c *hedgeContext) cancel() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.cancelled.Store(true)
	if in := c.inner.Load(); in != nil {
		in.cancel()
	}
}
