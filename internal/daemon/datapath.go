package daemon

import (
	"net/netip"

	"github.com/egressd/egressd/pkg/loader"
)

// datapath is what the daemon asks of the kernel side: the methods of
// *loader.Datapath it calls, declared here so that the daemon's decisions
// (which rules to install, how a share moves, what an adaptive loop
// pushes) are tested against an in-memory fake without root, and the real
// kernel stays in the end-to-end tests.
type datapath interface {
	Adopted() bool
	PinDir() string
	// Sync makes rules the whole rule set, all or nothing; Put changes
	// one rule in place.
	Sync(rules []loader.Rule) error
	Put(r loader.Rule) error
	// MaxRules is the size of the rule tables; Resize moves the rules to
	// tables of n slots, enforcing all along.
	MaxRules() int
	Resize(n int) error
	Rule(name string) (loader.Rule, error)
	// Reclaim takes a granted rule's unspent permits back, but keep.
	Reclaim(name string, keep uint64) (taken, granted uint64, err error)
	Stats(name string) (loader.Stats, error)
	Live(name string) (int64, error)
	Status() ([]loader.RuleStatus, error)
	// Counts is Status without latency histograms, rule by rule to fn.
	Counts(fn func(r *loader.Rule, s *loader.Stats)) error
	Lost() (loader.Lost, error)
	Recount() (map[string]loader.Recount, error)
	// StorageUsed is whether Recount cannot give back drift.
	StorageUsed() (bool, error)
	// LastRefusal is the kernel's note of pid's latest refused connect()
	// to dest.
	LastRefusal(pid uint32, proto loader.Protocols, dest netip.AddrPort) (loader.Refusal, bool, error)
	Refusals() (reader[loader.Refusal], error)
	Samples() (reader[loader.Sample], error)
	// Close leaves the datapath pinned and enforcing; Uninstall detaches
	// it and removes the pins.
	Close() error
	Uninstall() error
}

// reader is a stream of kernel events; Read returns loader.ErrClosed
// once Close was called.
type reader[T any] interface {
	Read() (T, error)
	Close() error
}

// kernel is the real datapath. Its event readers are concrete types,
// which the interface's methods return as readers.
type kernel struct{ *loader.Datapath }

func (k kernel) Refusals() (reader[loader.Refusal], error) {
	r, err := k.Datapath.Refusals()
	if err != nil {
		return nil, err
	}
	return r, nil
}

func (k kernel) Samples() (reader[loader.Sample], error) {
	r, err := k.Datapath.Samples()
	if err != nil {
		return nil, err
	}
	return r, nil
}

// openKernel opens (or adopts) the pinned datapath.
func openKernel(cfg *loader.Config) (datapath, error) {
	dp, err := loader.Open(cfg)
	if err != nil {
		return nil, err
	}
	return kernel{dp}, nil
}
