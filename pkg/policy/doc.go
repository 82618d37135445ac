// Package policy reads, checks and writes egressd's policy file: the rules an
// operator writes to bound what a host's services may open to their
// dependencies.
//
//	rules:
//	  - name: payments
//	    destination: 10.20.0.0/16
//	    port: 443
//	    unit: payments.service        # or cgroup: /system.slice/payments.service; absent = whole host
//	    concurrency: 50
//	  - name: email
//	    destination: smtp.example.com
//	    port: 25
//	    perSecond: {permits: 10, burst: 20}
//	  - name: search
//	    destination: 127.0.0.1
//	    port: 9200
//	    perWindow: {permits: 1000, window: 1m, segments: 8}
//	  - name: api
//	    destination: 2001:db8::/32
//	    adaptive: {minimum: 4, maximum: 200, samples: request}
//	    shadow: true
//	    errno: ECONNREFUSED
//
// A file is checked whole and every problem is reported at once, each with
// its line and column, because an operator fixing a policy during an incident
// should not learn of the problems one reload at a time. Unknown fields are
// problems too: a misspelt "burts" that was silently ignored would leave a
// limit the operator believes is set. An empty file, or one with no rules, is
// a valid policy that limits nothing.
//
// YAML aliases (*name) are refused: followed, they would let a few lines
// stand for millions, and a policy repeats too little to need them.
//
// Fields that have a default (perSecond.burst, perWindow.segments, every
// adaptive field) are zero in a [Rule] when the file leaves them out, so that
// a policy written back by [Format] keeps following the defaults rather than
// freezing today's values. Writing such a field as 0 is a problem, not a way
// to ask for the default: a limit of zero is almost always a mistake.
//
// The package checks a rule as the kernel will take it ([Rule.LoaderRule]
// gives a rule that kernelrule.Rule.Validate accepts once it has a destination),
// so a policy that passes here is not refused later, half applied, by the
// datapath. What only the running host can tell — whether a unit or cgroup
// exists, what a host name resolves to, whether two spellings name the same
// cgroup — is left to the daemon.
package policy
