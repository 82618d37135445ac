package sdk

import (
	"context"
	"fmt"
	"strings"
	"testing"
)

// A StopError's message starts with its reason's name, and docs/sdk.md
// lists them: they must not change.
func TestNames(t *testing.T) {
	tests := []struct {
		v    fmt.Stringer
		want string
	}{
		{StopSuccess, "success"},
		{StopAttemptsExhausted, "attempts exhausted"},
		{StopDeadline, "deadline"},
		{StopBudget, "retry budget exhausted"},
		{StopBreakerOpen, "breaker open"},
		{StopPermanent, "permanent"},
		{StopCancelled, "cancelled"},
		{StopInvalidUse, "invalid use"},
		{StopInvalidUse + 1, "StopReason(8)"},
		{BreakerClosed, "closed"},
		{BreakerOpen, "open"},
		{BreakerHalfOpen, "half-open"},
		{BreakerHalfOpen + 1, "BreakerState(3)"},
	}
	for _, tt := range tests {
		if got := tt.v.String(); got != tt.want {
			t.Errorf("String() = %q, want %q", got, tt.want)
		}
	}
}

func TestCriticality(t *testing.T) {
	if got := CriticalityFrom(context.Background()); got != Critical {
		t.Errorf("CriticalityFrom(Background) = %v, want Critical", got)
	}
	var zero Criticality
	if zero != Critical {
		t.Errorf("zero Criticality = %v, want Critical", zero)
	}
	for _, c := range []Criticality{Sheddable, SheddablePlus, Critical, CriticalPlus} {
		if got := CriticalityFrom(WithCriticality(context.Background(), c)); got != c {
			t.Errorf("round trip of %v = %v", c, got)
		}
		if strings.HasPrefix(c.String(), "Criticality(") {
			t.Errorf("%d has no name", c)
		}
	}
	if !(Sheddable < SheddablePlus && SheddablePlus < Critical && Critical < CriticalPlus) {
		t.Error("criticality levels are out of order")
	}
}
