package partition

import "context"

// Limiter is one partition's limiter. Acquire returns a permit, or a
// refusal (a *verdict.RateLimitedError), or the context's error when the
// context ended while the caller waited, or another error when no decision
// could be had (a shared limiter's *shared.StoreError). [Adapt] makes one of
// a *limit.Local or a *shared.Limiter.
type Limiter interface {
	Acquire(ctx context.Context) (Releaser, error)
	Name() string
}

// Releaser is a permit a [Limiter] handed out. Release it once, however the
// work it guarded ended.
type Releaser interface {
	Release()
}

// leaser is a limiter whose Acquire returns its lease as a value, the way
// package limit's and package shared's do, so that acquiring allocates
// nothing.
type leaser[L any] interface {
	Acquire(ctx context.Context) (L, error)
	Name() string
}

// Adapt returns l as a [Limiter]. l is a *limit.Local, a *shared.Limiter, or
// any limiter of their form: Acquire returns a lease value L whose pointer
// has Release, and whose zero value holds nothing. A lease that holds
// nothing - every rate permit, which is spent when taken - is handed on
// without allocating; one that holds something is boxed once.
func Adapt[L comparable, P interface {
	*L
	Releaser
}](l interface {
	Acquire(ctx context.Context) (L, error)
	Name() string
}) Limiter {
	return &adapted[L, P]{l: l}
}

type adapted[L comparable, P interface {
	*L
	Releaser
}] struct {
	l leaser[L]
}

func (a *adapted[L, P]) Name() string { return a.l.Name() }

func (a *adapted[L, P]) Acquire(ctx context.Context) (Releaser, error) {
	lease, err := a.l.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	var zero L
	if lease == zero {
		return nothing{}, nil
	}
	return &boxed[L, P]{lease: lease}, nil
}

// boxed is a lease that holds something, released through its pointer.
type boxed[L comparable, P interface {
	*L
	Releaser
}] struct {
	lease L
}

func (b *boxed[L, P]) Release() { b.release() }

// release releases the lease unless it was already, and reports whether
// it did. The box is shared by every copy of the partition.Lease that holds
// it, so a copy released as well finds it empty.
func (b *boxed[L, P]) release() bool {
	var zero L
	if b.lease == zero {
		return false
	}
	P(&b.lease).Release()
	b.lease = zero // for a lease type whose Release does not zero it
	return true
}

// nothing is the lease that holds nothing.
type nothing struct{}

func (nothing) Release() {}
