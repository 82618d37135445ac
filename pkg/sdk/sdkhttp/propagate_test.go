package sdkhttp

import (
	"context"
	"maps"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/egressd/egressd/pkg/sdk"
)

// edgeSeen records the edge headers of every request a server gets.
type edgeSeen struct {
	mu                    sync.Mutex
	criticality, timeouts [][]string
}

func (e *edgeSeen) handler(next http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		e.mu.Lock()
		e.criticality = append(e.criticality, r.Header.Values(sdk.CriticalityHeader))
		e.timeouts = append(e.timeouts, r.Header.Values(sdk.TimeoutHeader))
		e.mu.Unlock()
		next(w, r)
	}
}

// The stack sends the caller's criticality when it labelled the work, and
// the attempt's time left when it is bounded; nothing else, and nothing
// without Propagate.
func TestPropagate(t *testing.T) {
	labelled := func(c sdk.Criticality) func(context.Context) context.Context {
		return func(ctx context.Context) context.Context { return sdk.WithCriticality(ctx, c) }
	}
	unlabelled := func(ctx context.Context) context.Context { return ctx }
	withRetry := func(timeout time.Duration) func() *Stack {
		return func() *Stack {
			p := testPolicy(1)
			p.AttemptTimeout = timeout
			return NewStack(nil).Retry(p).Propagate()
		}
	}
	tests := []struct {
		name     string
		stack    func() *Stack
		ctx      func(context.Context) context.Context
		deadline time.Duration // the caller's; 0: none
		headers  []string      // set on the request by the caller
		wantCrit []string
		timeout  timeoutCheck
	}{
		{"sheddable, bounded", func() *Stack { return NewStack(nil).Propagate() }, labelled(sdk.Sheddable), time.Minute, nil,
			[]string{"Sheddable"}, within(time.Minute)},
		{"critical, unbounded", func() *Stack { return NewStack(nil).Propagate() }, labelled(sdk.Critical), 0, nil,
			[]string{"Critical"}, none},
		{"unlabelled: the server's default stands", func() *Stack { return NewStack(nil).Propagate() }, unlabelled, time.Minute, nil,
			nil, within(time.Minute)},
		{"not one of the four", func() *Stack { return NewStack(nil).Propagate() }, labelled(7), 0, nil,
			nil, none},
		{"the caller's own headers win", func() *Stack { return NewStack(nil).Propagate() }, labelled(sdk.Sheddable), time.Minute,
			[]string{sdk.CriticalityHeader, "SheddablePlus", sdk.TimeoutHeader, "123"}, []string{"SheddablePlus"}, exactly("123")},
		{"the attempt's deadline, not the caller's", withRetry(2 * time.Second), labelled(sdk.CriticalPlus), time.Hour, nil,
			[]string{"CriticalPlus"}, within(2 * time.Second)},
		{"anywhere in the chain", func() *Stack { return NewStack(nil).Propagate().Retry(testPolicy(1)) }, labelled(sdk.Sheddable), time.Minute, nil,
			[]string{"Sheddable"}, within(time.Minute)},
		{"off unless asked for", func() *Stack { return NewStack(nil).Retry(testPolicy(1)) }, labelled(sdk.Sheddable), time.Minute, nil,
			nil, none},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				var seen edgeSeen
				srv := serve(t, seen.handler(okReply))
				c := build(t, tt.stack())
				ctx := tt.ctx(context.Background())
				cancel := context.CancelFunc(func() {})
				if tt.deadline > 0 {
					ctx, cancel = context.WithTimeout(ctx, tt.deadline)
				}
				defer cancel()
				req := mustRequest(t, ctx, http.MethodGet, srv.URL, nil)
				for i := 0; i+1 < len(tt.headers); i += 2 {
					req.Header.Set(tt.headers[i], tt.headers[i+1])
				}
				before := req.Header.Clone()
				if code, _, _, err := do(t, c, req); err != nil || code != 200 {
					t.Fatalf("GET = %d, %v", code, err)
				}
				if got := seen.criticality[0]; !slices.Equal(got, tt.wantCrit) {
					t.Errorf("criticality sent %q; want %q", got, tt.wantCrit)
				}
				if got := seen.timeouts[0]; !tt.timeout.ok(got) {
					t.Errorf("timeout sent %q; want %s", got, tt.timeout.want)
				}
				if !maps.EqualFunc(req.Header, before, slices.Equal) {
					t.Errorf("the caller's request headers went from %v to %v", before, req.Header)
				}
			})
		})
	}
}

// timeoutCheck says what timeout header a request should have carried.
type timeoutCheck struct {
	want string
	ok   func(values []string) bool
}

var none = timeoutCheck{"none", func(v []string) bool { return len(v) == 0 }}

func exactly(s string) timeoutCheck {
	return timeoutCheck{strconv.Quote(s), func(v []string) bool { return slices.Equal(v, []string{s}) }}
}

// within is a timeout of more than zero and at most d.
func within(d time.Duration) timeoutCheck {
	return timeoutCheck{"one in (0, " + d.String() + "]", func(v []string) bool {
		if len(v) != 1 {
			return false
		}
		got, ok := sdk.ParseTimeout(v[0])
		return ok && got > 0 && got <= d
	}}
}

// Every attempt carries the headers, each measured when it leaves, and the
// caller's request is not changed.
func TestPropagateEveryAttempt(t *testing.T) { synctest.Test(t, testPropagateEveryAttempt) }

func testPropagateEveryAttempt(t *testing.T) {
	var seen edgeSeen
	srv := serve(t, seen.handler(reply(503, "busy")), seen.handler(okReply))
	c := build(t, NewStack(nil).Retry(testPolicy(2)).Propagate())
	ctx, cancel := context.WithTimeout(sdk.WithCriticality(context.Background(), sdk.SheddablePlus), time.Minute)
	defer cancel()
	req := mustRequest(t, ctx, http.MethodGet, srv.URL, nil)
	if code, _, res, err := do(t, c, req); err != nil || code != 200 || len(res.Attempts) != 2 {
		t.Fatalf("GET = %d after %d attempts, %v", code, len(res.Attempts), err)
	}
	for i := range 2 {
		if !slices.Equal(seen.criticality[i], []string{"SheddablePlus"}) || !within(time.Minute).ok(seen.timeouts[i]) {
			t.Errorf("attempt %d sent %q, %q", i+1, seen.criticality[i], seen.timeouts[i])
		}
	}
	if len(req.Header) != 0 {
		t.Errorf("the caller's request has headers %v after the call; want none", req.Header)
	}
}
