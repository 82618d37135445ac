// Package decide decides how much of a budget shared with other hosts
// through Redis one host holds. It is pure: a state machine per budget
// shape ([Slots] for concurrency, [Grants] for rates) turns what the
// kernel shows and what Redis answers into the kernel limit or grant to
// set, and does no I/O. The daemon observes, asks the machine, performs
// what it says and reports back; the tests drive every transition, and a
// simulation of many hosts, one Redis and their faults, without root.
//
// The promise both keep: a kernel admits only on slots or permits Redis
// has confirmed to its host. A share grows only after Redis said so (and,
// when replicas are asked for, after they did too), and shrinks in the
// kernel before it hands anything back.
package decide

import "time"

//go:generate go tool stringer -type=Mode -linecomment

// Mode is what a share does while Redis cannot be reached: a shared
// rule's failure mode.
type Mode uint8

const (
	// KeepShare keeps the share held (failure mode throw): the same slots, or
	// a per-second bucket at the rate the host claimed lately. A
	// concurrency share stops admitting once its slots' lease could have
	// run out in Redis, since another host may then take them.
	KeepShare Mode = iota // throw
	// Allow enforces the whole budget on this host alone: the budget is
	// not kept while Redis is away.
	Allow // allow
	// Deny admits nothing new.
	Deny // deny

	modeLen = iota // sentinel, untyped for stringer; keep last.
)

// Outage is what a share knows of Redis being unreachable.
type Outage struct {
	// Since is when the share last found Redis unreachable, zero while it
	// answers; Err is the latest failure.
	Since time.Time
	Err   error
}

// Failing reports whether Redis is unreachable (the failure mode is in
// force).
func (o Outage) Failing() bool { return !o.Since.IsZero() }

// Event is a change worth a log line, as a share reports it.
type Event uint8

const (
	// Failed: Redis became unreachable; the failure mode is in force.
	Failed Event = 1 << iota
	// Recovered: Redis answers again.
	Recovered
	// StateLost: Redis answered with another epoch than before: it lost
	// the budget's state (a restart without persistence, a failover to a
	// replica that lacked it). Growth is frozen for a lease.
	StateLost
	// Expired: Redis has been unreachable so long that the slots' lease
	// may have run out there; the kernel admits nothing new.
	Expired
	// Unconfirmed: replicas did not confirm a grant in time; it is not
	// used.
	Unconfirmed
)
