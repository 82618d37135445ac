package policy

import (
	"errors"
	"fmt"
	"math"
	"net/netip"
	"path"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/egressd/egressd/pkg/adaptive"
	"github.com/egressd/egressd/pkg/kernelrule"
	"github.com/egressd/egressd/pkg/shared/redisurl"
	"go.yaml.in/yaml/v3"
)

// Validate reports every problem with p at once, as an [*Error] whose
// problems have no line numbers. It is for policies built in code — a rule
// from the CLI merged into the running set — and applies the same checks as
// [Parse], but for names beginning [KubePrefix], which the daemon gives
// the rules it makes.
func (p *Policy) Validate() error {
	problems := append(check(p.Rules, nil), checkCapacity(len(p.Rules), p.MaxRules, nil)...)
	for _, name := range p.MetricsRules {
		if msg := metricsRuleProblem(name); msg != "" {
			problems = append(problems, Problem{Msg: msg})
		}
	}
	if len(problems) > 0 {
		return &Error{Problems: problems}
	}
	return nil
}

// checkCapacity reports a policy whose rules would not fit the kernel's
// tables: more than maxRules, when it is set, or than any datapath holds.
func checkCapacity(rules, maxRules int, at *yaml.Node) []Problem {
	p := Problem{}
	if at != nil {
		p.Line, p.Column = at.Line, at.Column
	}
	switch {
	case maxRules < 0 || maxRules > kernelrule.MaxRules:
		p.Msg = fmt.Sprintf("maxRules %d is outside 1..%d", maxRules, kernelrule.MaxRules)
	case maxRules > 0 && rules > maxRules:
		p.Msg = fmt.Sprintf("%d rules do not fit maxRules %d", rules, maxRules)
	case rules > kernelrule.MaxRules:
		p.Msg = fmt.Sprintf("%d rules do not fit: a datapath holds at most %d", rules, kernelrule.MaxRules)
	default:
		return nil
	}
	return []Problem{p}
}

// metricsRuleProblem says what is wrong with a name of metrics.rules, or
// is empty.
func metricsRuleProblem(name string) string {
	if name == "" {
		return "metrics.rules has an empty name"
	}
	if _, err := path.Match(name, ""); err != nil {
		return fmt.Sprintf("metrics.rules %q is not a pattern: %v", name, err)
	}
	return ""
}

// where remembers where a parsed rule's fields were written, so that a
// problem found by checking the rule points at the line to fix. The zero
// where, for a rule built in code, knows nothing.
type where struct {
	rule *yaml.Node
	// nodes are value nodes by path: "port", "perSecond.burst". A rule has
	// a dozen at most, and a policy may have a million rules: a slice
	// searched in order costs less than a map.
	nodes []pathNode
	// bad are paths whose value was refused while decoding; checking them
	// again would report one mistake twice. Most rules have none.
	bad map[string]bool
}

type pathNode struct {
	path string
	node *yaml.Node
}

func newWhere(rule *yaml.Node) *where { return &where{rule: rule} }

// refuse marks path as refused while decoding, and with it a mapping
// whose fields are checked together.
func (w *where) refuse(path string) {
	if w.bad == nil {
		w.bad = map[string]bool{}
	}
	w.bad[path] = true
	if m, _, ok := strings.Cut(path, "."); ok && fieldAt[m] != nil && fieldAt[m].together {
		w.bad[m] = true
	}
}

func (w *where) node(path string) *yaml.Node {
	for _, pn := range w.nodes {
		if pn.path == path {
			return pn.node
		}
	}
	return nil
}

// at returns the position of path, or of the nearest enclosing field that
// was written, or of the rule.
func (w *where) at(path string) (line, column int) {
	for {
		if n := w.node(path); n != nil {
			return n.Line, n.Column
		}
		i := strings.LastIndexByte(path, '.')
		if i < 0 {
			break
		}
		path = path[:i]
	}
	if w.rule != nil {
		return w.rule.Line, w.rule.Column
	}
	return 0, 0
}

// label names a rule in problems: by its name, or by its place when it has
// none.
func label(name string, i int) string {
	if name != "" {
		return name
	}
	return fmt.Sprintf("#%d", i+1)
}

// check finds every problem with rules: each rule's own, names used twice,
// and rules that would match the same traffic. wheres, if not nil, locates
// each rule's fields.
func check(rules []Rule, wheres []*where) []Problem {
	var problems []Problem
	nowhere := &where{}
	locate := func(i int) *where {
		if wheres == nil {
			return nowhere
		}
		return wheres[i]
	}
	checkerOf := func(i int) checker {
		return checker{w: locate(i), rule: label(rules[i].Name, i), problems: &problems, written: wheres != nil}
	}
	ruleAt := func(i int) string {
		if w := locate(i); w.rule != nil {
			return fmt.Sprintf("the rule at line %d", w.rule.Line)
		}
		return fmt.Sprintf("rule #%d", i+1)
	}
	// A rule whose match was partly refused would match the wrong traffic
	// here and claim conflicts it does not have.
	refused := func(i int) bool {
		w := locate(i)
		return slices.ContainsFunc([]string{"destination", "port", "unit", "cgroup"}, func(p string) bool { return w.bad[p] })
	}
	// The rules used twice, found first so that each rule's problems come
	// together, in the order of its fields.
	earlierName, earlierMatch := map[int]int{}, map[int]int{}
	sameName(rules, func(i, j int) { earlierName[i] = j })
	sameMatch(rules, refused, func(i, j int) { earlierMatch[i] = j })
	for i := range rules {
		c := checkerOf(i)
		c.check(rules[i])
		if j, ok := earlierName[i]; ok {
			c.add("name", "name %s is already used by %s", rules[i].Name, ruleAt(j))
		}
		if j, ok := earlierMatch[i]; ok {
			c.add("destination", "same scope, destination and port as rule %s; the kernel takes one rule for the same traffic", label(rules[j].Name, j))
		}
	}
	return problems
}

// clean reports whether check would find no problem with rules, whose
// fields were not refused while decoding. It spreads the work over the
// CPUs: for 100,000 rules, on every start and reload, check takes 58–63
// ms on one (half of it in the lookups for names and matches used twice)
// and clean 35–46 ms on two.
func clean(rules []Rule) bool {
	var bad atomic.Bool
	found := func(int, int) { bad.Store(true) }
	var wg sync.WaitGroup
	wg.Go(func() { sameName(rules, found) })
	wg.Go(func() { sameMatch(rules, func(int) bool { return false }, found) })
	parts := runtime.GOMAXPROCS(0)
	for part := range parts {
		wg.Go(func() {
			var problems []Problem
			nowhere := &where{}
			for i := part * len(rules) / parts; i < (part+1)*len(rules)/parts && !bad.Load(); i++ {
				checker{w: nowhere, rule: label(rules[i].Name, i), problems: &problems, written: true}.check(rules[i])
				if len(problems) > 0 {
					bad.Store(true)
				}
			}
		})
	}
	wg.Wait()
	return !bad.Load()
}

// sameName calls dup(i, j) for each rule i whose name an earlier rule j has.
func sameName(rules []Rule, dup func(i, j int)) {
	byName := make(map[string]int, len(rules))
	for i := range rules {
		name := rules[i].Name
		if name == "" {
			continue
		}
		if j, ok := byName[name]; ok {
			dup(i, j)
		} else {
			byName[name] = i
		}
	}
}

// sameMatch calls dup(i, j) for each rule i that matches the traffic an
// earlier rule j matches, leaving out rules without a destination and
// those skip names.
func sameMatch(rules []Rule, skip func(i int) bool, dup func(i, j int)) {
	byKey := make(map[matchKey]int, len(rules))
	// A cgroup path ending in a unit's name, shallow enough for the daemon
	// to find that unit there, is the unit's cgroup whenever both rules
	// are in force (with two cgroups of its name the unit has none), so
	// the two never hold together: byUnit keys such a rule as that unit.
	byUnit := map[matchKey]int{}
	for i := range rules {
		if rules[i].Destination == (Destination{}) || skip(i) {
			continue
		}
		k := rules[i].matchKey()
		if j, ok := byKey[k]; ok {
			dup(i, j)
			continue
		}
		byKey[k] = i
		switch sc := k.scope; {
		case sc.Unit != "":
			if j, ok := byUnit[k]; ok {
				dup(i, j)
			}
		case sc.Cgroup != "" && strings.Count(sc.Cgroup, "/") <= UnitDepth:
			k.scope = Scope{Unit: path.Base(sc.Cgroup)}
			if j, ok := byKey[k]; ok {
				dup(i, j)
			} else if _, ok := byUnit[k]; !ok {
				byUnit[k] = i
			}
		}
	}
}

// UnitDepth is how many levels below the cgroup2 root the daemon looks
// for a unit's cgroup.
const UnitDepth = 6

// matchKey is the traffic a rule matches. Two rules may not share one: the
// kernel looks a connection up by it and finds one rule.
type matchKey struct {
	scope  Scope
	prefix netip.Prefix
	host   string
	port   uint16
}

// matchKey writes IPv4 prefixes v4-mapped, as the kernel stores them, and
// host names in the form resolvers treat alike.
func (r Rule) matchKey() matchKey {
	k := matchKey{scope: r.Scope, port: r.Port}
	if p, ok := r.Destination.Prefix(); ok {
		if p.Addr().Is4() {
			p = netip.PrefixFrom(netip.AddrFrom16(p.Addr().As16()), p.Bits()+96)
		}
		k.prefix = p
	} else {
		k.host = strings.ToLower(strings.TrimSuffix(r.Destination.host, "."))
	}
	return k
}

// checker collects the problems of one rule.
type checker struct {
	w        *where
	rule     string
	problems *[]Problem
	// written is a rule a person wrote, in a file or as flags, whose name
	// may not take the prefix of the rules the daemon makes for
	// Kubernetes.
	written bool
}

// add records a problem with the field at path, unless decoding already
// refused that field.
func (c checker) add(path, format string, args ...any) {
	if c.w.bad[path] {
		return
	}
	line, column := c.w.at(path)
	*c.problems = append(*c.problems, Problem{Line: line, Column: column, Rule: c.rule, Msg: fmt.Sprintf(format, args...)})
}

// count checks a limit that must be positive and at most most.
func (c checker) count(path string, v, most int) {
	switch {
	case v < 1:
		c.add(path, "%s must be at least 1", path)
	case v > most:
		c.add(path, "%s %d is above %d, the kernel's largest", path, v, most)
	}
}

// minSegment is the shortest sliding-window segment the kernel keeps; the
// loader refuses shorter ones.
const minSegment = time.Millisecond

func (c checker) check(r Rule) {
	switch {
	case r.Name == "":
		c.add("name", "name is missing")
	case !utf8.ValidString(r.Name):
		c.add("name", "name is not valid UTF-8")
	case len(r.Name) > kernelrule.MaxNameLen:
		c.add("name", "name is longer than %d bytes", kernelrule.MaxNameLen)
	case strings.ContainsFunc(r.Name, func(ch rune) bool { return ch == ' ' || !unicode.IsPrint(ch) }):
		c.add("name", "name has whitespace or unprintable characters")
	case c.written && strings.HasPrefix(r.Name, KubePrefix):
		c.add("name", "names beginning %s are the rules egressd makes for Kubernetes EgressLimits", KubePrefix)
	}
	if r.Destination == (Destination{}) {
		c.add("destination", "destination is missing")
	}
	if r.Scope.Unit != "" && r.Scope.Cgroup != "" {
		c.add("cgroup", "unit and cgroup are both given; a rule has one scope")
	}
	if r.Scope.Unit != "" {
		if msg := unitProblem(r.Scope.Unit); msg != "" {
			c.add("unit", "unit %q %s", r.Scope.Unit, msg)
		}
	}
	if r.Scope.Cgroup != "" {
		if msg := cgroupProblem(r.Scope.Cgroup); msg != "" {
			c.add("cgroup", "cgroup %q %s", r.Scope.Cgroup, msg)
		}
	}
	switch l := r.Limit.(type) {
	case nil:
		c.add("limit", "no limit: give one of concurrency, perSecond, perWindow or adaptive")
	case Concurrency:
		c.count("concurrency", int(l), math.MaxUint32)
	case PerSecond:
		c.count("perSecond.permits", l.Permits, kernelrule.MaxRate)
		if l.Burst != 0 {
			c.count("perSecond.burst", l.Burst, kernelrule.MaxRate)
		}
	case PerWindow:
		c.count("perWindow.permits", l.Permits, math.MaxUint32)
		segments := l.Segments
		if segments == 0 {
			segments = kernelrule.DefaultSegments
		}
		segmentsOK := 1 <= segments && segments <= kernelrule.MaxSegments
		if !segmentsOK {
			c.add("perWindow.segments", "perWindow.segments %d is outside 1..%d", segments, kernelrule.MaxSegments)
		}
		switch {
		case l.Window <= 0:
			c.add("perWindow.window", "perWindow.window must be positive")
		case segmentsOK && !c.w.bad["perWindow.segments"] && l.Window/time.Duration(segments) < minSegment:
			c.add("perWindow.window", "perWindow.window %v in %d segments makes segments shorter than %v", l.Window, segments, minSegment)
		}
	case Adaptive:
		opts := l.Options()
		if err := opts.Validate(); err != nil {
			problems := []string{err.Error()}
			if oe, ok := errors.AsType[*adaptive.OptionsError](err); ok {
				problems = oe.Problems
			}
			for _, p := range problems {
				c.add("adaptive", "adaptive: %s", p)
			}
		}
		if l.Maximum > math.MaxUint32 {
			c.add("adaptive.maximum", "adaptive.maximum %d is above %d, the kernel's largest", l.Maximum, uint32(math.MaxUint32))
		}
		switch l.Samples {
		case "", SamplesConnect, SamplesRequest:
		default:
			c.add("adaptive.samples", "adaptive.samples %q is not connect or request", string(l.Samples))
		}
	}
	if r.IsShared() {
		c.checkShared(r)
	}
	if r.Errno != "" && errnos[r.Errno] == 0 {
		c.add("errno", "errno %q is not one a refusal may use: %s", r.Errno, strings.Join(errnoNames(), ", "))
	}
	if _, ok := r.Limit.(Adaptive); ok && r.Protocols.Has(kernelrule.ProtoUDP) {
		c.add("protocols", "an adaptive rule cannot count UDP: its loop judges latency the kernel measures on TCP connections (their handshake or their requests), and a UDP flow shows none it can trust; use protocols: [tcp], or a fixed limit")
	}
	switch {
	case r.UDPIdle == 0:
	case !r.Protocols.Has(kernelrule.ProtoUDP):
		c.add("udpIdle", "udpIdle is for UDP flows, and protocols has no udp")
	case r.UDPIdle < time.Second || r.UDPIdle > kernelrule.MaxFlowIdle || r.UDPIdle%time.Second != 0:
		c.add("udpIdle", "udpIdle %v is not a whole number of seconds between 1s and %v", r.UDPIdle, kernelrule.MaxFlowIdle)
	}
}

// maxSharedKey bounds a shared budget's key; Redis takes far longer ones,
// but a key this long is a mistake, and it travels in every request.
const maxSharedKey = 512

func (c checker) checkShared(r Rule) {
	s := r.Shared
	sentinel := false
	switch {
	case s.Redis == "":
		c.add("shared.redis", "shared.redis is missing: the URL of the Redis server that keeps the budget")
	default:
		kind, err := redisurl.Check(s.Redis)
		if err != nil {
			c.add("shared.redis", "shared.redis %q %v", s.Redis, err)
		}
		sentinel = kind == redisurl.Sentinel
	}
	switch {
	case s.Key == "":
		c.add("shared.key", "shared.key is missing: the Redis key every host sharing the budget names")
	case len(s.Key) > maxSharedKey:
		c.add("shared.key", "shared.key is longer than %d bytes", maxSharedKey)
	case strings.ContainsFunc(s.Key, func(ch rune) bool { return unicode.IsSpace(ch) || !unicode.IsPrint(ch) }):
		c.add("shared.key", "shared.key has whitespace or unprintable characters")
	}
	switch s.FailureMode {
	case "", FailureThrow, FailureAllow, FailureDeny:
	default:
		c.add("shared.failureMode", "shared.failureMode %q is not throw, allow or deny", s.FailureMode)
	}
	switch s.Durability {
	case "", DurabilityEphemeral, DurabilityPersistent:
	default:
		c.add("shared.durability", "shared.durability %q is not ephemeral or persistent", s.Durability)
	}
	if s.Lease != 0 && (s.Lease < MinLease || s.Lease > MaxLease) {
		c.add("shared.lease", "shared.lease %v is not between %v and %v (leave it out for %v)", s.Lease, MinLease, MaxLease, DefaultLease)
	}
	switch {
	case s.Replicas < 0 || s.Replicas > MaxReplicas:
		c.add("shared.replicas", "shared.replicas %d is not between 0 and %d", s.Replicas, MaxReplicas)
	case sentinel && s.Replicas == 0:
		c.add("shared.replicas", "shared.replicas must be at least 1 with Sentinel: a failover to a replica that lacked the latest grants would let the hosts exceed the budget")
	}
	switch r.Limit.(type) {
	case Adaptive:
		c.add("shared", "an adaptive limit cannot be shared: each host's loop sizes its own")
	}
	if r.Shadow {
		c.add("shared", "a shadow rule cannot be shared: it would spend the budget it only watches")
	}
}

// errnoNames lists the errnos a rule may name, sorted.
func errnoNames() []string {
	names := make([]string, 0, len(errnos))
	for name := range errnos {
		names = append(names, name)
	}
	slices.Sort(names)
	return names
}

// unitSuffixes are the systemd unit types that own a cgroup, and so can
// own connections.
var unitSuffixes = []string{".service", ".socket", ".scope", ".slice", ".mount", ".swap"}

// unitProblem says what is wrong with a systemd unit name, following
// systemd's unit_name_is_valid, or returns "".
func unitProblem(u string) string {
	i := slices.IndexFunc(unitSuffixes, func(s string) bool { return strings.HasSuffix(u, s) })
	if i < 0 {
		return "does not end in a unit type that owns a cgroup (" + strings.Join(unitSuffixes, ", ") + ")"
	}
	stem := strings.TrimSuffix(u, unitSuffixes[i])
	prefix, instance, templated := strings.Cut(stem, "@")
	switch {
	case len(u) > 255:
		return "is longer than 255 bytes"
	case prefix == "":
		return "has no name before its type"
	case strings.ContainsFunc(stem, func(c rune) bool {
		return !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || strings.ContainsRune(":-_.\\@", c))
	}):
		return "has characters systemd does not allow in unit names"
	case templated && instance == "":
		return "is a template; name an instance of it"
	case u == "-.slice":
		return "is the root slice; leave the scope out for the whole host"
	}
	return ""
}

// cgroupProblem says what is wrong with a cgroup path, or returns "". The
// depth limit is the kernel's: it finds a socket's rule by walking the
// socket's cgroup ancestors up to level 15.
func cgroupProblem(p string) string {
	switch {
	case !strings.HasPrefix(p, "/"):
		return "must start with / (a path inside the cgroup2 hierarchy)"
	case p == "/":
		return "is the whole host; leave the scope out instead"
	case path.Clean(p) != p:
		return "is not a clean path; write " + path.Clean(p)
	case !utf8.ValidString(p) || strings.ContainsFunc(p, unicode.IsControl):
		return "has control characters or invalid UTF-8"
	case strings.Count(p, "/") > 15:
		return "is deeper than 15 levels, the most the kernel follows"
	}
	return ""
}
