package sdkhttp

import (
	"errors"
	"fmt"
	"net/http"
	"strings"

	"github.com/egressd/egressd/pkg/limit"
	"github.com/egressd/egressd/pkg/sdk"
)

// ErrInvalidStack is what every *StackError matches with errors.Is.
var ErrInvalidStack = errors.New("invalid http stack")

// StackError lists every problem Build found with a Stack.
type StackError struct {
	Problems []string
}

func (e *StackError) Error() string {
	return ErrInvalidStack.Error() + ": " + strings.Join(e.Problems, "; ")
}

// Is reports whether target is ErrInvalidStack.
func (e *StackError) Is(target error) bool { return target == ErrInvalidStack }

// AsStackError returns the *StackError in err's chain, if any.
func AsStackError(err error) (*StackError, bool) {
	return errors.AsType[*StackError](err)
}

type stepKind uint8

const (
	retryStep stepKind = iota
	limitStep
	quotaStep
)

type step struct {
	kind    stepKind
	policy  *sdk.Policy
	limiter limit.Limiter
	quota   QuotaOptions
}

// Stack describes a Transport, outermost step first. Add steps with Retry,
// Quota and Limit (and, anywhere, Propagate), then Build. Nothing is
// checked until Build, which lists every problem at once. A Stack may be
// built more than once; each Transport it builds keeps quota state of its
// own.
type Stack struct {
	base      http.RoundTripper
	steps     []step
	propagate bool // see Propagate
}

// NewStack returns an empty stack over base, the transport that makes the
// actual exchanges; nil means http.DefaultTransport.
func NewStack(base http.RoundTripper) *Stack { return &Stack{base: base} }

// Retry adds the retry loop: each request runs through sdk.Run (or, when p
// has a Hedge and the request is idempotent, sdk.RunHedged) with a copy of
// p taken at Build, its classifier extended by Classifier. It must be the
// first step, and there may be only one.
func (s *Stack) Retry(p *sdk.Policy) *Stack {
	s.steps = append(s.steps, step{kind: retryStep, policy: p})
	return s
}

// Limit adds a limiter that takes one permit per attempt. Add it after
// Retry, so that it is inside the retry loop.
func (s *Stack) Limit(l limit.Limiter) *Stack {
	s.steps = append(s.steps, step{kind: limitStep, limiter: l})
	return s
}

// Quota adds the published-quota guard. Add it after Retry, and before any
// Limit, so that an attempt it refuses spends no permit.
func (s *Stack) Quota(opts QuotaOptions) *Stack {
	s.steps = append(s.steps, step{kind: quotaStep, quota: opts})
	return s
}

// Build checks the stack and returns its Transport, or a *StackError
// listing every problem.
func (s *Stack) Build() (*Transport, error) {
	if problems := s.check(); len(problems) > 0 {
		return nil, &StackError{Problems: problems}
	}
	base := s.base
	if base == nil {
		base = http.DefaultTransport
	}
	rt := base
	if s.propagate {
		rt = &propagateLayer{next: rt}
	}
	for i := len(s.steps) - 1; i >= 0; i-- {
		st := s.steps[i]
		switch st.kind {
		case retryStep:
			rt = newRetryLayer(*st.policy, rt)
		case limitStep:
			rt = &limitLayer{limiter: st.limiter, next: rt}
		case quotaStep:
			rt = newQuotaLayer(st.quota, rt)
		}
	}
	return &Transport{rt: rt, base: base}, nil
}

func (s *Stack) check() []string {
	var problems []string
	add := func(format string, args ...any) { problems = append(problems, fmt.Sprintf(format, args...)) }
	retries, quotas := 0, 0
	for i, st := range s.steps {
		switch st.kind {
		case retryStep:
			retries++
			if st.policy == nil {
				add("Retry(nil): pass the dependency's policy, e.g. sdkhttp.Defaults()")
			}
			if retries == 2 {
				add("Retry is added more than once: one retry loop per stack, or the attempts multiply")
			}
			for _, outer := range s.steps[:i] {
				switch outer.kind {
				case limitStep:
					add("Limit(%s) is outside Retry: steps run outermost first, so it would take one permit for a request that makes several attempts; add Retry first", limiterName(outer.limiter))
				case quotaStep:
					add("Quota is outside Retry: steps run outermost first, so it would check the published allowance once for a request that makes several attempts; add Retry first")
				}
			}
		case limitStep:
			if st.limiter == nil {
				add("Limit(nil): pass a limiter, e.g. limit.PerSecond(100)")
			}
		case quotaStep:
			quotas++
			if quotas == 2 {
				add("Quota is added more than once: one guard keeps one host's allowance")
			}
			problems = append(problems, st.quota.problems()...)
		}
	}
	return problems
}

func limiterName(l limit.Limiter) string {
	if l == nil {
		return "nil"
	}
	return fmt.Sprintf("%q", l.Name())
}

// Transport is a built Stack. It is safe for concurrent use.
type Transport struct {
	rt   http.RoundTripper
	base http.RoundTripper
}

var _ http.RoundTripper = (*Transport)(nil)

// RoundTrip sends req through the stack. See the package documentation for
// what it returns.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	return t.rt.RoundTrip(req)
}

// CloseIdleConnections closes the base transport's idle connections, if it
// has that method; http.Client.CloseIdleConnections calls it.
func (t *Transport) CloseIdleConnections() {
	if c, ok := t.base.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

// closeRequestBody closes the body of a request a layer will not send, as
// the RoundTripper contract asks.
func closeRequestBody(req *http.Request) {
	if req.Body != nil {
		req.Body.Close()
	}
}
