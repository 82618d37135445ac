package adaptive

import (
	"math/bits"
	"time"
)

// The baseline is the 10th percentile of the last five minutes of latencies.
// Keeping the samples themselves would cost memory in proportion to the call
// rate, so the window is a ring of slots, each a log-linear histogram of the
// latencies recorded during its ten seconds, plus a running sum of the slots.
// A slot takes its 4 KiB when a call first lands in it and gives them back
// when it leaves the window, so a busy Controller holds about 128 KiB and
// one called now and then (a partition's, for a rare client) a few slots;
// recording is a few array increments, and the percentile is read from the
// sum in one pass over its buckets.
const (
	// slotWidth is the resolution of aging: a sample leaves the window
	// between 4m50s and 5m after it was recorded.
	slotWidth = 10 * time.Second
	slots     = 30 // 30 × 10s: five minutes

	// subBits sets the histogram's precision: each power of two is split into
	// 1<<subBits buckets, so a bucket's midpoint is within 1/(2<<subBits)
	// (1.5625%) of any latency in it, inside the 2% the baseline may be off.
	subBits  = 5
	subCount = 1 << subBits

	// maxBits sets the histogram's range: latencies at or above 1<<maxBits ns
	// (about 68.7s) are counted as maxLatency. Only a baseline above that is
	// affected, and no dependency with a 68-second fast call needs a limiter
	// to tell it is queueing.
	maxBits    = 36
	maxLatency = time.Duration(1)<<maxBits - 1
	buckets    = (maxBits - subBits + 1) * subCount

	// minSamples is how many calls the window must hold for a baseline: the
	// fewest for which the 10th percentile is a whole call (0.1 × n ≥ 1)
	// rather than a point below the fastest one.
	minSamples = 10

	// minEstimate is how many calls an estimate of the baseline that the
	// drain probes' lowest remembers must rest on: the 2nd fastest of 20
	// is rarely far below the 10th percentile, where the fastest of 10
	// sometimes is, and one estimate too low would hold the limit down for
	// five minutes.
	minEstimate = 20
)

// window is the five-minute latency histogram. Its zero value is empty; the
// first recorded instant becomes its epoch.
//
// Counts per slot are 32-bit: overflowing one takes 2³² calls in one bucket
// in ten seconds, about 430 million a second, far beyond what one mutex-
// guarded Controller can be fed.
type window struct {
	started bool
	epoch   time.Time
	head    int64                   // slots elapsed since epoch; the slot being filled is head % slots
	slot    [slots]*[buckets]uint32 // nil: no call in those ten seconds
	total   [buckets]uint64         // sum of slot over the ring
	n       uint64                  // sum of total
}

// record counts latency d at instant now. An instant earlier than the slot
// being filled (kernel timestamps from several CPUs arrive slightly out of
// order) is counted in that slot rather than rewriting the past.
func (w *window) record(now time.Time, d time.Duration) {
	if !w.started {
		w.started, w.epoch = true, now
	}
	w.advance(int64(now.Sub(w.epoch) / slotWidth))
	i := bucketOf(d)
	h := &w.slot[w.head%slots]
	if *h == nil {
		*h = new([buckets]uint32)
	}
	(*h)[i]++
	w.total[i]++
	w.n++
}

// advance retires the slots that fell out of the window by slot s.
func (w *window) advance(s int64) {
	if s-w.head >= slots {
		w.head = s
		w.slot = [slots]*[buckets]uint32{}
		w.total = [buckets]uint64{}
		w.n = 0
		return
	}
	for w.head < s {
		w.head++
		old := &w.slot[w.head%slots]
		if *old == nil {
			continue
		}
		for i, c := range *old {
			w.total[i] -= uint64(c)
			w.n -= uint64(c)
		}
		*old = nil
	}
}

// baseline returns the 10th percentile of the window by nearest rank (the
// ⌈n/10⌉-th fastest call), or false when the window holds fewer than
// minSamples calls.
func (w *window) baseline() (time.Duration, bool) {
	return w.percentile(minSamples)
}

// percentile returns the 10th percentile, or false when the window holds
// fewer than least calls.
func (w *window) percentile(least uint64) (time.Duration, bool) {
	if w.n < least {
		return 0, false
	}
	return percentile10(&w.total, w.n), true
}

// percentile10 returns the 10th percentile by nearest rank (the ⌈n/10⌉-th
// fastest call) of a histogram holding n > 0 calls.
func percentile10[T uint32 | uint64](h *[buckets]T, n uint64) time.Duration {
	return percentile(h, n, 10)
}

// percentile returns the pct-th percentile by nearest rank (the
// ⌈n × pct/100⌉-th fastest call) of a histogram holding n > 0 calls.
func percentile[T uint32 | uint64](h *[buckets]T, n, pct uint64) time.Duration {
	rank := (n*pct + 99) / 100
	// rank ≤ n, and n is the sum of h, so the walk stops inside it.
	i := 0
	for seen := uint64(h[0]); seen < rank; seen += uint64(h[i]) {
		i++
	}
	return valueOf(i)
}

// weightedPercentile is percentile of a histogram of weights summing to
// n > 0: the least latency with at least pct/100 of the weight at or below
// it.
func weightedPercentile(h *[buckets]float64, n, pct float64) time.Duration {
	rank := n * pct / 100
	seen := h[0]
	i := 0
	for seen < rank && i < buckets-1 {
		i++
		seen += h[i]
	}
	return valueOf(i)
}

// bucketOf maps a latency to its histogram bucket: exact below 2<<subBits ns,
// then subCount buckets per power of two.
func bucketOf(d time.Duration) int {
	v := uint64(min(max(d, 0), maxLatency))
	if v < 2*subCount {
		return int(v)
	}
	shift := bits.Len64(v) - subBits - 1
	return shift*subCount + int(v>>shift)
}

// valueOf returns the midpoint of bucket i: within 1/(2<<subBits) of every
// latency the bucket holds.
func valueOf(i int) time.Duration {
	if i < 2*subCount {
		return time.Duration(i)
	}
	shift := i/subCount - 1
	lower := uint64(i-shift*subCount) << shift
	return time.Duration(lower + 1<<(shift-1))
}
