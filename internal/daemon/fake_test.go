package daemon

import (
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/egressd/egressd/pkg/kernelrule"
	"github.com/egressd/egressd/pkg/loader"
)

// fakeDatapath is the kernel side in memory: rules by name and the counts
// a test sets, with event streams a test feeds. It checks rules as the
// loader does (Rule.Validate, and no two rules of a Sync on one key:
// scope, destination, port) and applies a Sync all or nothing; a test can
// make the next writes fail.
type fakeDatapath struct {
	mu    sync.Mutex
	rules map[string]loader.Rule
	// order is rules' names in the order Counts gives them, the same
	// from one call to the next, as the kernel's slots; nil after a
	// change of the rules.
	order   []string
	synced  map[string]loader.Rule // as the last Sync wrote them, before any Put
	stats   map[string]loader.Stats
	adopted bool
	syncs   int // Syncs done
	puts    int
	failPut error // returned by Put and Sync while set
	closed  string
	// maxRules is the rule tables' size: a Sync of rules that need more
	// (loader.SlotsFor) is refused, as the loader refuses it. resizes are the sizes
	// asked of Resize.
	maxRules int
	resizes  []int
	growOnly bool // as the last open was asked
	// noted are the refusals the kernel noted, which LastRefusal reads:
	// every refusal a test sends.
	noted []loader.Refusal
	// recounted is what the next Recount says of each rule it names,
	// beside the live count.
	recounted map[string]loader.Recount

	refusals *fakeReader[loader.Refusal]
	samples  *fakeReader[loader.Sample]

	// sets counts set's calls; each Live sends on lives the rule and the
	// count it read under, while there is room.
	sets  int
	lives chan liveRead
}

type liveRead struct {
	rule string
	set  int
}

func newFake() *fakeDatapath {
	return &fakeDatapath{
		rules: map[string]loader.Rule{}, stats: map[string]loader.Stats{}, maxRules: loader.DefaultMaxRules,
		refusals: newFakeReader[loader.Refusal](), samples: newFakeReader[loader.Sample](),
		lives: make(chan liveRead, 16),
	}
}

var _ datapath = (*fakeDatapath)(nil)

// open is a Config.open that returns f, with tables of the size asked.
func (f *fakeDatapath) open(cfg *loader.Config) (datapath, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.growOnly = cfg.GrowOnly
	if cfg.MaxRules > 0 && !(cfg.GrowOnly && cfg.MaxRules < f.maxRules) {
		f.maxRules = cfg.MaxRules
	}
	return f, nil
}

func (f *fakeDatapath) Adopted() bool  { return f.adopted }
func (f *fakeDatapath) PinDir() string { return "/sys/fs/bpf/fake" }

func (f *fakeDatapath) Sync(rules []loader.Rule) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.failPut != nil {
		return f.failPut
	}
	if loader.SlotsFor(rules) > f.maxRules {
		return fmt.Errorf("%w (%d rules)", loader.ErrFull, f.maxRules)
	}
	next := map[string]loader.Rule{}
	type key struct {
		scope uint64
		dest  netip.Prefix
		port  uint16
	}
	keys := map[key]string{}
	for _, r := range rules {
		if err := r.Validate(); err != nil {
			return err
		}
		if _, dup := next[r.Name]; dup {
			return fmt.Errorf("rule %s twice: %w", r.Name, loader.ErrConflict)
		}
		next[r.Name] = r
		for _, d := range r.Dests {
			k := key{r.Scope.CgroupID, kernelrule.Mapped(d.Masked()), r.Port}
			if other, ok := keys[k]; ok {
				return fmt.Errorf("rule %s: %w: %v (port %d) is already rule %s's", r.Name, loader.ErrConflict, k.dest, k.port, other)
			}
			keys[k] = r.Name
		}
	}
	f.rules, f.synced, f.order = next, maps.Clone(next), nil
	f.syncs++
	return nil
}

func (f *fakeDatapath) Put(r loader.Rule) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.failPut != nil {
		return f.failPut
	}
	if err := r.Validate(); err != nil {
		return err
	}
	f.rules[r.Name] = r
	f.order = nil
	f.puts++
	return nil
}

func (f *fakeDatapath) MaxRules() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.maxRules
}

// Resize refuses a size that would not hold the rules, as the loader
// refuses one below a rule's slot.
func (f *fakeDatapath) Resize(n int) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.resizes = append(f.resizes, n)
	if n < len(f.rules) {
		return fmt.Errorf("%w: %d rules, %d slots", loader.ErrFull, len(f.rules), n)
	}
	f.maxRules = n
	return nil
}

// LastRefusal returns the newest refusal sent of pid's flow of proto to
// dest.
func (f *fakeDatapath) LastRefusal(pid uint32, proto loader.Protocols, dest netip.AddrPort) (loader.Refusal, bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, r := range slices.Backward(f.noted) {
		if r.PID == pid && r.Dest == dest && r.Protocol.Normal() == proto {
			return r, true, nil
		}
	}
	return loader.Refusal{}, false, nil
}

func (f *fakeDatapath) Rule(name string) (loader.Rule, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	r, ok := f.rules[name]
	if !ok {
		return loader.Rule{}, fmt.Errorf("rule %s: %w", name, loader.ErrUnknownRule)
	}
	return r, nil
}

// syncedRule returns a rule as the last Sync wrote it.
func (f *fakeDatapath) syncedRule(name string) (loader.Rule, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	r, ok := f.synced[name]
	return r, ok
}

// Reclaim lowers a granted rule's grant to what is spent and keep.
func (f *fakeDatapath) Reclaim(name string, keep uint64) (taken, granted uint64, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	r, ok := f.rules[name]
	if !ok || r.Shape != loader.ShapeGranted {
		return 0, 0, fmt.Errorf("rule %s: %w", name, loader.ErrUnknownRule)
	}
	next := min(r.Granted, f.stats[name].Spent+keep)
	taken, r.Granted = r.Granted-next, next
	f.rules[name] = r
	return taken, next, nil
}

func (f *fakeDatapath) Stats(name string) (loader.Stats, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.rules[name]; !ok {
		return loader.Stats{}, fmt.Errorf("rule %s: %w", name, loader.ErrUnknownRule)
	}
	return f.stats[name], nil
}

func (f *fakeDatapath) Live(name string) (int64, error) {
	f.mu.Lock()
	set := f.sets
	f.mu.Unlock()
	st, err := f.Stats(name)
	select {
	case f.lives <- liveRead{name, set}:
	default:
	}
	return st.Live, err
}

// awaitLive waits until a rule's live count has been read twice since
// set's call number set: the daemon has acted on the first read (its
// reader handles what one read brought before it reads again).
func (f *fakeDatapath) awaitLive(t *testing.T, rule string, set int) {
	t.Helper()
	timeout := time.After(time.Minute)
	for seen := 0; seen < 2; {
		select {
		case r := <-f.lives:
			if r.rule == rule && r.set >= set {
				seen++
			}
		case <-timeout:
			t.Fatal("live was not read twice within a minute of setting it")
		}
	}
}

func (f *fakeDatapath) Status() ([]loader.RuleStatus, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []loader.RuleStatus
	for _, name := range slices.Sorted(maps.Keys(f.rules)) {
		out = append(out, loader.RuleStatus{Rule: f.rules[name], Stats: f.stats[name]})
	}
	return out, nil
}

func (f *fakeDatapath) Counts(fn func(r *loader.Rule, s *loader.Stats)) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.order == nil {
		f.order = slices.Sorted(maps.Keys(f.rules))
	}
	var r loader.Rule
	var st loader.Stats
	for _, name := range f.order {
		r, st = f.rules[name], f.stats[name]
		st.ConnectLatency, st.RequestLatency = loader.Histogram{}, loader.Histogram{}
		fn(&r, &st)
	}
	return nil
}

func (f *fakeDatapath) Lost() (loader.Lost, error) { return loader.Lost{}, nil }

func (f *fakeDatapath) StorageUsed() (bool, error) { return false, nil }

func (f *fakeDatapath) Recount() (map[string]loader.Recount, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := map[string]loader.Recount{}
	for name := range f.rules {
		r := f.recounted[name]
		r.Live, r.Counted = f.stats[name].Live, f.stats[name].Live
		out[name] = r
	}
	f.recounted = nil
	return out, nil
}

func (f *fakeDatapath) Refusals() (reader[loader.Refusal], error) { return f.refusals, nil }
func (f *fakeDatapath) Samples() (reader[loader.Sample], error)   { return f.samples, nil }

func (f *fakeDatapath) Close() error     { f.closed = "closed"; return nil }
func (f *fakeDatapath) Uninstall() error { f.closed = "uninstalled"; return nil }

// refuse is a refusal in the kernel: noted for LastRefusal, and sent as
// an event.
func (f *fakeDatapath) refuse(r loader.Refusal) {
	f.mu.Lock()
	f.noted = append(f.noted, r)
	f.mu.Unlock()
	f.refusals.send(r)
}

// set sets a rule's counts, and returns the number of this call.
func (f *fakeDatapath) set(name string, st loader.Stats) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.stats[name] = st
	f.sets++
	return f.sets
}

func (f *fakeDatapath) ruleCount() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.rules)
}

// rule returns a rule and whether the kernel has it.
func (f *fakeDatapath) rule(name string) (loader.Rule, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	r, ok := f.rules[name]
	return r, ok
}

func (f *fakeDatapath) fail(err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.failPut = err
}

// fakeReader is an event stream a test feeds with send; drain waits until
// the daemon has handled all that was sent.
type fakeReader[T any] struct {
	ch          chan T
	sent, reads atomic.Int64
	asked       chan struct{} // a Read came since drain last looked
	once        sync.Once
	done        chan struct{}
}

func newFakeReader[T any]() *fakeReader[T] {
	return &fakeReader[T]{ch: make(chan T, 64), asked: make(chan struct{}, 1), done: make(chan struct{})}
}

func (r *fakeReader[T]) send(v T) { r.sent.Add(1); r.ch <- v }

// drain returns once the reader is asked for an event after the last one
// sent: the daemon is done with every event before it.
func (r *fakeReader[T]) drain(t *testing.T) {
	t.Helper()
	timeout := time.After(time.Minute)
	for r.reads.Load() != r.sent.Load()+1 {
		select {
		case <-r.asked:
		case <-timeout:
			t.Fatalf("the daemon read %d events of %d sent within a minute", r.reads.Load()-1, r.sent.Load())
		}
	}
}

func (r *fakeReader[T]) Read() (T, error) {
	r.reads.Add(1)
	select {
	case r.asked <- struct{}{}:
	default: // drain has yet to look since the last Read
	}
	select {
	case v := <-r.ch:
		return v, nil
	case <-r.done:
		var zero T
		return zero, loader.ErrClosed
	}
}

func (r *fakeReader[T]) Close() error {
	r.once.Do(func() { close(r.done) })
	return nil
}

var errWrite = errors.New("the kernel says no")
