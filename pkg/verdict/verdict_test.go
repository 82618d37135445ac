package verdict

import (
	"fmt"
	"math"
	"testing"
	"time"
	"unsafe"
)

// The verdict is live across every attempt, so its size is paid by every
// call; the self-imposed bit and the RetryAfter hint must cost nothing.
func TestVerdictCarriesOriginAndPushbackForFree(t *testing.T) {
	if got := unsafe.Sizeof(Verdict{}); got != 16 {
		t.Errorf("unsafe.Sizeof(Verdict{}) = %d, want 16", got)
	}
	if got := unsafe.Sizeof(Attempt{}); got != 24 {
		t.Errorf("unsafe.Sizeof(Attempt{}) = %d, want 24", got)
	}
}

// The names are what logs print (Kind, in a verdict) and the label values
// metrics use (Suppression, docs/metrics.md): they must not change.
func TestNames(t *testing.T) {
	tests := []struct {
		v    fmt.Stringer
		want string
	}{
		{OK, "OK"},
		{Transient, "Transient"},
		{Throttled, "Throttled"},
		{Permanent, "Permanent"},
		{Kind(kindLen), "Kind(4)"},
		{SuppressedNone, "none"},
		{SuppressedCriticality, "criticality"},
		{SuppressedBreaker, "breaker"},
		{SuppressedRefused, "refused"},
		{SuppressedBudget, "budget"},
		{SuppressedAttempts, "attempts"},
		{Suppression(suppressionLen), "Suppression(6)"},
	}
	for _, tt := range tests {
		if got := tt.v.String(); got != tt.want {
			t.Errorf("String() = %q, want %q", got, tt.want)
		}
	}
	// The kind must fit under the self-imposed bit.
	if kindLen > selfImposedBit {
		t.Errorf("%d kinds collide with the self-imposed bit", kindLen)
	}
}

func TestZeroValueIsOKAndReachedTheDependency(t *testing.T) {
	var v Verdict
	if v.Kind() != OK {
		t.Errorf("zero Kind = %v, want OK", v.Kind())
	}
	if v.SelfImposed() {
		t.Error("zero verdict claims to be self-imposed")
	}
	if d, ok := v.RetryAfter(); ok {
		t.Errorf("zero verdict has RetryAfter %v", d)
	}
	if v != New(OK) {
		t.Error("Verdict{} != New(OK)")
	}
}

func TestConstructors(t *testing.T) {
	tests := []struct {
		name        string
		v           Verdict
		kind        Kind
		selfImposed bool
		retryAfter  time.Duration
		hasHint     bool
		str         string
	}{
		{"ok", New(OK), OK, false, 0, false, "OK"},
		{"transient", New(Transient), Transient, false, 0, false, "Transient"},
		{"throttled", New(Throttled), Throttled, false, 0, false, "Throttled"},
		{"permanent", New(Permanent), Permanent, false, 0, false, "Permanent"},
		{"throttled with hint", New(Throttled).WithRetryAfter(2 * time.Second), Throttled, false, 2 * time.Second, true, "Throttled(retry after 2s)"},
		{"transient retry now", New(Transient).WithRetryAfter(0), Transient, false, 0, true, "Transient(retry after 0s)"},
		{"refused with hint", Refused(200 * time.Millisecond), Throttled, true, 200 * time.Millisecond, true, "Throttled(self-imposed, retry after 200ms)"},
		{"refused retry now", Refused(0), Throttled, true, 0, true, "Throttled(self-imposed, retry after 0s)"},
		{"refused no hint", Refused(NoRetryAfter), Throttled, true, 0, false, "Throttled(self-imposed)"},
		{"refused negative", Refused(-time.Hour), Throttled, true, 0, false, "Throttled(self-imposed)"},
		{"hint cleared", Refused(time.Second).WithRetryAfter(NoRetryAfter), Throttled, true, 0, false, "Throttled(self-imposed)"},
		{"hint saturates", New(Throttled).WithRetryAfter(math.MaxInt64), Throttled, false, maxRetryAfter, true, "Throttled(retry after " + maxRetryAfter.String() + ")"},
		{"largest exact hint", New(Throttled).WithRetryAfter(maxRetryAfter - 1), Throttled, false, maxRetryAfter - 1, true, "Throttled(retry after " + (maxRetryAfter - 1).String() + ")"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tt.v.Kind(); got != tt.kind {
				t.Errorf("Kind() = %v, want %v", got, tt.kind)
			}
			if got := tt.v.SelfImposed(); got != tt.selfImposed {
				t.Errorf("SelfImposed() = %v, want %v", got, tt.selfImposed)
			}
			d, ok := tt.v.RetryAfter()
			if d != tt.retryAfter || ok != tt.hasHint {
				t.Errorf("RetryAfter() = %v, %v; want %v, %v", d, ok, tt.retryAfter, tt.hasHint)
			}
			if got := tt.v.String(); got != tt.str {
				t.Errorf("String() = %q, want %q", got, tt.str)
			}
		})
	}
}

func TestRetryNowIsNotNothingSaid(t *testing.T) {
	if Refused(0) == Refused(NoRetryAfter) {
		t.Error("Refused(0) == Refused(NoRetryAfter): retry now is indistinguishable from no hint")
	}
	if New(Throttled).WithRetryAfter(0) == New(Throttled) {
		t.Error("a zero RetryAfter is indistinguishable from none")
	}
}

func TestNewRejectsInvalidKind(t *testing.T) {
	for _, k := range []Kind{kindLen, selfImposedBit | Throttled, math.MaxUint8} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("New(%d) did not panic", k)
				}
			}()
			New(k)
		}()
	}
}

func TestAttemptPacksKindAndOrigin(t *testing.T) {
	tests := []struct {
		name     string
		v        Verdict
		duration time.Duration
		delay    time.Duration
		wantDur  time.Duration
		wantDel  time.Duration
	}{
		{"ok", New(OK), 15 * time.Millisecond, 0, 15 * time.Millisecond, 0},
		{"transient", New(Transient), time.Second, 100 * time.Millisecond, time.Second, 100 * time.Millisecond},
		{"server 429", New(Throttled).WithRetryAfter(3 * time.Second), 40 * time.Millisecond, 3 * time.Second, 40 * time.Millisecond, 3 * time.Second},
		{"refusal", Refused(50 * time.Millisecond), 0, 50 * time.Millisecond, 0, 50 * time.Millisecond},
		{"refusal no hint", Refused(NoRetryAfter), time.Microsecond, time.Second, time.Microsecond, time.Second},
		{"permanent", New(Permanent), time.Hour, 0, time.Hour, 0},
		{"negative clamps", New(Transient), -time.Second, -time.Second, 0, 0},
		{"longest", New(Transient), MaxAttemptDuration, 0, MaxAttemptDuration, 0},
		{"saturates", Refused(time.Second), math.MaxInt64, 0, MaxAttemptDuration, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a := NewAttempt(tt.v, tt.duration, tt.delay)
			if got := a.Verdict(); got != tt.v {
				t.Errorf("Verdict() = %v, want %v", got, tt.v)
			}
			if a.Kind() != tt.v.Kind() || a.SelfImposed() != tt.v.SelfImposed() {
				t.Errorf("Kind(), SelfImposed() = %v, %v; want %v, %v", a.Kind(), a.SelfImposed(), tt.v.Kind(), tt.v.SelfImposed())
			}
			if got := a.Duration(); got != tt.wantDur {
				t.Errorf("Duration() = %v, want %v", got, tt.wantDur)
			}
			if got := a.Delay(); got != tt.wantDel {
				t.Errorf("Delay() = %v, want %v", got, tt.wantDel)
			}
		})
	}
}

func TestAttemptString(t *testing.T) {
	a := NewAttempt(Refused(50*time.Millisecond), 2*time.Millisecond, 50*time.Millisecond)
	want := "Throttled(self-imposed, retry after 50ms) in 2ms, then 50ms"
	if got := a.String(); got != want {
		t.Errorf("String() = %q, want %q", got, want)
	}
}

func TestAttemptHedging(t *testing.T) {
	base := NewAttempt(New(Transient), time.Second, 3*time.Second)
	tests := []struct {
		name       string
		a          Attempt
		hedge      bool
		lost       bool
		suppressed Suppression
		str        string
	}{
		{"plain", base, false, false, SuppressedNone, "Transient in 1s, then 3s"},
		{"hedge", base.AsHedge(), true, false, SuppressedNone, "hedge: Transient in 1s, then 3s"},
		{"lost", base.AsLost(), false, true, SuppressedNone, "Transient in 1s, then 3s (lost)"},
		{"lost hedge", base.AsHedge().AsLost(), true, true, SuppressedNone, "hedge: Transient in 1s, then 3s (lost)"},
		{"suppressed", base.WithSuppressed(SuppressedBudget), false, false, SuppressedBudget, "Transient in 1s, then 3s (hedge suppressed: budget)"},
		{"suppressed twice keeps the last", base.WithSuppressed(SuppressedBreaker).WithSuppressed(SuppressedAttempts).AsHedge(), true, false, SuppressedAttempts, "hedge: Transient in 1s, then 3s (hedge suppressed: attempts)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if tt.a.Hedge() != tt.hedge || tt.a.Lost() != tt.lost || tt.a.Suppressed() != tt.suppressed {
				t.Errorf("Hedge, Lost, Suppressed = %v, %v, %v; want %v, %v, %v", tt.a.Hedge(), tt.a.Lost(), tt.a.Suppressed(), tt.hedge, tt.lost, tt.suppressed)
			}
			// The flags ride in spare bits: the rest of the record is intact.
			if tt.a.Verdict() != base.Verdict() || tt.a.Duration() != base.Duration() || tt.a.Delay() != base.Delay() {
				t.Errorf("record changed: %v", tt.a)
			}
			if got := tt.a.String(); got != tt.str {
				t.Errorf("String() = %q, want %q", got, tt.str)
			}
		})
	}
	for s := Suppression(0); s.Valid(); s++ {
		if s.String() == "" || NewAttempt(Verdict{}, 0, 0).WithSuppressed(s).Suppressed() != s {
			t.Errorf("suppression %d does not round-trip", s)
		}
	}
	if got := NewAttempt(Verdict{}, 0, math.MaxInt64).Delay(); got != MaxAttemptDuration {
		t.Errorf("Delay of MaxInt64 = %v, want it saturated at %v", got, MaxAttemptDuration)
	}
}
