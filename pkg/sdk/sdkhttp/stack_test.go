package sdkhttp

import (
	"errors"
	"strings"
	"testing"

	"github.com/egressd/egressd/pkg/limit"
	"github.com/egressd/egressd/pkg/sdk"
)

// The limiter goes inside the retries. The other order takes one permit for
// a request that goes on to make several attempts, so Build refuses it -
// with every other problem - rather than build it.
func TestBuildRefusesWrongOrder(t *testing.T) {
	l := limit.Concurrency(1)
	p := testPolicy(3)
	tests := []struct {
		name  string
		stack *Stack
		want  []string // one substring per problem, in order
	}{
		{"limit outside retry", NewStack(nil).Limit(l).Retry(p),
			[]string{`Limit("concurrency") is outside Retry`}},
		{"quota outside retry", NewStack(nil).Quota(QuotaOptions{}).Retry(p),
			[]string{"Quota is outside Retry"}},
		{"both outside retry", NewStack(nil).Quota(QuotaOptions{}).Limit(l).Retry(p).Limit(l),
			[]string{"Quota is outside Retry", `Limit("concurrency") is outside Retry`}},
		{"two retry loops", NewStack(nil).Retry(p).Retry(p),
			[]string{"Retry is added more than once"}},
		{"two quota guards", NewStack(nil).Retry(p).Quota(QuotaOptions{}).Quota(QuotaOptions{}),
			[]string{"Quota is added more than once"}},
		{"every problem at once", NewStack(nil).Limit(nil).Retry(nil).Quota(QuotaOptions{Reserve: -1}),
			[]string{"Limit(nil): pass a limiter", "Retry(nil)", "Limit(nil) is outside Retry", "Quota.Reserve -1 must not be negative"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rt, err := tt.stack.Build()
			if rt != nil || !errors.Is(err, ErrInvalidStack) {
				t.Fatalf("Build = %v, %v; want a *StackError", rt, err)
			}
			se, _ := AsStackError(err)
			if len(se.Problems) != len(tt.want) {
				t.Fatalf("problems %q, want %d matching %q", se.Problems, len(tt.want), tt.want)
			}
			for i, want := range tt.want {
				if !strings.Contains(se.Problems[i], want) {
					t.Errorf("problem %d = %q, want it to contain %q", i, se.Problems[i], want)
				}
			}
		})
	}
}

func TestBuildAcceptsTheRightOrders(t *testing.T) {
	p := testPolicy(3)
	for name, s := range map[string]*Stack{
		"empty":                  NewStack(nil),
		"retry":                  NewStack(nil).Retry(p),
		"retry, quota, limits":   NewStack(nil).Retry(p).Quota(QuotaOptions{Reserve: 2}).Limit(limit.PerSecond(10)).Limit(limit.Concurrency(2)),
		"retry, limit, quota":    NewStack(nil).Retry(p).Limit(limit.PerSecond(10)).Quota(QuotaOptions{}),
		"limit without retries":  NewStack(nil).Limit(limit.Concurrency(2)),
		"quota without retries":  NewStack(nil).Quota(QuotaOptions{}),
		"defaults with a daemon": NewStack(nil).Retry(Defaults()),
	} {
		if _, err := s.Build(); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
}

// Build copies the policy: changing it afterwards changes nothing, and the
// copy shares the budget and the breaker.
func TestBuildCopiesThePolicy(t *testing.T) {
	p := testPolicy(3)
	p.Budget = sdk.NewRetryBudget(0.1, 10)
	rt, err := NewStack(nil).Retry(p).Build()
	if err != nil {
		t.Fatal(err)
	}
	p.MaxAttempts = 1
	got := rt.rt.(*retryLayer).policy
	if got.MaxAttempts != 3 || got.Budget != p.Budget || got.Classifier == nil {
		t.Errorf("built policy: %d attempts, budget shared %v, classifier %v", got.MaxAttempts, got.Budget == p.Budget, got.Classifier)
	}
}
