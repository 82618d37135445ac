package sdk

import (
	"math"
	"sync/atomic"
)

// budgetUnit is one token in the budget's fixed-point arithmetic.
const budgetUnit = 1_000_000

// RetryBudget bounds retries as a fraction of the traffic that reached the
// dependency. It is a token bucket: every call that comes to verdict.OK
// deposits Ratio of a token, every retry spends one, and the bucket holds at
// most Capacity tokens (it starts full, so a cold client can still retry a
// burst of failures).
//
// Two kinds of traffic are exempt. A retry after a self-imposed refusal
// neither spends nor funds it: the refused call never left the process, so
// retrying it costs the dependency nothing. And work below Critical (see
// Criticality) may not spend the last half of the bucket, which is kept for
// work somebody is waiting for. Hedges (see Hedge) spend it like retries,
// and never take the last half either: as in gRPC's retry throttling, no
// hedge is sent once the tokens are down to half. A hedge this process
// refused gets its token back, as a refused retry spends none.
//
// A RetryBudget is safe for concurrent use; share one per dependency.
type RetryBudget struct {
	deposit  int64 // per OK, in units
	capacity int64 // in units
	tokens   atomic.Int64
}

// NewRetryBudget returns a full budget that lets retries reach ratio of the
// successful traffic (0.1: one retry per ten successes) with a burst of
// capacity retries. It panics unless ratio > 0 and capacity >= 1.
func NewRetryBudget(ratio float64, capacity int) *RetryBudget {
	if !(ratio > 0) || capacity < 1 {
		panic("sdk: NewRetryBudget needs ratio > 0 and capacity >= 1")
	}
	c := int64(min(float64(capacity), math.MaxInt64/(2*budgetUnit)))
	b := &RetryBudget{
		deposit:  max(int64(min(ratio, float64(c))*budgetUnit), 1),
		capacity: c * budgetUnit,
	}
	b.tokens.Store(b.capacity)
	return b
}

// Deposit credits the budget for one call that came to verdict.OK.
func (b *RetryBudget) Deposit() { b.add(b.deposit) }

// refund gives back a token taken for a retry or hedge that never reached
// the dependency. It stops at capacity: deposits may have filled the bucket
// since.
func (b *RetryBudget) refund() { b.add(budgetUnit) }

// add credits units, up to capacity.
func (b *RetryBudget) add(units int64) {
	for {
		t := b.tokens.Load()
		if t >= b.capacity {
			return
		}
		if b.tokens.CompareAndSwap(t, min(t+units, b.capacity)) {
			return
		}
	}
}

// TrySpend takes one token for a retry of work at criticality c, and reports
// whether it could. Work below Critical cannot take the last half.
func (b *RetryBudget) TrySpend(c Criticality) bool {
	var floor int64
	if c < Critical {
		floor = b.capacity / 2
	}
	return b.trySpend(floor)
}

// trySpendHedge takes one token for a hedge, which may not take the last
// half of the bucket whatever the criticality.
func (b *RetryBudget) trySpendHedge() bool { return b.trySpend(b.capacity / 2) }

// trySpend takes one token if as much as floor is left after it.
func (b *RetryBudget) trySpend(floor int64) bool {
	for {
		t := b.tokens.Load()
		if t-budgetUnit < floor {
			return false
		}
		if b.tokens.CompareAndSwap(t, t-budgetUnit) {
			return true
		}
	}
}

// Tokens returns how many retries the budget holds now.
func (b *RetryBudget) Tokens() float64 {
	return float64(b.tokens.Load()) / budgetUnit
}
