package policy

import (
	"fmt"
	"math"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/egressd/egressd/pkg/adaptive"
	"github.com/egressd/egressd/pkg/kernelrule"
	"go.yaml.in/yaml/v3"
)

// Field is one field of a rule: its key in a policy file, its flag of
// egressd limit set, and how its value is read, checked and written.
// [Parse], [Format] and [FromFlags] all follow [Fields], so that a policy
// file and the command line cannot come to differ.
type Field struct {
	// Path is the field's key in a rule; a field of a mapping has the
	// mapping's key and a dot before its own ("perSecond.burst").
	Path string
	// Flag is the field's flag, without its dashes; "" for name, which
	// the command line takes as an argument, and for the mappings that
	// have none.
	Flag string
	// Usage and Default are the flag's help: what it sets, and what
	// leaving it out means.
	Usage, Default string
	// Value is the zero value of the flag's type: int, float64, string,
	// bool or time.Duration.
	Value any
	// Required is set for the flag without which no rule is taken.
	Required bool
	// Needs are the flags this one means nothing without: --burst needs
	// --per-second.
	Needs []string

	value value
	// limit is set for a field that gives the rule its limit, one per
	// shape: it returns the limit the draft's fields make.
	limit func(*draft) Limit
	// together is set for a mapping whose fields are checked together:
	// with one refused, the others would be judged against its default.
	together bool
	// key is the field's key in its mapping, one node that every rule
	// written shares; fields are a mapping's fields.
	key    *yaml.Node
	fields []*Field
}

// Fields returns the fields of a rule in the order [Format] writes them.
func Fields() []Field { return slices.Clone(ruleFields) }

var (
	adaptiveFlag = []string{"adaptive"}
	redisFlag    = []string{"shared-redis"}
)

var ruleFields = []Field{
	{Path: "name", value: typed(func(d *draft) *string { return &d.Name }, fields.str, keep, str)},
	{Path: "destination", Flag: "dest", Required: true, Usage: "IP, CIDR or host name",
		value: typed(func(d *draft) *Destination { return &d.Destination }, fields.str, destination, func(d Destination) *yaml.Node { return str(d.String()) })},
	{Path: "port", Flag: "port", Default: "any", Usage: "destination port",
		value: typed(func(d *draft) *uint16 { return &d.Port }, whole(1, math.MaxUint16), port, func(p uint16) *yaml.Node { return itoa(int(p)) })},
	{Path: "protocols", Flag: "protocols", Default: "tcp", Usage: "what the limit counts, from one budget: tcp (connections), udp (flows: a socket and one destination) or tcp,udp",
		value: protocols},
	{Path: "udpIdle", Flag: "udp-idle", Default: kernelrule.DefaultFlowIdle.String(), Needs: []string{"protocols"}, Usage: "with udp: how long a UDP flow sent to an address may see no datagram before it ends",
		value: duration(func(d *draft) *time.Duration { return &d.UDPIdle }, notZero[time.Duration]("the default, "+kernelrule.DefaultFlowIdle.String()))},
	{Path: "unit", Flag: "unit", Usage: "systemd unit whose cgroup the limit applies to",
		value: nonEmpty(func(d *draft) *string { return &d.Scope.Unit }, "; leave it out for the whole host")},
	{Path: "cgroup", Flag: "scope", Default: "the whole host", Usage: "cgroup path inside the cgroup2 hierarchy",
		value: nonEmpty(func(d *draft) *string { return &d.Scope.Cgroup }, "; leave it out for the whole host")},

	{Path: "concurrency", Flag: "concurrency", Usage: "live connections at most", limit: func(d *draft) Limit { return d.concurrency },
		value: count(func(d *draft) *int { return (*int)(&d.concurrency) }, 1, math.MaxUint32)},

	{Path: "perSecond", limit: func(d *draft) Limit { return d.perSecond }},
	{Path: "perSecond.permits", Flag: "per-second", Usage: "new connections per second",
		value: count(func(d *draft) *int { return &d.perSecond.Permits }, 1, kernelrule.MaxRate)},
	{Path: "perSecond.burst", Flag: "burst", Default: "one second's permits", Needs: []string{"per-second"}, Usage: "with --per-second: bucket size",
		value: optional(func(d *draft) *int { return &d.perSecond.Burst }, 1, kernelrule.MaxRate)},

	{Path: "perWindow", limit: func(d *draft) Limit { return d.perWindow }},
	{Path: "perWindow.permits", Flag: "per-window", Needs: []string{"window"}, Usage: "new connections per --window",
		value: count(func(d *draft) *int { return &d.perWindow.Permits }, 1, math.MaxUint32)},
	{Path: "perWindow.window", Flag: "window", Needs: []string{"per-window"}, Usage: "with --per-window: the sliding window",
		value: duration(func(d *draft) *time.Duration { return &d.perWindow.Window }, keep)},
	{Path: "perWindow.segments", Flag: "segments", Default: fmt.Sprint(kernelrule.DefaultSegments), Needs: []string{"per-window", "window"}, Usage: "with --per-window: segments of the window",
		value: optional(func(d *draft) *int { return &d.perWindow.Segments }, 1, kernelrule.MaxSegments)},

	{Path: "adaptive", Flag: "adaptive", Usage: "a concurrency limit moved by measured latency", limit: func(d *draft) Limit { return d.adaptive },
		value: value{flag: false}, together: true},
	{Path: "adaptive.minimum", Flag: "min", Default: fmt.Sprint(adaptive.DefaultMinimum), Needs: adaptiveFlag, Usage: "with --adaptive: floor",
		value: optional(func(d *draft) *int { return &d.adaptive.Minimum }, 1, math.MaxUint32)},
	{Path: "adaptive.maximum", Flag: "max", Default: fmt.Sprint(adaptive.DefaultMaximum), Needs: adaptiveFlag, Usage: "with --adaptive: ceiling",
		value: optional(func(d *draft) *int { return &d.adaptive.Maximum }, 1, math.MaxUint32)},
	{Path: "adaptive.initial", Flag: "initial", Default: fmt.Sprint(adaptive.DefaultInitial), Needs: adaptiveFlag, Usage: "with --adaptive: starting limit",
		value: optional(func(d *draft) *int { return &d.adaptive.Initial }, 1, math.MaxUint32)},
	{Path: "adaptive.multiple", Flag: "multiple", Default: fmt.Sprint(adaptive.DefaultMultiple), Needs: adaptiveFlag, Usage: "with --adaptive: how many times the baseline latency counts as queueing",
		value: number(func(d *draft) *float64 { return &d.adaptive.Multiple })},
	{Path: "adaptive.decreaseFactor", Flag: "decrease-factor", Default: fmt.Sprint(adaptive.DefaultDecreaseFactor), Needs: adaptiveFlag, Usage: "with --adaptive: what the limit is multiplied by on queueing",
		value: number(func(d *draft) *float64 { return &d.adaptive.DecreaseFactor })},
	{Path: "adaptive.probeEvery", Flag: "probe-every", Default: fmt.Sprint(adaptive.DefaultProbeEvery), Needs: adaptiveFlag, Usage: "with --adaptive: the period of drain probes, in rounds; 0 for none, the reference loop",
		value: typed(func(d *draft) *int { return &d.adaptive.ProbeEvery }, whole(0, math.MaxInt), probeEvery, func(x int) *yaml.Node { return itoa(max(x, 0)) })},
	{Path: "adaptive.probeFactor", Flag: "probe-factor", Default: fmt.Sprint(adaptive.DefaultProbeFactor), Needs: adaptiveFlag, Usage: "with --adaptive: the limit during a probe, as a fraction",
		value: number(func(d *draft) *float64 { return &d.adaptive.ProbeFactor })},
	{Path: "adaptive.maxHealthy", Flag: "max-healthy", Default: "none", Needs: adaptiveFlag, Usage: "with --adaptive: a round whose fastest connection takes longer decreases the limit, whatever the baseline",
		value: duration(func(d *draft) *time.Duration { return &d.adaptive.MaxHealthy }, positive)},
	{Path: "adaptive.baseline", Flag: "baseline", Default: "measured", Needs: adaptiveFlag, Usage: "with --adaptive: a fixed baseline latency instead of a measured one, and no probes",
		value: duration(func(d *draft) *time.Duration { return &d.adaptive.Baseline }, positive)},
	// Judged by the check, as a rule built in code is.
	{Path: "adaptive.samples", Flag: "samples", Default: "request", Needs: adaptiveFlag, Usage: "with --adaptive: request or connect latency",
		value: nonEmpty(func(d *draft) *string { return (*string)(&d.adaptive.Samples) }, "; leave it out for request")},

	{Path: "shadow", Flag: "shadow", Usage: "count what would be refused, refuse nothing",
		value: typed(func(d *draft) *bool { return &d.Shadow }, fields.boolean, keep, func(bool) *yaml.Node { return scalar("true") })},
	{Path: "errno", Flag: "errno", Default: "EPERM", Usage: "errno a refused connect() returns",
		value: nonEmpty(func(d *draft) *string { return &d.Errno }, "; leave it out for EPERM")},

	{Path: "shared"},
	// Empty, it would make the rule this host's own: a fleet's budget
	// whose URL came from an unset variable.
	{Path: "shared.redis", Flag: "shared-redis", Needs: []string{"shared-key"}, Usage: "share the limit with every host naming the same --shared-key: URL of the Redis server keeping it",
		value: nonEmpty(func(d *draft) *string { return &d.Shared.Redis }, ": give the URL of the Redis server that keeps the budget")},
	{Path: "shared.key", Flag: "shared-key", Needs: redisFlag, Usage: "with --shared-redis: the budget's Redis key",
		value: nonEmpty(func(d *draft) *string { return &d.Shared.Key }, "")},
	{Path: "shared.failureMode", Flag: "shared-failure-mode", Default: "throw", Needs: redisFlag, Usage: "with --shared-redis: throw (keep the last share), allow (the whole limit) or deny while Redis is unreachable",
		value: nonEmpty(func(d *draft) *string { return &d.Shared.FailureMode }, "; leave it out for throw")},
	{Path: "shared.durability", Flag: "shared-durability", Default: "ephemeral", Needs: redisFlag, Usage: "with --shared-redis: ephemeral (Redis may lose the budget: a budget it has no record of is frozen for a lease) or persistent (an AOF keeps it)",
		value: nonEmpty(func(d *draft) *string { return &d.Shared.Durability }, "; leave it out for ephemeral")},
	{Path: "shared.lease", Flag: "shared-lease", Default: DefaultLease.String(), Needs: redisFlag, Usage: "with --shared-redis: how long this host's slots outlive its daemon's last renewal",
		value: duration(func(d *draft) *time.Duration { return &d.Shared.Lease }, notZero[time.Duration]("the default"))},
	{Path: "shared.replicas", Flag: "shared-replicas", Default: "none", Needs: redisFlag, Usage: "with --shared-redis: Redis replicas that must confirm a grant before it is used; at least 1 with Sentinel",
		value: count(func(d *draft) *int { return &d.Shared.Replicas }, 0, MaxReplicas)},
}

// fieldAt and flagAt are each field by its path and by its flag;
// keysUnder are the keys of each mapping by the prefix of its fields'
// paths ("" for a rule's own), whose fields are topFields.
var (
	fieldAt   = map[string]*Field{}
	flagAt    = map[string]*Field{}
	keysUnder = map[string][]string{}
	topFields []*Field
)

func init() {
	for i := range ruleFields {
		f := &ruleFields[i]
		f.Value = f.value.flag
		fieldAt[f.Path] = f
		if f.Flag != "" {
			flagAt[f.Flag] = f
		}
		dot := strings.LastIndexByte(f.Path, '.')
		prefix, key := f.Path[:dot+1], f.Path[dot+1:]
		f.key = scalar(key)
		keysUnder[prefix] = append(keysUnder[prefix], key)
		if m := fieldAt[strings.TrimSuffix(prefix, ".")]; m != nil {
			m.fields = append(m.fields, f)
		} else {
			topFields = append(topFields, f)
		}
	}
}

// FromFlags builds the rule called name from the flags of egressd limit
// set that were given, by [Field.Flag], each a value of its
// [Field.Value]'s type, and checks it as [Parse] checks a file's rule.
// Its problems come all at once, as an [*Error]: the flags' own, naming
// the flag, then those of a flag given without one it needs, then the
// rule's, naming the policy's field.
func FromFlags(name string, given map[string]any) (Rule, error) {
	d, w := &draft{Rule: Rule{Name: name}}, newWhere(nil)
	var problems []Problem
	report := func(path string) func(string) {
		return func(msg string) {
			problems = append(problems, Problem{Rule: label(name, 0), Msg: msg})
			if path != "" {
				w.refuse(path)
			}
		}
	}
	for i := range ruleFields {
		f := &ruleFields[i]
		v, ok := given[f.Flag]
		if f.Flag == "" || !ok {
			continue
		}
		// A flag chooses its shape; where the shape has a flag of its own
		// (--adaptive), only that flag does, and only when true: limit
		// set replaces a rule whole, so a tuning flag alone would make a
		// new adaptive limit.
		shape, _, _ := strings.Cut(f.Path, ".")
		if s := fieldAt[shape]; s.limit != nil && (s.Flag == "" || s == f && v != false) {
			if msg := d.choose(s.Path); msg != "" {
				report("")(msg)
			}
		}
		if f.value.set != nil {
			f.value.set(d, "--"+f.Flag, v, report(f.Path))
		}
	}
	for _, f := range ruleFields {
		if _, ok := given[f.Flag]; f.Flag == "" || !ok {
			continue
		}
		var missing []string
		for _, need := range f.Needs {
			switch v, ok := given[need]; {
			case !ok:
				// Refused, so that the rule's check does not say its
				// field is missing too.
				missing = append(missing, "--"+need)
				w.refuse(flagAt[need].Path)
			case v == false: // of the flags others need, only --adaptive is a bool
				report("")(fmt.Sprintf("--%s tunes an adaptive limit, and --%s=false is given", f.Flag, need))
			}
		}
		if len(missing) > 0 {
			report("")(fmt.Sprintf("--%s needs %s", f.Flag, strings.Join(missing, " and ")))
		}
	}
	r := d.rule(w)
	if problems = append(problems, check([]Rule{r}, []*where{w})...); len(problems) > 0 {
		return Rule{}, &Error{Problems: problems}
	}
	return r, nil
}

// draft is a rule as its fields are read, with a place for the fields of
// each shape: the first shape given becomes the rule's limit.
type draft struct {
	Rule
	concurrency Concurrency
	perSecond   PerSecond
	perWindow   PerWindow
	adaptive    Adaptive
	// shape is the path of the limit's field; others are the shapes given
	// after it, each refused once. unread is set when the shape's value
	// could not be read: the rule has no limit to check.
	shape  string
	others []string
	unread bool
}

// draftOf is r with its limit's fields in place, to be written.
func draftOf(r Rule) *draft {
	d := &draft{Rule: r}
	switch l := r.Limit.(type) {
	case Concurrency:
		d.concurrency, d.shape = l, "concurrency"
	case PerSecond:
		d.perSecond, d.shape = l, "perSecond"
	case PerWindow:
		d.perWindow, d.shape = l, "perWindow"
	case Adaptive:
		d.adaptive, d.shape = l, "adaptive"
	}
	return d
}

// choose makes shape the rule's limit, unless another came first: then
// it returns the problem, said once for each shape given after it.
func (d *draft) choose(shape string) string {
	switch {
	case d.shape == "":
		d.shape = shape
	case d.shape != shape && !slices.Contains(d.others, shape):
		d.others = append(d.others, shape)
		return fmt.Sprintf("%s and %s are both given; a rule has one limit", d.shape, shape)
	}
	return ""
}

// rule is the rule d holds. A shape refused refuses the limit: "no limit"
// would repeat why.
func (d *draft) rule(w *where) Rule {
	r := d.Rule
	for _, f := range ruleFields {
		if f.limit != nil && f.Path == d.shape && !d.unread {
			r.Limit = f.limit(d)
		}
		if f.limit != nil && w.bad[f.Path] {
			w.refuse("limit")
		}
	}
	return r
}

// node writes fields of d as a mapping: those at their zero value are
// left out, and so are mappings with no field written but the rule's
// shape.
func (d *draft) node(fields []*Field) *yaml.Node {
	m := &yaml.Node{Kind: yaml.MappingNode, Content: make([]*yaml.Node, 0, 2*len(fields))}
	for _, f := range fields {
		var v *yaml.Node
		if f.value.write != nil {
			v = f.value.write(d)
		} else if g := d.node(f.fields); len(g.Content) > 0 || f.Path == d.shape {
			g.Style = yaml.FlowStyle // one line, as the examples in the docs write it
			v = g
		}
		if v != nil {
			m.Content = append(m.Content, f.key, v)
		}
	}
	return m
}

// value is how one field's value is read from a file or a flag, checked,
// kept in a draft and written back.
type value struct {
	// flag is the zero value of the type of the field's flag.
	flag any
	// decode reads the field from its node in a file into d, or reports
	// its problem; nil for a mapping.
	decode func(f fields, d *draft, path string, n *yaml.Node)
	// set puts the value of the field's flag in d, reporting each problem
	// with it (named name) to problem.
	set func(d *draft, name string, v any, problem func(string))
	// write returns the field's node in a file, nil to leave it out.
	write func(d *draft) *yaml.Node
}

// typed is a value kept in a draft, as T, at at: read from a node as F
// by read, which reports a node of another type; checked by check, which
// returns the value to keep or a problem naming the field; written by
// write, and left out at its zero value. A flag gives an F.
func typed[F any, T comparable](at func(*draft) *T, read func(fields, string, *yaml.Node) (F, bool), check func(string, F) (T, string), write func(T) *yaml.Node) value {
	put := func(d *draft, name string, v F) string {
		x, msg := check(name, v)
		if msg == "" {
			*at(d) = x
		}
		return msg
	}
	var zero T
	var flag F
	return value{
		flag: flag,
		decode: func(f fields, d *draft, path string, n *yaml.Node) {
			if v, ok := read(f, path, n); ok {
				if msg := put(d, path, v); msg != "" {
					f.problem(n, path, "%s", msg)
				}
			}
		},
		set: func(d *draft, name string, v any, problem func(string)) {
			if msg := put(d, name, v.(F)); msg != "" {
				problem(msg)
			}
		},
		write: func(d *draft) *yaml.Node {
			if x := *at(d); x != zero {
				return write(x)
			}
			return nil
		},
	}
}

// count is a whole number only the check judges; lo..hi is its range, for
// a number too large to read.
func count(at func(*draft) *int, lo, hi int) value { return typed(at, whole(lo, hi), keep, itoa) }

// optional is a whole number whose 0 means the default.
func optional(at func(*draft) *int, lo, hi int) value {
	return typed(at, whole(lo, hi), notZero[int]("the default"), itoa)
}

// number is a number whose 0 means the default.
func number(at func(*draft) *float64) value {
	return typed(at, fields.number, notZero[float64]("the default"), func(x float64) *yaml.Node {
		return scalar(strconv.FormatFloat(x, 'g', -1, 64))
	})
}

func duration(at func(*draft) *time.Duration, check func(string, time.Duration) (time.Duration, string)) value {
	return typed(at, fields.duration, check, func(d time.Duration) *yaml.Node { return str(d.String()) })
}

// nonEmpty is a string whose absence means something (hint says what):
// written empty, it would read as left out, and so silently mean that.
func nonEmpty(at func(*draft) *string, hint string) value {
	return typed(at, fields.str, func(name, s string) (string, string) {
		if s == "" {
			return s, name + " is empty" + hint
		}
		return s, ""
	}, str)
}

// protocols is a list of protocols, [tcp, udp] in a file and tcp,udp as
// a flag.
var protocols = value{
	flag: "",
	decode: func(f fields, d *draft, path string, n *yaml.Node) {
		switch {
		case n.Kind != yaml.SequenceNode:
			f.problem(n, path, "%s is a list, such as [tcp, udp]", path)
			return
		case len(n.Content) == 0:
			f.problem(n, path, "%s is empty; name tcp, udp or both, or leave it out for [tcp]", path)
			return
		}
		var names []string
		var at []*yaml.Node
		for _, item := range n.Content {
			if name, ok := f.str(path, item); ok {
				names, at = append(names, name), append(at, item)
			}
		}
		d.Protocols = protocolsOf(path, names, func(i int, msg string) { f.problem(at[i], path, "%s", msg) })
	},
	set: func(d *draft, name string, v any, problem func(string)) {
		names := strings.Split(v.(string), ",")
		for i := range names {
			names[i] = strings.TrimSpace(names[i])
		}
		d.Protocols = protocolsOf(name, names, func(_ int, msg string) { problem(msg) })
	},
	write: func(d *draft) *yaml.Node {
		if d.Protocols == 0 {
			return nil
		}
		return list(strings.Split(d.Protocols.String(), ","))
	},
}

// protocolsOf reads the protocols names, reporting each unknown or
// repeated one by its index.
func protocolsOf(field string, names []string, problem func(i int, msg string)) kernelrule.Protocols {
	var p kernelrule.Protocols
	for i, name := range names {
		q, known := kernelrule.ParseProtocol(name)
		switch {
		case !known:
			problem(i, fmt.Sprintf("%s: %q is not tcp or udp", field, name))
		case p&q != 0:
			problem(i, fmt.Sprintf("%s names %s twice", field, name))
		}
		p |= q
	}
	return p
}

// The checks of a field's value, read from a file or given as a flag:
// each returns the value to keep, or a problem naming the field name.

func keep[T any](_ string, v T) (T, string) { return v, "" }

// notZero refuses 0 for a field whose absence means hint: a 0 written is
// a mistake more often than a way to ask for the default.
func notZero[T int | float64 | time.Duration](hint string) func(string, T) (T, string) {
	return func(name string, v T) (T, string) {
		if v == 0 {
			return v, name + " 0 is not allowed; leave it out for " + hint
		}
		return v, ""
	}
}

// positive is a duration whose absence means none.
func positive(name string, d time.Duration) (time.Duration, string) {
	if d < 0 {
		return d, fmt.Sprintf("%s %v must be positive", name, d)
	}
	return notZero[time.Duration]("none")(name, d)
}

// probeEvery's 0 is not the default but the reference loop:
// adaptive.NoProbes, which a file writes as 0.
func probeEvery(name string, x int) (int, string) {
	switch {
	case x < 0:
		return x, fmt.Sprintf("%s %d must be at least 0 (0: no probes, the reference loop)", name, x)
	case x == 0:
		return adaptive.NoProbes, ""
	}
	return x, ""
}

func port(name string, x int) (uint16, string) {
	if x < 1 || x > math.MaxUint16 {
		return 0, fmt.Sprintf("%s %d is outside 1..65535; leave it out for any port", name, x)
	}
	return uint16(x), ""
}

func destination(_ string, s string) (Destination, string) {
	d, err := ParseDestination(s)
	if err != nil {
		return d, err.Error()
	}
	return d, ""
}

func scalar(s string) *yaml.Node { return &yaml.Node{Kind: yaml.ScalarNode, Value: s} }

func itoa(x int) *yaml.Node { return scalar(strconv.Itoa(x)) }

// str is a string, quoted where YAML would read it as something else. A
// YAML 1.1 reader reads yes and 1:30 as a bool and a number, and yaml.v3
// quotes them when it writes a string field: so does Format.
func str(s string) *yaml.Node {
	n := &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!str", Value: s}
	if (len(s) <= 3 || strings.IndexByte(s, ':') > 0) && yaml11.MatchString(s) {
		n.Style = yaml.DoubleQuotedStyle
	}
	return n
}

var yaml11 = regexp.MustCompile(`^(?:[yYnN]|[yY]es|YES|[nN]o|NO|[oO]n|ON|[oO]ff|OFF|[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?)$`)

// list is a list of strings on one line.
func list(items []string) *yaml.Node {
	n := &yaml.Node{Kind: yaml.SequenceNode, Style: yaml.FlowStyle}
	for _, s := range items {
		n.Content = append(n.Content, str(s))
	}
	return n
}
