package serve

import (
	"errors"
	"fmt"
	"net/http"

	"github.com/egressd/egressd/pkg/edge"
	"github.com/egressd/egressd/pkg/limit"
	"github.com/egressd/egressd/pkg/partition"
)

// DefaultKeyPrefix, followed by the policy's name, is the Redis key prefix
// of a policy whose Limiter.Shared.Key is empty: a policy "per-client"
// keeps client c's budget at shared.KeyFor("egressd/serve/per-client", c).
const DefaultKeyPrefix = "egressd/serve/"

// Options problems are reported as in package limit: the same sentinel and
// typed error.
var (
	// ErrInvalidOptions is what every [OptionsError] matches with
	// [errors.Is]; it is limit.ErrInvalidOptions.
	ErrInvalidOptions = limit.ErrInvalidOptions
)

// OptionsError lists every problem [Options.Validate] found.
type OptionsError = limit.OptionsError

// AsOptionsError returns the *OptionsError in err's chain, if any.
func AsOptionsError(err error) (*OptionsError, bool) { return limit.AsOptionsError(err) }

// Policy is a named limit on requests: a limiter per partition of them.
type Policy struct {
	// Name is how Handler finds the policy, and the policy label of its
	// metrics. Required; unique among a middleware's policies.
	Name string
	// Partition returns the key of a request's partition: its client's
	// address (ByClientIP), its tenant (ByHeader), its authenticated
	// identity (a func reading what your authentication middleware, run
	// before this one, put in the request's context). Nil puts every
	// request in one partition; so does a func that returns "" for all.
	// Keys are kept in memory, and for shared limiters in Redis, in
	// clear: hash sensitive identifiers.
	Partition func(r *http.Request) string
	// Limiter is what each partition gets, as in package partition: set
	// exactly one of Local, Shared (with Redis) or New. Empty names are the
	// policy's: Limiter.Name, Local.Name and Shared.Name, so that every
	// refusal names the policy; an empty Shared.Key is DefaultKeyPrefix +
	// Name.
	Limiter partition.Options
}

// CriticalityOptions say how far the criticality a caller sends is
// trusted. The zero value takes Critical for requests without a usable
// header and lets no caller claim more than Critical.
type CriticalityOptions struct {
	// Default is the criticality of a request whose header is missing or
	// malformed.
	Default edge.Criticality
	// Ceiling is the most a header may claim: a higher level is lowered to
	// it. Raise it to CriticalPlus for callers you trust (a server only
	// peers reach); lower it to Default for callers you do not, who may
	// then lower their own criticality but never raise it.
	Ceiling edge.Criticality
}

// Options configure a [Middleware].
type Options struct {
	// Policies are the named policies Handler applies. None is valid: a
	// middleware then only reads edge headers (see Middleware.Edge).
	Policies []Policy
	// Criticality says how far the criticality header is trusted.
	Criticality CriticalityOptions
	// Reject, if set, answers a request a policy did not admit, in place
	// of DefaultReject; it may call DefaultReject itself.
	Reject func(w http.ResponseWriter, r *http.Request, rej *Rejection)
	// Observer, if set, is told about every request (see [Observer]).
	Observer Observer
}

// Validate reports every problem with o at once, as an [*OptionsError]:
// policies without a name or with one already taken, every problem of each
// policy's Limiter (after the defaults above are applied), prefixed with
// the policy, and criticalities that are none of the four or out of order.
func (o *Options) Validate() error {
	if o == nil {
		return nil // the zero Options are valid
	}
	var problems []string
	add := func(format string, args ...any) { problems = append(problems, fmt.Sprintf(format, args...)) }

	seen := make(map[string]bool, len(o.Policies))
	for i, p := range o.Policies {
		label := fmt.Sprintf("policy %q", p.Name)
		switch {
		case p.Name == "":
			label = fmt.Sprintf("policy %d", i)
			add("%s has no Name", label)
		case seen[p.Name]:
			add("%s is defined more than once", label)
		}
		seen[p.Name] = true
		lo := p.LimiterOptions()
		if err := lo.Validate(); err != nil {
			for _, problem := range nested(err) {
				add("%s: Limiter.%s", label, problem)
			}
		}
	}
	c := o.Criticality
	defOK, ceilOK := named(c.Default), named(c.Ceiling)
	if !defOK {
		add("Criticality.Default %v is none of Sheddable, SheddablePlus, Critical or CriticalPlus", c.Default)
	}
	if !ceilOK {
		add("Criticality.Ceiling %v is none of Sheddable, SheddablePlus, Critical or CriticalPlus", c.Ceiling)
	}
	if defOK && ceilOK && c.Default > c.Ceiling {
		add("Criticality.Default %v is above Criticality.Ceiling %v: no header could claim what a request without one gets", c.Default, c.Ceiling)
	}
	if len(problems) == 0 {
		return nil
	}
	return &OptionsError{Problems: problems}
}

// LimiterOptions returns p.Limiter with the policy's defaults applied, on
// copies: the caller's options are not changed. Package servegrpc's policies
// take the same defaults.
func (p *Policy) LimiterOptions() partition.Options {
	o := p.Limiter
	if o.Name == "" {
		o.Name = p.Name
	}
	if o.Local != nil && o.Local.Name == "" {
		lo := *o.Local
		lo.Name = p.Name
		o.Local = &lo
	}
	if o.Shared != nil && (o.Shared.Key == "" || o.Shared.Name == "") {
		so := *o.Shared
		if so.Key == "" && p.Name != "" {
			so.Key = DefaultKeyPrefix + p.Name
		}
		if so.Name == "" {
			so.Name = p.Name
		}
		o.Shared = &so
	}
	return o
}

// nested returns the problems of a nested Validate's error.
func nested(err error) []string {
	if oe, ok := errors.AsType[*OptionsError](err); ok {
		return oe.Problems
	}
	return []string{err.Error()}
}

// named reports whether c is one of the four criticalities.
func named(c edge.Criticality) bool {
	_, ok := edge.ParseCriticality(c.String())
	return ok
}
