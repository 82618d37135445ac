package serve

import (
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/egressd/egressd/pkg/sdk"
)

func TestLevel(t *testing.T) {
	zero := CriticalityOptions{} // Default and Ceiling Critical
	trusting := CriticalityOptions{Default: sdk.SheddablePlus, Ceiling: sdk.CriticalPlus}
	wary := CriticalityOptions{Default: sdk.SheddablePlus, Ceiling: sdk.SheddablePlus}
	tests := []struct {
		name   string
		opts   CriticalityOptions
		values []string
		want   sdk.Criticality
		result HeaderResult
	}{
		{"missing", zero, nil, sdk.Critical, HeaderMissing},
		{"missing, other default", trusting, nil, sdk.SheddablePlus, HeaderMissing},
		{"sheddable", zero, []string{"Sheddable"}, sdk.Sheddable, HeaderAccepted},
		{"any case, spaces", zero, []string{"  sheddableplus "}, sdk.SheddablePlus, HeaderAccepted},
		{"critical", zero, []string{"Critical"}, sdk.Critical, HeaderAccepted},
		{"above the ceiling", zero, []string{"CriticalPlus"}, sdk.Critical, HeaderCapped},
		{"within a raised ceiling", trusting, []string{"CriticalPlus"}, sdk.CriticalPlus, HeaderAccepted},
		{"wary: critical is capped", wary, []string{"Critical"}, sdk.SheddablePlus, HeaderCapped},
		{"wary: lowering is fine", wary, []string{"Sheddable"}, sdk.Sheddable, HeaderAccepted},
		{"unknown name", trusting, []string{"Urgent"}, sdk.SheddablePlus, HeaderMalformed},
		{"number", trusting, []string{"1"}, sdk.SheddablePlus, HeaderMalformed},
		{"Go's name for an invalid level", trusting, []string{"Criticality(5)"}, sdk.SheddablePlus, HeaderMalformed},
		{"empty", trusting, []string{""}, sdk.SheddablePlus, HeaderMalformed},
		{"a list in one line", trusting, []string{"Sheddable, CriticalPlus"}, sdk.SheddablePlus, HeaderMalformed},
		{"sent twice", trusting, []string{"Sheddable", "CriticalPlus"}, sdk.SheddablePlus, HeaderMalformed},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, result := tt.opts.Level(tt.values)
			if got != tt.want || result != tt.result {
				t.Errorf("Level(%q) = %v, %v; want %v, %v", tt.values, got, result, tt.want, tt.result)
			}
		})
	}
}

func TestTimeout(t *testing.T) {
	now := time.Unix(1_750_000_000, 0)
	tests := []struct {
		name     string
		values   []string
		deadline time.Duration // from now; 0: the request has none
		want     time.Duration
		result   HeaderResult
	}{
		{"missing", nil, 0, 0, HeaderMissing},
		{"milliseconds", []string{"250"}, 0, 250 * time.Millisecond, HeaderAccepted},
		{"spaces", []string{" 250 "}, 0, 250 * time.Millisecond, HeaderAccepted},
		{"zero: out of time already", []string{"0"}, 0, 0, HeaderAccepted},
		{"sooner than the server's", []string{"250"}, time.Second, 250 * time.Millisecond, HeaderAccepted},
		{"later than the server's", []string{"5000"}, time.Second, 0, HeaderCapped},
		{"the server's exactly", []string{"1000"}, time.Second, 0, HeaderCapped},
		{"huge", []string{"99999999999999999"}, 0, math.MaxInt64, HeaderAccepted},
		{"huge, with the server's", []string{"99999999999999999"}, time.Second, 0, HeaderCapped},
		{"negative", []string{"-5"}, 0, 0, HeaderMalformed},
		{"signed", []string{"+5"}, 0, 0, HeaderMalformed},
		{"fraction", []string{"1.5"}, 0, 0, HeaderMalformed},
		{"unit", []string{"250ms"}, 0, 0, HeaderMalformed},
		{"empty", []string{""}, 0, 0, HeaderMalformed},
		{"beyond 64 bits", []string{"99999999999999999999999"}, 0, 0, HeaderMalformed},
		{"sent twice", []string{"100", "200"}, 0, 0, HeaderMalformed},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, result := Timeout(tt.values, now, now.Add(tt.deadline), tt.deadline != 0)
			if got != tt.want || result != tt.result {
				t.Errorf("Timeout(%q) = %v, %v; want %v, %v", tt.values, got, result, tt.want, tt.result)
			}
		})
	}
}

// The sender's formatting and the receiver's parsing agree, and a time
// left is never rounded up: the receiver must not think it has longer than
// the caller will wait.
func TestTimeoutRoundTrip(t *testing.T) {
	tests := []struct {
		left time.Duration
		sent string
	}{
		{-time.Second, "0"},
		{0, "0"},
		{999 * time.Microsecond, "0"},
		{time.Millisecond, "1"},
		{1999 * time.Microsecond, "1"},
		{30 * time.Second, "30000"},
	}
	for _, tt := range tests {
		sent := sdk.FormatTimeout(tt.left)
		got, ok := sdk.ParseTimeout(sent)
		if sent != tt.sent || !ok || got > max(tt.left, 0) {
			t.Errorf("FormatTimeout(%v) = %q, parsed as %v, %v; want %q, at most %v", tt.left, sent, got, ok, tt.sent, tt.left)
		}
	}
	for _, c := range []sdk.Criticality{sdk.Sheddable, sdk.SheddablePlus, sdk.Critical, sdk.CriticalPlus} {
		if got, ok := sdk.ParseCriticality(c.String()); got != c || !ok {
			t.Errorf("ParseCriticality(%q) = %v, %v", c.String(), got, ok)
		}
	}
}

// The names are the label values of the metrics (docs/metrics.md): they
// must not change.
func TestNames(t *testing.T) {
	tests := []struct {
		v    fmt.Stringer
		want string
	}{
		{Admitted, "admitted"},
		{Refused, "refused"},
		{Cancelled, "cancelled"},
		{Failed, "failed"},
		{Outcome(outcomeLen), "Outcome(4)"},
		{HeaderCriticality, "criticality"},
		{HeaderTimeout, "timeout"},
		{Header(headerLen), "Header(2)"},
		{HeaderMissing, "missing"},
		{HeaderAccepted, "accepted"},
		{HeaderCapped, "capped"},
		{HeaderMalformed, "malformed"},
		{HeaderResult(headerResultLen), "HeaderResult(4)"},
	}
	for _, tt := range tests {
		if got := tt.v.String(); got != tt.want {
			t.Errorf("String() = %q, want %q", got, tt.want)
		}
	}
	if !Failed.Valid() || Outcome(outcomeLen).Valid() || !HeaderTimeout.Valid() || Header(headerLen).Valid() || !HeaderMalformed.Valid() || HeaderResult(headerResultLen).Valid() {
		t.Error("Valid disagrees with the sentinels")
	}
}
