package daemon

import (
	"iter"
	"math"
	"path"
	"slices"
	"time"

	"github.com/egressd/egressd/pkg/loader"
	"github.com/egressd/egressd/pkg/policy"
)

// What the daemon remembers of every rule's counts between two reads of
// them all (a scrape, or a listing sorted by activity): sums of the rules
// of each class that only grow while rules come, go and change class; how
// busy each rule has been lately; and which rules get series of their
// own. With 100,000 rules, a series per rule is more than a scrape can
// carry: every rule is in its class's sums, and a bounded set of rules in
// series of its own.

// class is what the aggregate series group rules by: the shape as the
// policy gives it, the scope, and whether the rule is shared and in
// shadow mode. It is a number below classes, so that finding a rule's
// class's sums costs no hash.
type class uint8

// Shapes and scopes as the class series label them.
var (
	classShapes = [...]string{"concurrency", "adaptive", "perSecond", "perWindow"}
	classScopes = [...]string{"host", "unit", "cgroup"}
)

const classes = len(classShapes) * len(classScopes) * 2 * 2

func makeClass(shape, scope int, shared, shadow bool) class {
	c := shape*len(classScopes) + scope
	c = c*2 + int(bit(shared))
	return class(c*2 + int(bit(shadow)))
}

func (c class) shadow() bool  { return c%2 == 1 }
func (c class) shared() bool  { return c/2%2 == 1 }
func (c class) scope() string { return classScopes[int(c)/4%len(classScopes)] }
func (c class) shape() string { return classShapes[int(c)/4/len(classScopes)] }

func classOf(e *entry) class {
	shape := 0
	switch e.spec.Limit.(type) {
	case policy.Adaptive:
		shape = 1
	case policy.PerSecond:
		shape = 2
	case policy.PerWindow:
		shape = 3
	}
	scope := 0
	switch {
	case e.spec.Scope.Unit != "":
		scope = 1
	case e.spec.Scope.Cgroup != "":
		scope = 2
	}
	return makeClass(shape, scope, e.spec.IsShared(), e.spec.Shadow)
}

// The counters a class sums: the kernel's, then what the recounts did.
const (
	countAdmitted = iota
	countRefused
	countShadowRefused
	countConnectFailed
	countReleasedDrift
	countReleasedFreed
	countRemarked
	countersLen
	// kernelCounters are the counters read from the kernel, the first
	// ones; the recounts add to the others.
	kernelCounters = countReleasedDrift
)

type counters [countersLen]uint64

// busyWindow is about how far back a rule's refusals a second look: the
// time constant of their moving average.
const busyWindow = time.Minute

// tracked is what the tracker knows of one rule.
type tracked struct {
	name string
	// gone says the rule left the tracker; a cache may still hold it.
	gone  bool
	class class
	// seen is the read that last found the rule in the table (0: none
	// yet, a rule a recount found first); counted is whether that read
	// found it in the kernel too.
	seen      uint64
	counted   bool
	installed bool
	// last holds the kernel's counters as the last read that counted the
	// rule found them (kernel says one did), and what the recounts did
	// since the daemon started (or the rule was made).
	last           counters
	kernel         bool
	live, inFlight int64
	// drift is the last recount's, when recount is the tracker's latest.
	drift   int64
	recount uint64
	// refusing is the rule's refusals a second, averaged over about
	// busyWindow.
	refusing float64
	// named is whether the policy names the rule for series of its own,
	// as of the patterns of generation namedGen; trouble whether its
	// shared budget's Redis is out of reach; chosen whether the last
	// choice gave it series of its own.
	named    bool
	namedGen uint64
	trouble  bool
	chosen   bool
}

// classTotals are a class's sums as the last read found them.
type classTotals struct {
	counts             counters
	live, inFlight     int64
	installed, pending int
	// drifting counts the rules whose last recount found drift,
	// unreachable those whose shared budget's Redis is out of reach.
	drifting, unreachable int
}

// tracker is the state of the reads. Its methods are the steps of a read
// and do no I/O: begin, then classify for every rule of the table, count
// for every rule of the kernel, and end.
type tracker struct {
	rules map[string]*tracked
	// list holds the rules for walks; byTable and byKernel hold them as
	// the last read found them, in the table's order and the kernel's:
	// a read of the same rules finds each where it was, with no lookup
	// by name per rule per read.
	list              []*tracked
	byTable, byKernel []*tracked
	// adjust is what each class's sums add to their members' counters:
	// what members that left had counted in it, less what members had
	// when they joined, so that the sums only grow. (Unsigned arithmetic
	// wraps; each sum is what the class counted, never negative.)
	adjust [classes]counters
	totals [classes]classTotals
	// gen numbers the reads; started says one has ended, so that a rule
	// found later was made since and its counts are new.
	gen     uint64
	started bool
	now     time.Time
	prev    time.Time
	// dt is the time since the last read, and alpha how far it moves
	// an average of refusals a second towards the rate it saw: the
	// longer dt, the further, so that reads at any pace give about the
	// same average.
	dt    time.Duration
	alpha float64
	// recounts numbers the recounts recorded.
	recounts uint64
	// patterns name the rules given series of their own first, as of
	// generation patternsGen.
	patterns    []string
	patternsGen uint64
	// slab is where add takes the next rules from.
	slab []tracked
	// chosen are the rules the last choice gave series of their own;
	// named counts the rules the last read found named.
	chosen []string
	named  int
	// tableRead and kernelRead are how many rules this read found in
	// the table and the kernel.
	tableRead, kernelRead int
}

func newTracker() *tracker {
	return &tracker{rules: map[string]*tracked{}}
}

// name sets the patterns of the rules the policy names; it is cheap when
// they are those set last.
func (t *tracker) name(patterns []string) {
	if !slices.Equal(patterns, t.patterns) {
		t.patterns = slices.Clone(patterns)
		t.patternsGen++
	}
}

// begin starts a read at now of a table of about n rules.
func (t *tracker) begin(now time.Time, n int) {
	if len(t.rules) == 0 && n > 0 {
		t.rules = make(map[string]*tracked, n)
		t.list = make([]*tracked, 0, n)
	}
	t.gen++
	t.now, t.named, t.tableRead, t.kernelRead = now, 0, 0, 0
	t.dt = now.Sub(t.prev)
	t.alpha = 1 - math.Exp(-t.dt.Seconds()/busyWindow.Seconds())
}

// classify records that the table has rule name, of class c, installed in
// the kernel or not, in trouble or not; i is its place in the table.
func (t *tracker) classify(i int, name string, c class, installed, trouble bool) {
	r := t.find(&t.byTable, i, name)
	switch {
	case r == nil:
		r = t.add(name)
		r.class = c
		t.byTable[i] = r
	case r.seen == 0:
		r.class = c // found by a recount first: in no class yet
	case r.class != c:
		// What it counted stays with the class it leaves; the class it
		// joins counts from here.
		from, to := &t.adjust[r.class], &t.adjust[c]
		for i, n := range r.last {
			from[i] += n
			to[i] -= n
		}
		r.class = c
	}
	if r.namedGen != t.patternsGen || r.seen == 0 {
		r.named, r.namedGen = matchesAny(t.patterns, name), t.patternsGen
	}
	if r.named {
		t.named++
	}
	r.seen, r.counted, r.installed, r.trouble = t.gen, false, installed, trouble
	r.live, r.inFlight = 0, 0
	t.tableRead = max(t.tableRead, i+1)
}

// add starts tracking rule name. The rules are allocated in slabs: the
// first read of 100,000 rules took most of its time allocating them one
// by one.
func (t *tracker) add(name string) *tracked {
	if len(t.slab) == 0 {
		t.slab = make([]tracked, 256)
	}
	r := &t.slab[0]
	t.slab = t.slab[1:]
	r.name = name
	t.rules[name] = r
	t.list = append(t.list, r)
	return r
}

// find returns the rule called name, looking first at place i of cache,
// and keeps it there; nil if the tracker has none.
func (t *tracker) find(cache *[]*tracked, i int, name string) *tracked {
	if i >= len(*cache) {
		*cache = append(*cache, make([]*tracked, i+1-len(*cache))...)
	}
	if r := (*cache)[i]; r != nil && !r.gone && r.name == name {
		return r
	}
	r := t.rules[name]
	(*cache)[i] = r
	return r
}

// matchesAny reports whether name matches one of patterns (path.Match's;
// the policy checked them).
func matchesAny(patterns []string, name string) bool {
	for _, p := range patterns {
		if ok, _ := path.Match(p, name); ok {
			return true
		}
	}
	return false
}

// count records a rule's counts as the kernel has them now; i is its
// place in the kernel's order. A rule the table did not have when this
// read began is left for the next.
func (t *tracker) count(i int, name string, st *loader.Stats) {
	r := t.find(&t.byKernel, i, name)
	if r == nil || r.seen != t.gen {
		return
	}
	now := [kernelCounters]uint64{st.Admitted, st.Refused, st.ShadowRefused, st.ConnectFailed}
	adjust := &t.adjust[r.class]
	refused := now[countRefused]
	if refused >= r.last[countRefused] {
		refused -= r.last[countRefused]
	}
	for i, n := range now {
		switch {
		case !r.kernel && !t.started:
			// A rule there before the first read: classes count from
			// here, as the daemon's own counters count from its start.
			adjust[i] -= n
		case n < r.last[i]:
			// A counter that went back is a rule made again: what the
			// one before counted stays counted.
			adjust[i] += r.last[i]
		}
		r.last[i] = n
	}
	if t.started && t.dt > 0 {
		r.refusing += (float64(refused)/t.dt.Seconds() - r.refusing) * t.alpha
	}
	r.kernel, r.counted, r.live, r.inFlight = true, true, st.Live, st.InFlight
	t.kernelRead = max(t.kernelRead, i+1)
}

// end ends the read: rules the table no longer has leave their classes,
// and the classes' sums are taken.
func (t *tracker) end() {
	t.totals = [classes]classTotals{}
	kept := t.list[:0]
	for _, r := range t.list {
		if r.seen != t.gen {
			if r.seen > 0 {
				adjust := &t.adjust[r.class]
				for i, n := range r.last {
					adjust[i] += n
				}
			}
			delete(t.rules, r.name)
			r.gone = true
			continue
		}
		kept = append(kept, r)
		tot := &t.totals[r.class]
		for i, n := range r.last {
			tot.counts[i] += n
		}
		tot.live += r.live
		tot.inFlight += r.inFlight
		if r.installed {
			tot.installed++
		} else {
			tot.pending++
		}
		if t.drifting(r) {
			tot.drifting++
		}
		if r.trouble {
			tot.unreachable++
		}
	}
	clear(t.list[len(kept):])
	t.list = kept
	// What the caches hold past the rules read is of rules gone.
	clear(t.byTable[t.tableRead:])
	clear(t.byKernel[t.kernelRead:])
	t.byTable, t.byKernel = t.byTable[:t.tableRead], t.byKernel[:t.kernelRead]
	for c := range t.totals {
		for i, n := range t.adjust[c] {
			t.totals[c].counts[i] += n
		}
	}
	t.started, t.prev = true, t.now
}

// recorded adds what a recount found: each rule's drift, and the slots it
// gave back and the marks it put back. A rule no read has found yet is
// kept for the next, which finds it in the table or lets it go.
func (t *tracker) recorded(rc map[string]loader.Recount) {
	t.recounts++
	for name, c := range rc {
		r := t.rules[name]
		if r == nil {
			r = t.add(name)
		}
		r.drift, r.recount = c.Drift(), t.recounts
		r.last[countReleasedDrift] += uint64(c.GivenBack)
		r.last[countReleasedFreed] += uint64(c.Freed)
		r.last[countRemarked] += uint64(c.Remarked)
	}
}

// driftOf is r's drift at the last recount, and whether that recount
// found the rule.
func (t *tracker) driftOf(r *tracked) (int64, bool) {
	return r.drift, r.recount > 0 && r.recount == t.recounts
}

// drifting reports whether the last recount found drift on r.
func (t *tracker) drifting(r *tracked) bool {
	d, ok := t.driftOf(r)
	return ok && d != 0
}

// Why a rule has series of its own.
const (
	// whyAll: every rule has them, there being no more than the bound.
	whyAll = iota
	// whyNamed: the policy names it.
	whyNamed
	// whyTrouble: its last recount found drift, or its shared budget's
	// Redis is out of reach.
	whyTrouble
	// whyBusiest: among the busiest, by refusals a second lately, then
	// live connections.
	whyBusiest
	whyLen
)

var whyNames = [whyLen]string{"all", "named", "trouble", "busiest"}

// candidate is a rule as the choice of series sees it.
type candidate struct {
	name           string
	named, trouble bool
	// chosen is whether the last choice took it: it then counts twice as
	// busy, so that a rule does not come and go between scrapes for a
	// little more or less activity than another.
	chosen   bool
	refusing float64
	live     int64
}

// choose picks the rules, of n, that get series of their own: all of
// them when n is at most max; otherwise max of them, those the policy
// names first, then those in trouble, then the busiest (before). It
// returns their names, sorted, and how many were chosen for each reason.
func choose(cands iter.Seq[candidate], n, max int) ([]string, [whyLen]int) {
	var why [whyLen]int
	if n <= max {
		var all []string
		for c := range cands {
			all = append(all, c.name)
		}
		slices.Sort(all)
		why[whyAll] = len(all)
		return all, why
	}
	kept := best(cands, max, before)
	names := make([]string, len(kept))
	for i, c := range kept {
		names[i] = c.name
		switch {
		case c.named:
			why[whyNamed]++
		case c.trouble:
			why[whyTrouble]++
		default:
			why[whyBusiest]++
		}
	}
	slices.Sort(names)
	return names, why
}

// before orders candidates for series of their own: named, in trouble,
// then by refusals a second and live connections (twice those of a rule
// chosen last time), then chosen last time, then by name.
func before(a, b candidate) bool {
	if a.named != b.named {
		return a.named
	}
	if a.trouble != b.trouble {
		return a.trouble
	}
	weight := func(c candidate) float64 {
		if c.chosen {
			return 2
		}
		return 1
	}
	if ra, rb := a.refusing*weight(a), b.refusing*weight(b); ra != rb {
		return ra > rb
	}
	if la, lb := float64(a.live)*weight(a), float64(b.live)*weight(b); la != lb {
		return la > lb
	}
	if a.chosen != b.chosen {
		return a.chosen
	}
	return a.name < b.name
}

// busier orders rules by how busy they have been lately: refusals a
// second, then live connections, then name.
func busier(a, b candidate) bool {
	a.named, a.trouble, a.chosen = false, false, false
	b.named, b.trouble, b.chosen = false, false, false
	return before(a, b)
}

// best returns the k best values of seq by less (a before b: a is
// better), best first. It keeps k at a time: a choice of 500 rules of
// 100,000 is a comparison with the worst kept for most.
func best[T any](seq iter.Seq[T], k int, less func(a, b T) bool) []T {
	if k <= 0 {
		return nil
	}
	// h is a heap whose root is the worst kept.
	h := make([]T, 0, min(k, 1024))
	worse := func(i, j int) bool { return less(h[j], h[i]) }
	down := func(i int) {
		for {
			c := 2*i + 1
			if c >= len(h) {
				return
			}
			if c+1 < len(h) && worse(c+1, c) {
				c++
			}
			if !worse(c, i) {
				return
			}
			h[i], h[c] = h[c], h[i]
			i = c
		}
	}
	for v := range seq {
		if len(h) < k {
			h = append(h, v)
			for i := len(h) - 1; i > 0 && worse(i, (i-1)/2); i = (i - 1) / 2 {
				h[i], h[(i-1)/2] = h[(i-1)/2], h[i]
			}
			continue
		}
		if less(v, h[0]) {
			h[0] = v
			down(0)
		}
	}
	slices.SortFunc(h, func(a, b T) int {
		if less(a, b) {
			return -1
		}
		if less(b, a) {
			return 1
		}
		return 0
	})
	return h
}

// candidates are the rules of the last read as choose sees them.
func (t *tracker) candidates() iter.Seq[candidate] {
	return func(yield func(candidate) bool) {
		for _, r := range t.list {
			if r.seen != t.gen {
				continue
			}
			c := candidate{name: r.name, named: r.named, trouble: r.trouble || t.drifting(r), chosen: r.chosen,
				refusing: r.refusing, live: r.live}
			if !yield(c) {
				return
			}
		}
	}
}

// chose records which rules the choice took, for the next.
func (t *tracker) chose(names []string) {
	for _, name := range t.chosen {
		if r := t.rules[name]; r != nil {
			r.chosen = false
		}
	}
	for _, name := range names {
		if r := t.rules[name]; r != nil {
			r.chosen = true
		}
	}
	t.chosen = names
}

// rulesRead is how many rules the last read found in the table.
func (t *tracker) rulesRead() int {
	n := 0
	for _, tot := range t.totals {
		n += tot.installed + tot.pending
	}
	return n
}
