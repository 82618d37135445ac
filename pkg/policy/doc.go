// Package policy reads, checks and writes egressd's policy file: the rules an
// operator writes to bound what a host's services may open to their
// dependencies.
//
//	rules:
//	  - name: payments
//	    destination: 10.20.0.0/16
//	    port: 443
//	    unit: payments.service
//	    concurrency: 50
//
// [Load] and [Parse] check a file whole and report every problem at once,
// each with its line and column; unknown fields and YAML aliases are
// problems too. An empty file is a valid policy that limits nothing.
//
// A field with a default (perSecond.burst, perWindow.segments, every
// adaptive field) is zero in a [Rule] when the file leaves it out, so that a
// policy written back by [Format] keeps following the defaults; writing it
// as 0 is a problem, not a way to ask for the default.
//
// [Fields] describes a rule's fields once, for the three ways a rule is
// written: [Parse] reads them from a file, [Format] writes them back, and
// [FromFlags] reads them from the flags of egressd limit set.
//
// A rule that passes here is one the kernel takes ([Rule.LoaderRule]), so a
// policy is never refused later, half applied, by the datapath. What only
// the running host can tell (whether a unit or cgroup exists, whether two
// spellings name one cgroup, what a name resolves to) is left to the
// daemon. docs/policy.md is the reference.
package policy
