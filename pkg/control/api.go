package control

import (
	"context"
	"encoding/json"
	"net/http"
	"net/netip"
	"net/url"
	"strconv"
	"time"
)

// The egressd API: the wire types the daemon serves under Prefix and the
// client methods the CLI and the SDK call. Rules travel as policy YAML, so
// the daemon checks a rule from the CLI exactly as it checks the file.

// Route names.
const (
	RouteStatus       = "status"
	RouteLimits       = "limits"
	RouteLimit        = "limit"
	RouteLimitSet     = "limit/set"
	RouteLimitRemove  = "limit/remove"
	RoutePolicyReload = "policy/reload"
	RouteEvents       = "events"
	RouteRefusal      = "refusal"
	RouteUninstall    = "uninstall"
)

// Status is the daemon's state.
type Status struct {
	Version string    `json:"version"`
	Started time.Time `json:"started"`
	// Adopted says the daemon carried on a datapath a previous run pinned.
	Adopted    bool   `json:"adopted"`
	Cgroup     string `json:"cgroup"`
	PinDir     string `json:"pinDir"`
	PolicyFile string `json:"policyFile"`
	Rules      int    `json:"rules"`
	// Pending counts rules not in the kernel yet (unit not running, host
	// name not resolved).
	Pending int `json:"pending"`
	// Shared counts rules with a shared budget; Unreachable names those
	// whose Redis cannot be reached now (their failure mode is in force),
	// Frozen those whose budget's growth is frozen (Redis had no record of
	// it).
	Shared       int      `json:"shared"`
	Unreachable  []string `json:"unreachable,omitempty"`
	Frozen       []string `json:"frozen,omitempty"`
	LostRefusals uint64   `json:"lostRefusals"`
	LostSamples  uint64   `json:"lostSamples"`
	LastReload   Reload   `json:"lastReload"`
	// Kube is the Kubernetes source's state; nil when the daemon does not
	// watch an API server.
	Kube *Kube `json:"kubernetes,omitempty"`
}

// Kube is how the daemon follows the API server: whether it reaches it
// (while it does not, the rules last known stay in force), and what the
// EgressLimits make on its node.
type Kube struct {
	Node      string    `json:"node"`
	Connected bool      `json:"connected"`
	Since     time.Time `json:"since"`
	Error     string    `json:"error,omitempty"`
	// Limits counts the EgressLimits that select pods of the node, Refused
	// those of them not applied (a problem with the object, or a clash
	// with another rule).
	Limits  int `json:"limits"`
	Refused int `json:"refused"`
	// Pods counts the pods bound to the node, Rules the rules the limits
	// make for them (one per limit and pod).
	Pods  int `json:"pods"`
	Rules int `json:"rules"`
}

// Reload is the outcome of the last policy load.
type Reload struct {
	Time  time.Time `json:"time"`
	OK    bool      `json:"ok"`
	Error string    `json:"error,omitempty"`
}

// Limit is one rule and its counts.
type Limit struct {
	Name string `json:"name"`
	// Source is "policy" for a rule of the policy file, "cli" for one set
	// at run time (which wins over the file's rule of the same name),
	// "k8s:NAMESPACE/NAME" for one an EgressLimit makes for a pod.
	Source string `json:"source"`
	// Rule is the rule as policy YAML.
	Rule string `json:"rule"`
	// Shape is concurrency, per_second, per_window or adaptive.
	Shape string `json:"shape"`
	// Limit is the limit in force: for an adaptive rule, where its loop
	// is; for a shared concurrency rule, this host's share; for a shared
	// rate, the whole budget's (Shared says what this host holds).
	Limit  uint32 `json:"limit"`
	Shadow bool   `json:"shadow"`
	// Destinations are the prefixes in the kernel: a host name's
	// addresses as last resolved.
	Destinations []string `json:"destinations"`
	// Protocols are what the rule counts: tcp, udp or both.
	Protocols []string `json:"protocols"`
	// Pending says why the rule is not in the kernel, when it is not.
	Pending       string `json:"pending,omitempty"`
	Live          int64  `json:"live"`
	InFlight      int64  `json:"inFlight"`
	Admitted      uint64 `json:"admitted"`
	Refused       uint64 `json:"refused"`
	ShadowRefused uint64 `json:"shadowRefused"`
	// BaselineSeconds is an adaptive rule's idea of a fast call; 0 before
	// it has one. BaselineSource says where it comes from: "probes" (drain
	// probes), "window" (the 10th percentile of the last five minutes, with
	// probeEvery 0 and before the first probe) or "fixed".
	BaselineSeconds float64 `json:"baselineSeconds,omitempty"`
	BaselineSource  string  `json:"baselineSource,omitempty"`
	// Probing says an adaptive rule is in a drain probe: Limit is lowered
	// for it, and SettledLimit is where it goes back to. LastProbe is when
	// the last probe ended, NextProbe when the next is due, Probes how many
	// have ended.
	Probing      bool      `json:"probing,omitempty"`
	SettledLimit uint32    `json:"settledLimit,omitempty"`
	LastProbe    time.Time `json:"lastProbe,omitzero"`
	NextProbe    time.Time `json:"nextProbe,omitzero"`
	Probes       uint64    `json:"probes,omitempty"`
	// NoProbes says the loop never probes (probeEvery 0, or a fixed
	// baseline); without it, no probe yet means none has been due.
	NoProbes bool `json:"noProbes,omitempty"`
	// Shared is this host's part of a shared budget, for a shared rule.
	Shared *Share `json:"shared,omitempty"`
}

// Share is one host's part of a budget kept in Redis.
type Share struct {
	Key         string `json:"key"`
	FailureMode string `json:"failureMode"`
	// Durability is ephemeral or persistent: whether Redis may lose the
	// budget's state.
	Durability string `json:"durability"`
	// Replicas is how many Redis replicas confirm a grant before the
	// kernel uses it.
	Replicas int `json:"replicas,omitempty"`
	// Reachable is false while Redis cannot be reached; FailureMode is
	// then in force, since Since, and Error says why. Waiting says no call
	// to Redis has come back yet (a rule just set, or a daemon just
	// started): Reachable is false then too, and no failure mode is in
	// force.
	Reachable bool      `json:"reachable"`
	Waiting   bool      `json:"waiting,omitempty"`
	Error     string    `json:"error,omitempty"`
	Since     time.Time `json:"since,omitzero"`
	// Slots are the concurrency slots this host holds in Redis, FairShare
	// its fair share of the budget among the hosts that want slots.
	Slots     int `json:"slots"`
	FairShare int `json:"fairShare,omitempty"`
	// LeaseSeconds is how long the slots outlive this daemon's last
	// renewal. Expired says Redis has been unreachable so long that they
	// may have: the kernel admits nothing new on them.
	LeaseSeconds float64 `json:"leaseSeconds,omitempty"`
	Expired      bool    `json:"expired,omitempty"`
	// FrozenUntil is when the budget's growth thaws after Redis lost its
	// state (or first saw it, when ephemeral); zero when it is not frozen.
	FrozenUntil time.Time `json:"frozenUntil,omitzero"`
	// Epoch names the budget's state in Redis; it changes when Redis
	// loses it.
	Epoch int64 `json:"epoch,omitempty"`
	// Granted is the permits of a shared rate this host claimed and the
	// kernel may spend, Spent those its connections used, Returned those
	// handed back unspent. Unconfirmed is, for a rate, the permits claimed
	// but never used because replicas did not confirm them; for
	// concurrency, the times the share's growth was left unused for that.
	Granted     uint64 `json:"granted"`
	Spent       uint64 `json:"spent"`
	Returned    uint64 `json:"returned"`
	Unconfirmed uint64 `json:"unconfirmed,omitempty"`
}

// SetLimitRequest carries one rule as policy YAML: "name: x\ndestination: …".
type SetLimitRequest struct {
	Rule string `json:"rule"`
}

// NameRequest names a rule.
type NameRequest struct {
	Name string `json:"name"`
}

// Event kinds.
const (
	// EventRefusal is a refused (or, in shadow mode, would-be refused)
	// connect().
	EventRefusal = "refusal"
	// EventRecount is the slots of a rule a recount gave back: held by
	// sockets freed without giving them back, or counted by the kernel
	// and held by no socket at two recounts in a row.
	EventRecount = "recount"
)

// Event is one event `egressd events` lists: a refusal, or slots a
// recount gave back. A recount's has Time, Rule, Shape, Count (the slots
// given back), Freed and GivenBack.
type Event struct {
	Kind   string    `json:"kind"`
	Time   time.Time `json:"time"`
	PID    uint32    `json:"pid,omitempty"`
	Cgroup uint64    `json:"cgroup,omitempty"`
	Rule   string    `json:"rule"`
	Dest   string    `json:"dest,omitempty"`
	// Shape is the rule's, as Limit's: adaptive for an adaptive rule (the
	// kernel's concurrency), per_second for a shared rate; the kernel's
	// for a rule removed since.
	Shape  string `json:"shape"`
	Shadow bool   `json:"shadow,omitempty"`
	// Protocol is what a refusal refused: tcp (a connect()) or udp (a
	// UDP flow's connect() or first datagram to its destination).
	Protocol string `json:"protocol,omitempty"`
	// RetryAfterSeconds is when a permit is expected back; 0 when the
	// shape gives no hint (concurrency).
	RetryAfterSeconds float64 `json:"retryAfterSeconds,omitempty"`
	// Count is how many refusals of this process by this rule the event
	// stands for: those since its previous event, at most one a second;
	// Dest and the rest are the latest's. A recount's: the slots it gave
	// back.
	Count uint64 `json:"count"`
	// Freed and GivenBack are a recount's slots given back, of sockets
	// freed holding them and counted by no socket.
	Freed     int64 `json:"freed,omitempty"`
	GivenBack int64 `json:"givenBack,omitempty"`
}

// Attribution answers "did egressd refuse this process's connect() to this
// destination just now?".
type Attribution struct {
	Refused           bool    `json:"refused"`
	Rule              string  `json:"rule,omitempty"`
	RetryAfterSeconds float64 `json:"retryAfterSeconds,omitempty"`
	// SecondsAgo is how long before the answer the latest refusal was:
	// an EPERM of a connect() begun after it is not the daemon's.
	SecondsAgo float64 `json:"secondsAgo,omitempty"`
}

// Status reads the daemon's state.
func (c *Client) Status(ctx context.Context) (Status, error) {
	var s Status
	return s, c.Get(ctx, RouteStatus, &s)
}

// LimitsQuery picks and orders the rules Limits lists. Its zero value
// lists every rule, in the kernel or pending, by name.
type LimitsQuery struct {
	// State keeps the rules in one state: StateInstalled (in the kernel),
	// StatePending, StateShadow or StateShared.
	State string
	// Shape keeps the rules of one shape, as Limit.Shape names it
	// (concurrency, adaptive, per_second, per_window; the policy's
	// perSecond and perWindow too).
	Shape string
	// Name keeps the rules whose name matches a pattern (path.Match's: a
	// * matches any run of characters but /).
	Name string
	// Dest keeps the rules with a destination that holds an address or
	// overlaps a prefix (10.0.0.0/8), or that is a host name.
	Dest string
	// Source keeps the rules of the policy file ("policy") or set at run
	// time ("cli").
	Source string
	// Sort orders the rules: SortName (the default) or SortBusy.
	Sort string
	// Max is the most rules listed; 0 lists all.
	Max int
}

// LimitsQuery's values.
const (
	StateInstalled = "installed"
	StatePending   = "pending"
	StateShadow    = "shadow"
	StateShared    = "shared"
	SortName       = "name"
	// SortBusy puts first the rules with the most refusals a second over
	// about the last minute, then the most live connections.
	SortBusy = "busy"
)

// Values encodes q as a route's query; ParseLimitsQuery reads it back.
func (q LimitsQuery) Values() url.Values {
	v := url.Values{}
	for _, f := range []struct{ key, value string }{
		{"state", q.State}, {"shape", q.Shape}, {"name", q.Name}, {"dest", q.Dest}, {"source", q.Source}, {"sort", q.Sort},
	} {
		if f.value != "" {
			v.Set(f.key, f.value)
		}
	}
	if q.Max != 0 {
		v.Set("max", strconv.Itoa(q.Max))
	}
	return v
}

// ParseLimitsQuery reads a query Values made; the daemon judges its
// values.
func ParseLimitsQuery(v url.Values) (LimitsQuery, error) {
	q := LimitsQuery{State: v.Get("state"), Shape: v.Get("shape"), Name: v.Get("name"), Dest: v.Get("dest"),
		Source: v.Get("source"), Sort: v.Get("sort")}
	if s := v.Get("max"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 0 {
			return q, Errorf(CodeInvalid, "max %q is not a whole number of rules", s)
		}
		q.Max = n
	}
	return q, nil
}

// Limits calls fn with each rule q picks, in its order, as the daemon
// reads them: the first comes before the daemon has read the last.
func (c *Client) Limits(ctx context.Context, q LimitsQuery, fn func(Limit) error) error {
	route := RouteLimits
	if v := q.Values(); len(v) > 0 {
		route += "?" + v.Encode()
	}
	return c.Stream(ctx, route, func(raw json.RawMessage) error {
		var l Limit
		if err := json.Unmarshal(raw, &l); err != nil {
			return err
		}
		return fn(l)
	})
}

// Limit reads one rule.
func (c *Client) Limit(ctx context.Context, name string) (Limit, error) {
	var l Limit
	return l, c.Get(ctx, RouteLimit+"?name="+url.QueryEscape(name), &l)
}

// SetLimit creates or replaces a rule given as policy YAML. It persists
// across daemon restarts and wins over the policy file's rule of the same
// name.
func (c *Client) SetLimit(ctx context.Context, rule string) (Limit, error) {
	var l Limit
	return l, c.Post(ctx, RouteLimitSet, SetLimitRequest{Rule: rule}, &l)
}

// RemoveLimit removes a rule, whether set at run time or in the policy
// file; it stays removed across reloads until set again.
func (c *Client) RemoveLimit(ctx context.Context, name string) error {
	return c.Post(ctx, RouteLimitRemove, NameRequest{Name: name}, nil)
}

// ReloadPolicy reads the policy file again; on a problem nothing changes.
func (c *Client) ReloadPolicy(ctx context.Context) (Reload, error) {
	var r Reload
	return r, c.Post(ctx, RoutePolicyReload, struct{}{}, &r)
}

// Events calls fn with recent events and, with follow, new ones as they
// happen until ctx ends or fn returns an error.
func (c *Client) Events(ctx context.Context, follow bool, fn func(Event) error) error {
	return c.Stream(ctx, RouteEvents+"?follow="+strconv.FormatBool(follow), func(raw json.RawMessage) error {
		var r Event
		if err := json.Unmarshal(raw, &r); err != nil {
			return err
		}
		return fn(r)
	})
}

// Attribute asks whether the daemon refused pid's connect() to dest, or
// for proto "udp" its UDP flow to dest, within the last moments (proto ""
// is "tcp"). A pid of 0 is the calling process, by the pid the
// daemon's kernel gives it, which is the one to ask from inside a
// container's pid namespace. A caller without write access may ask only
// about its own process.
func (c *Client) Attribute(ctx context.Context, pid int, proto string, dest netip.AddrPort) (Attribution, error) {
	var a Attribution
	q := url.Values{"pid": {strconv.Itoa(pid)}, "dest": {dest.String()}}
	if proto != "" {
		q.Set("proto", proto)
	}
	return a, c.Get(ctx, RouteRefusal+"?"+q.Encode(), &a)
}

// Uninstall makes the daemon detach everything, remove its pins and exit.
func (c *Client) Uninstall(ctx context.Context) error {
	return c.Do(ctx, http.MethodPost, RouteUninstall, struct{}{}, nil)
}
