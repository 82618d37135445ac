// Package loader owns everything that touches the kernel: it loads the BPF
// programs of bpf/egressd.c, attaches them to a cgroup, pins maps and links
// under bpffs so that enforcement outlives the process, adopts a pinned
// datapath on the next start, and turns rules, counters, refusal events,
// latency samples and recounts into plain Go types. No cilium/ebpf type
// crosses its API.
//
// Accounting: a connect() that a rule admits reserves a slot, recorded in
// the socket's storage with the rule's slot and generation; the slot is
// given back exactly once, at the first of TCP_CLOSE, the socket's release
// or a second connect(). Rules are identified by name; a changed rule keeps
// its counts, a deleted one's sockets never touch a later rule's.
//
// Off Linux, Open returns ErrNotSupported.
package loader
