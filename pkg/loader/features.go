package loader

// Feature is one thing the datapath needs from the kernel, and whether
// this kernel has it. ProbeFeatures derives the list from the compiled
// programs themselves, so it names exactly what this build uses.
type Feature struct {
	// Kind groups features; see the Feature* constants.
	Kind string
	// Name says which one: a map or program type ("SkStorage",
	// "CGroupSockAddr"), a helper and the program type calling it
	// ("bpf_set_retval in CGroupSockAddr"), an attach point
	// ("cgroup/connect4"). Used names the programs or maps needing it.
	Name string
	Used []string
	// Err is nil when the kernel has the feature and matches
	// ErrNotSupported when it does not. Any other error means the probe
	// could not tell, most often for want of privilege to load BPF.
	Err error
}

// Kinds of Feature, in the order ProbeFeatures reports them.
const (
	FeatureBTF         = "btf"
	FeatureMapType     = "map type"
	FeatureProgramType = "program type"
	FeatureHelper      = "helper"
	FeatureAttach      = "attach point"
	FeatureISA         = "instruction set"
	// FeatureLoad is the datapath itself: every program through the
	// verifier of this kernel, nothing attached or pinned.
	FeatureLoad = "load"
)

// Pinned describes a datapath pinned under a bpffs directory, as found
// without adopting it.
type Pinned struct {
	Dir string
	// Links are the pinned attachments; a datapath with none enforces
	// nothing.
	Links []PinnedLink
	// Maps is how many maps are pinned.
	Maps int
	// MaxRules is the size of the pinned rule tables.
	MaxRules int
	// Incompatible says why this build could not adopt the pinned maps
	// (the daemon would refuse to start until `egressd uninstall`); nil
	// when it can.
	Incompatible error
}

// PinnedLink is one pinned attachment of a program to a cgroup.
type PinnedLink struct {
	// Name is the program's ("connect4", "sockops", ...).
	Name string
	// CgroupID is the cgroup it is attached to (cgroups.ID's number).
	CgroupID uint64
}
