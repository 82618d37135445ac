package cli

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/egressd/egressd/pkg/adaptive"
	"github.com/egressd/egressd/pkg/kernelrule"
	"github.com/egressd/egressd/pkg/policy"
)

// ruleFlag is one flag of limit set and the field of a policy.Rule its
// value goes to: the CLI's one list of a rule's fields. The rule is then
// checked and written by package policy, as a policy file's rule is.
type ruleFlag struct {
	flag cli.Flag
	// set puts the flag's value in the rule being built; it is called only
	// for the flags given.
	set func(b *ruleBuilder, c *cli.Context, name string)
	// needs are the flags this one means nothing without: --burst needs
	// --per-second.
	needs []string
	// standIn puts a value in the rule for this flag when a flag that
	// needs it is given without it, so that the check does not report its
	// policy field missing too.
	standIn func(b *ruleBuilder)
}

// needing returns f needing the flags named.
func (f ruleFlag) needing(flags ...string) ruleFlag {
	f.needs = flags
	return f
}

// standingIn returns f with a stand-in value for the rule.
func (f ruleFlag) standingIn(standIn func(b *ruleBuilder)) ruleFlag {
	f.standIn = standIn
	return f
}

// flagOf pairs a flag with where its value goes; get reads the value from
// the command line ((*cli.Context).Int for an IntFlag, and so on).
func flagOf[T any](f cli.Flag, get func(*cli.Context, string) T, set func(b *ruleBuilder, flag string, v T)) ruleFlag {
	return ruleFlag{flag: f, set: func(b *ruleBuilder, c *cli.Context, name string) { set(b, "--"+name, get(c, name)) }}
}

type ruleFlagList []ruleFlag

// ruleFlags returns limit set's flags. They are made afresh for each App,
// since a cli.Flag remembers whether it was set.
func ruleFlags() ruleFlagList {
	return ruleFlagList{
		flagOf(&cli.StringFlag{Name: "dest", Required: true, Usage: "IP, CIDR or host name"}, (*cli.Context).String,
			func(b *ruleBuilder, _ string, v string) {
				d, err := policy.ParseDestination(v)
				if err != nil {
					b.problem("%v", err)
					d = standInDest // the check would add that it is missing
				}
				b.rule.Destination = d
			}),
		flagOf(&cli.UintFlag{Name: "port", DefaultText: "any", Usage: "destination port"}, (*cli.Context).Uint,
			func(b *ruleBuilder, flag string, v uint) {
				if v < 1 || v > math.MaxUint16 {
					b.problem("%s %d is outside 1..65535; leave it out for any port", flag, v)
					return
				}
				b.rule.Port = uint16(v)
			}),
		flagOf(&cli.StringFlag{Name: "protocols", DefaultText: "tcp", Usage: "what the limit counts, from one budget: tcp (connections), udp (flows: a socket and one destination) or tcp,udp"}, (*cli.Context).String,
			func(b *ruleBuilder, flag string, v string) {
				for _, name := range strings.Split(v, ",") {
					p, ok := kernelrule.ParseProtocol(strings.TrimSpace(name))
					switch {
					case !ok:
						b.problem("%s: %q is not tcp or udp", flag, name)
					case b.rule.Protocols&p != 0:
						b.problem("%s names %s twice", flag, name)
					}
					b.rule.Protocols |= p
				}
			}),
		flagOf(&cli.DurationFlag{Name: "udp-idle", DefaultText: kernelrule.DefaultFlowIdle.String(), Usage: "with udp: how long a UDP flow sent to an address may see no datagram before it ends"}, (*cli.Context).Duration,
			func(b *ruleBuilder, flag string, v time.Duration) { b.rule.UDPIdle = nonZero(b, flag, v) }).
			needing("protocols"),
		flagOf(&cli.StringFlag{Name: "scope", DefaultText: "the whole host", Usage: "cgroup path inside the cgroup2 hierarchy"}, (*cli.Context).String,
			func(b *ruleBuilder, flag string, v string) {
				b.rule.Scope.Cgroup = nonEmpty(b, flag, v, "the whole host")
			}),
		flagOf(&cli.StringFlag{Name: "unit", Usage: "systemd unit whose cgroup the limit applies to"}, (*cli.Context).String,
			func(b *ruleBuilder, flag string, v string) {
				b.rule.Scope.Unit = nonEmpty(b, flag, v, "the whole host")
			}),

		flagOf(&cli.IntFlag{Name: "concurrency", Usage: "live connections at most"}, (*cli.Context).Int,
			func(b *ruleBuilder, _ string, v int) {
				*limitOf[policy.Concurrency](b, "concurrency") = policy.Concurrency(v)
			}),

		flagOf(&cli.IntFlag{Name: "per-second", Usage: "new connections per second"}, (*cli.Context).Int,
			func(b *ruleBuilder, _ string, v int) { limitOf[policy.PerSecond](b, "perSecond").Permits = v }).
			standingIn(func(b *ruleBuilder) { limitOf[policy.PerSecond](b, "perSecond").Permits = 1 }),
		flagOf(&cli.IntFlag{Name: "burst", DefaultText: "one second's permits", Usage: "with --per-second: bucket size"}, (*cli.Context).Int,
			func(b *ruleBuilder, flag string, v int) {
				limitOf[policy.PerSecond](b, "perSecond").Burst = nonZero(b, flag, v)
			}).needing("per-second"),

		flagOf(&cli.IntFlag{Name: "per-window", Usage: "new connections per --window"}, (*cli.Context).Int,
			func(b *ruleBuilder, _ string, v int) { limitOf[policy.PerWindow](b, "perWindow").Permits = v }).
			needing("window").
			standingIn(func(b *ruleBuilder) { limitOf[policy.PerWindow](b, "perWindow").Permits = 1 }),
		flagOf(&cli.DurationFlag{Name: "window", Usage: "with --per-window: the sliding window"}, (*cli.Context).Duration,
			func(b *ruleBuilder, _ string, v time.Duration) { limitOf[policy.PerWindow](b, "perWindow").Window = v }).
			needing("per-window").
			standingIn(func(b *ruleBuilder) { limitOf[policy.PerWindow](b, "perWindow").Window = time.Hour }),
		flagOf(&cli.IntFlag{Name: "segments", DefaultText: fmt.Sprint(kernelrule.DefaultSegments), Usage: "with --per-window: segments of the window"}, (*cli.Context).Int,
			func(b *ruleBuilder, flag string, v int) {
				limitOf[policy.PerWindow](b, "perWindow").Segments = nonZero(b, flag, v)
			}).needing("per-window", "window"),

		flagOf(&cli.BoolFlag{Name: "adaptive", Usage: "a concurrency limit moved by measured latency"}, (*cli.Context).Bool,
			func(b *ruleBuilder, _ string, v bool) {
				if v {
					limitOf[policy.Adaptive](b, "adaptive")
				}
			}).
			// A tuning flag without --adaptive: the rule's limit is
			// adaptive unless another flag gave it one.
			standingIn(func(b *ruleBuilder) {
				if b.limit == nil {
					limitOf[policy.Adaptive](b, "adaptive")
				}
			}),
		flagOf(&cli.IntFlag{Name: "min", DefaultText: fmt.Sprint(adaptive.DefaultMinimum), Usage: "with --adaptive: floor"}, (*cli.Context).Int,
			func(b *ruleBuilder, flag string, v int) {
				adaptiveOf(b, flag).Minimum = nonZero(b, flag, v)
			}).needing("adaptive"),
		flagOf(&cli.IntFlag{Name: "max", DefaultText: fmt.Sprint(adaptive.DefaultMaximum), Usage: "with --adaptive: ceiling"}, (*cli.Context).Int,
			func(b *ruleBuilder, flag string, v int) {
				adaptiveOf(b, flag).Maximum = nonZero(b, flag, v)
			}).needing("adaptive"),
		flagOf(&cli.IntFlag{Name: "initial", DefaultText: fmt.Sprint(adaptive.DefaultInitial), Usage: "with --adaptive: starting limit"}, (*cli.Context).Int,
			func(b *ruleBuilder, flag string, v int) {
				adaptiveOf(b, flag).Initial = nonZero(b, flag, v)
			}).needing("adaptive"),
		flagOf(&cli.Float64Flag{Name: "multiple", DefaultText: fmt.Sprint(adaptive.DefaultMultiple), Usage: "with --adaptive: how many times the baseline latency counts as queueing"}, (*cli.Context).Float64,
			func(b *ruleBuilder, flag string, v float64) {
				adaptiveOf(b, flag).Multiple = nonZero(b, flag, v)
			}).needing("adaptive"),
		flagOf(&cli.Float64Flag{Name: "decrease-factor", DefaultText: fmt.Sprint(adaptive.DefaultDecreaseFactor), Usage: "with --adaptive: what the limit is multiplied by on queueing"}, (*cli.Context).Float64,
			func(b *ruleBuilder, flag string, v float64) {
				adaptiveOf(b, flag).DecreaseFactor = nonZero(b, flag, v)
			}).needing("adaptive"),
		flagOf(&cli.IntFlag{Name: "probe-every", DefaultText: fmt.Sprint(adaptive.DefaultProbeEvery), Usage: "with --adaptive: the period of drain probes, in rounds; 0 for none, the reference loop"}, (*cli.Context).Int,
			func(b *ruleBuilder, flag string, v int) {
				a := adaptiveOf(b, flag)
				switch {
				case v < 0:
					b.problem("%s %d must be at least 0 (0: no probes, the reference loop)", flag, v)
				case v == 0:
					a.ProbeEvery = adaptive.NoProbes
				default:
					a.ProbeEvery = v
				}
			}).needing("adaptive"),
		flagOf(&cli.Float64Flag{Name: "probe-factor", DefaultText: fmt.Sprint(adaptive.DefaultProbeFactor), Usage: "with --adaptive: the limit during a probe, as a fraction"}, (*cli.Context).Float64,
			func(b *ruleBuilder, flag string, v float64) {
				adaptiveOf(b, flag).ProbeFactor = nonZero(b, flag, v)
			}).needing("adaptive"),
		flagOf(&cli.DurationFlag{Name: "max-healthy", DefaultText: "none", Usage: "with --adaptive: a round whose fastest connection takes longer decreases the limit, whatever the baseline"}, (*cli.Context).Duration,
			func(b *ruleBuilder, flag string, v time.Duration) {
				adaptiveOf(b, flag).MaxHealthy = nonZero(b, flag, v)
			}).needing("adaptive"),
		flagOf(&cli.DurationFlag{Name: "baseline", DefaultText: "measured", Usage: "with --adaptive: a fixed baseline latency instead of a measured one, and no probes"}, (*cli.Context).Duration,
			func(b *ruleBuilder, flag string, v time.Duration) {
				adaptiveOf(b, flag).Baseline = nonZero(b, flag, v)
			}).needing("adaptive"),
		flagOf(&cli.StringFlag{Name: "samples", DefaultText: "request", Usage: "with --adaptive: request or connect latency"}, (*cli.Context).String,
			func(b *ruleBuilder, flag string, v string) {
				adaptiveOf(b, flag).Samples = policy.Samples(nonEmpty(b, flag, v, "request"))
			}).needing("adaptive"),

		flagOf(&cli.BoolFlag{Name: "shadow", Usage: "count what would be refused, refuse nothing"}, (*cli.Context).Bool,
			func(b *ruleBuilder, _ string, v bool) { b.rule.Shadow = v }),
		flagOf(&cli.StringFlag{Name: "errno", DefaultText: "EPERM", Usage: "errno a refused connect() returns"}, (*cli.Context).String,
			func(b *ruleBuilder, flag string, v string) { b.rule.Errno = nonEmpty(b, flag, v, "EPERM") }),

		flagOf(&cli.StringFlag{Name: "shared-redis", Usage: "share the limit with every host naming the same --shared-key: URL of the Redis server keeping it"}, (*cli.Context).String,
			func(b *ruleBuilder, flag string, v string) {
				// Empty, it would make the rule this host's own: a
				// fleet's budget whose URL came from an unset variable.
				if v == "" {
					b.problem("%s is empty: give the URL of the Redis server that keeps the budget", flag)
					v = standInRedis
				}
				b.rule.Shared.Redis = v
			}).
			needing("shared-key").
			standingIn(func(b *ruleBuilder) { b.rule.Shared.Redis = standInRedis }),
		flagOf(&cli.StringFlag{Name: "shared-key", Usage: "with --shared-redis: the budget's Redis key"}, (*cli.Context).String,
			func(b *ruleBuilder, _ string, v string) { b.rule.Shared.Key = v }).
			needing("shared-redis").
			standingIn(func(b *ruleBuilder) { b.rule.Shared.Key = standInKey }),
		flagOf(&cli.StringFlag{Name: "shared-failure-mode", DefaultText: "throw", Usage: "with --shared-redis: throw (keep the last share), allow (the whole limit) or deny while Redis is unreachable"}, (*cli.Context).String,
			func(b *ruleBuilder, flag string, v string) { b.rule.Shared.FailureMode = nonEmpty(b, flag, v, "throw") }).
			needing("shared-redis"),
		flagOf(&cli.StringFlag{Name: "shared-durability", DefaultText: "ephemeral", Usage: "with --shared-redis: ephemeral (Redis may lose the budget: a budget it has no record of is frozen for a lease) or persistent (an AOF keeps it)"}, (*cli.Context).String,
			func(b *ruleBuilder, flag string, v string) {
				b.rule.Shared.Durability = nonEmpty(b, flag, v, "ephemeral")
			}).needing("shared-redis"),
		flagOf(&cli.DurationFlag{Name: "shared-lease", DefaultText: policy.DefaultLease.String(), Usage: "with --shared-redis: how long this host's slots outlive its daemon's last renewal"}, (*cli.Context).Duration,
			func(b *ruleBuilder, flag string, v time.Duration) { b.rule.Shared.Lease = nonZero(b, flag, v) }).
			needing("shared-redis"),
		flagOf(&cli.IntFlag{Name: "shared-replicas", DefaultText: "none", Usage: "with --shared-redis: Redis replicas that must confirm a grant before it is used; at least 1 with Sentinel"}, (*cli.Context).Int,
			func(b *ruleBuilder, _ string, v int) { b.rule.Shared.Replicas = v }).needing("shared-redis"),
	}
}

// Stand-ins for a value whose problem a flag has already reported. A rule
// with a problem is never sent.
var (
	standInDest, _ = policy.ParseDestination("192.0.2.1")
	standInRedis   = "redis://192.0.2.1:6379"
	standInKey     = "k"
)

func (l ruleFlagList) cliFlags() []cli.Flag {
	flags := make([]cli.Flag, len(l))
	for i, f := range l {
		flags[i] = f.flag
	}
	return flags
}

// rule builds the rule the flags given describe, and checks it: every
// problem at once, those of the flags and those package policy finds.
func (l ruleFlagList) rule(c *cli.Context, name string) (policy.Rule, error) {
	b := &ruleBuilder{rule: policy.Rule{Name: name}, adaptive: c.Bool("adaptive"), notAdaptive: c.IsSet("adaptive") && !c.Bool("adaptive")}
	for _, f := range l {
		if n := f.flag.Names()[0]; c.IsSet(n) {
			f.set(b, c, n)
		}
	}
	l.needs(b, c)
	if b.limit != nil {
		b.rule.Limit = b.limit()
	}
	err := (&policy.Policy{Rules: []policy.Rule{b.rule}}).Validate()
	if pe, ok := errors.AsType[*policy.Error](err); ok {
		for _, p := range pe.Problems {
			b.problems = append(b.problems, p.Msg)
		}
	} else if err != nil {
		return policy.Rule{}, err
	}
	if len(b.problems) > 0 {
		return policy.Rule{}, fmt.Errorf("rule %s: %s", name, strings.Join(b.problems, "\nrule "+name+": "))
	}
	return b.rule, nil
}

// needs reports each flag given without a flag it needs, and puts a stand-in
// in the rule for the flag missing.
func (l ruleFlagList) needs(b *ruleBuilder, c *cli.Context) {
	for _, f := range l {
		n := f.flag.Names()[0]
		if !c.IsSet(n) {
			continue
		}
		var missing []string
		for _, need := range f.needs {
			if c.IsSet(need) {
				continue
			}
			missing = append(missing, "--"+need)
			if i := slices.IndexFunc(l, func(f ruleFlag) bool { return f.flag.Names()[0] == need }); l[i].standIn != nil {
				l[i].standIn(b)
			}
		}
		if len(missing) > 0 {
			b.problem("--%s needs %s", n, strings.Join(missing, " and "))
		}
	}
}

// ruleBuilder is a rule as the flags fill it in.
type ruleBuilder struct {
	rule     policy.Rule
	problems []string
	// adaptive is --adaptive; notAdaptive is --adaptive=false, which the
	// flags that tune an adaptive limit must not override.
	adaptive, notAdaptive bool

	// limit returns the rule's one shape once a flag chose it; shape is
	// its policy field and shapeOf the value the shape's flags fill in.
	limit   func() policy.Limit
	shape   string
	shapeOf any
	others  []string // further shapes asked for, each said once
}

func (b *ruleBuilder) problem(format string, args ...any) {
	b.problems = append(b.problems, fmt.Sprintf(format, args...))
}

// limitOf returns the rule's limit of type L, for a flag of the shape whose
// policy field is field. The first shape a flag asks for is the rule's;
// another is a problem, as it is in a policy file, and its flags fill in a
// value that is thrown away.
func limitOf[L policy.Limit](b *ruleBuilder, field string) *L {
	if b.limit == nil {
		p := new(L)
		b.limit, b.shape, b.shapeOf = func() policy.Limit { return *p }, field, p
		return p
	}
	if p, ok := b.shapeOf.(*L); ok {
		return p
	}
	if !slices.Contains(b.others, field) {
		b.others = append(b.others, field)
		b.problem("%s and %s are both given; a rule has one limit", b.shape, field)
	}
	return new(L)
}

// adaptiveOf is limitOf for a flag that tunes an adaptive limit. Only
// --adaptive makes the rule adaptive: a tuning flag alone is reported as
// needing it, and not as a second limit beside another flag's.
func adaptiveOf(b *ruleBuilder, flag string) *policy.Adaptive {
	switch {
	case b.notAdaptive:
		b.problem("%s tunes an adaptive limit, and --adaptive=false is given", flag)
		return new(policy.Adaptive)
	case !b.adaptive:
		return new(policy.Adaptive)
	}
	return limitOf[policy.Adaptive](b, "adaptive")
}

// nonZero refuses 0 for a field whose zero means its default, as a policy
// file does: a flag given as 0 is a mistake more often than a way of
// asking for the default.
func nonZero[T int | float64 | time.Duration](b *ruleBuilder, flag string, v T) T {
	if v == 0 {
		b.problem("%s 0 is not allowed; leave it out for the default", flag)
	}
	return v
}

// nonEmpty refuses an empty string for a field whose absence means def.
func nonEmpty(b *ruleBuilder, flag, v, def string) string {
	if v == "" {
		b.problem("%s is empty; leave it out for %s", flag, def)
	}
	return v
}
