package limit

import "time"

// window is the kernel's take_window in Go: a sliding window of n segments
// numbered from the clock (elapsed / seg), slot id % n holding the count of
// segment id while it is one of the last n. It is not safe for concurrent
// use.
type window struct {
	origin time.Time // instants are measured from here
	limit  int64     // permits in any window
	n      int64     // segments
	seg    int64     // segment length, nanoseconds
	last   int64     // nanoseconds since origin of the latest take
	taken  int64     // segment the latest permit was counted in
	id     [MaxSegments]int64
	count  [MaxSegments]int64
}

// newWindow returns an empty window of limit permits per window, sliding in
// segments parts, from origin on. The segment is window / segments, rounded
// down, as in the kernel.
func newWindow(origin time.Time, limit int, length time.Duration, segments int) window {
	return window{origin: origin, limit: int64(limit), n: int64(segments), seg: int64(length) / int64(segments)}
}

// take counts one permit at now and returns 0, or counts nothing and returns
// how long until the oldest counted segment leaves the window. Time never
// goes backwards: an instant before the latest one seen is taken as that one,
// so a stale reading can never reset a newer segment's slot.
func (w *window) take(now time.Time) time.Duration {
	return w.takeAt(int64(now.Sub(w.origin)))
}

// takeAt is take at ns nanoseconds after origin.
func (w *window) takeAt(ns int64) time.Duration {
	ns = max(ns, w.last)
	w.last = ns
	cur := ns / w.seg
	idx := cur % w.n
	if w.id[idx] != cur {
		w.id[idx], w.count[idx] = cur, 0
	}
	total, oldest := int64(0), cur
	for i := range w.n {
		if id, c := w.id[i], w.count[i]; c > 0 && id+w.n > cur {
			total += c
			oldest = min(oldest, id)
		}
	}
	if total < w.limit {
		w.count[idx]++
		w.taken = cur
		return 0
	}
	return time.Duration((oldest+w.n)*w.seg - ns)
}

// refund uncounts a permit taken in segment id but not used, if that segment
// is still in its slot.
func (w *window) refund(id int64) {
	if idx := id % w.n; w.id[idx] == id && w.count[idx] > 0 {
		w.count[idx]--
	}
}
