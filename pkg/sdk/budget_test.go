package sdk

import "testing"

func TestRetryBudget(t *testing.T) {
	// An op acts on the budget; want is whether a spend was allowed (a
	// deposit always is).
	type op struct {
		name string
		do   func(*RetryBudget) bool
		want bool
	}
	spend := func(c Criticality, want bool) op {
		return op{"spend " + c.String(), func(b *RetryBudget) bool { return b.TrySpend(c) }, want}
	}
	deposit := op{"deposit", func(b *RetryBudget) bool { b.Deposit(); return true }, true}
	refund := op{"refund", func(b *RetryBudget) bool { b.refund(); return true }, true}
	tests := []struct {
		name       string
		ratio      float64
		capacity   int
		ops        []op
		wantTokens float64
	}{
		{"starts full", 0.1, 3, nil, 3},
		{"critical spends to empty", 0.1, 3, []op{spend(Critical, true), spend(Critical, true), spend(Critical, true), spend(Critical, false)}, 0},
		{"critical plus spends like critical", 0.5, 2, []op{spend(CriticalPlus, true), spend(CriticalPlus, true), spend(CriticalPlus, false)}, 0},
		{"sheddable keeps the last half", 0.1, 4, []op{spend(Sheddable, true), spend(Sheddable, true), spend(Sheddable, false), spend(Critical, true)}, 1},
		{"sheddable plus keeps the last half", 0.1, 10, []op{spend(SheddablePlus, true), spend(SheddablePlus, true), spend(SheddablePlus, true), spend(SheddablePlus, true), spend(SheddablePlus, true), spend(SheddablePlus, false)}, 5},
		{"ten successes fund one retry", 0.1, 1, []op{spend(Critical, true), deposit, deposit, deposit, deposit, deposit, deposit, deposit, deposit, deposit, spend(Critical, false), deposit, spend(Critical, true)}, 0},
		{"deposits stop at capacity", 0.5, 2, []op{deposit, deposit, deposit}, 2},
		{"a refund gives a token back", 0.1, 3, []op{spend(Critical, true), spend(Critical, true), refund}, 2},
		{"refunds stop at capacity", 0.1, 3, []op{deposit, spend(Critical, true), refund, refund}, 3},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := NewRetryBudget(tt.ratio, tt.capacity)
			for i, o := range tt.ops {
				if got := o.do(b); got != o.want {
					t.Errorf("op %d (%s) = %v, want %v", i, o.name, got, o.want)
				}
			}
			if got := b.Tokens(); got < tt.wantTokens-1e-6 || got > tt.wantTokens+1e-6 {
				t.Errorf("Tokens() = %v, want %v", got, tt.wantTokens)
			}
		})
	}
}

func TestNewRetryBudgetRejectsNonsense(t *testing.T) {
	for _, tt := range []struct {
		ratio    float64
		capacity int
	}{{0, 10}, {-1, 10}, {0.1, 0}} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("NewRetryBudget(%v, %d) did not panic", tt.ratio, tt.capacity)
				}
			}()
			NewRetryBudget(tt.ratio, tt.capacity)
		}()
	}
}
