package policy

import (
	"errors"
	"os"
	"regexp"
	"strings"
	"testing"
)

// TestDocsListProblems: each problem here is written in docs/policy.md's
// list of every problem the check reports, as the check words it, with
// its values as placeholders: a single capital letter, NAME, or "…".
func TestDocsListProblems(t *testing.T) {
	data, err := os.ReadFile("../../docs/policy.md")
	if err != nil {
		t.Fatal(err)
	}
	_, list, _ := strings.Cut(string(data), "## Every problem the check reports")
	list, _, _ = strings.Cut(list, "\n## ")
	rule := func(fields string) string {
		return "rules:\n  - {name: a, destination: 10.0.0.1, " + fields + "}\n"
	}
	tests := []struct{ in, doc string }{
		{"rules: [\n", "YAML: …"},
		{"rules: []\n---\nrules: []\n", "a policy is one YAML document; this is a second"},
		{"- a\n", "a policy must be a mapping of rules, maxRules, metrics"},
		{"rules: 5\n", "rules must be a list"},
		{"rules: [5]\n", "a rule must be a mapping of name, destination, port, protocols, udpIdle, unit, cgroup, concurrency, perSecond, perWindow, adaptive, shadow, errno, shared"},
		{rule("concurrency: 1, shared: 5"), "shared must be a mapping of redis, key, failureMode, durability, lease, replicas"},
		{rule("perSecond: 5"), "perSecond must be a mapping of permits, burst"},
		{rule("perWindow: 5"), "perWindow must be a mapping of permits, window, segments"},
		{rule("adaptive: 5"), "adaptive must be a mapping of minimum, maximum, initial, multiple, decreaseFactor, probeEvery, probeFactor, maxHealthy, baseline, samples"},
		{rule("concurrency: 1, version: 2"), `unknown field "F"`},
		{rule("concurrency: 1, port: 80, port: 81"), "F is given twice; the first is at line N"},
		{rule("concurrency: 1, [a]: 1"), "field names must be strings"},
		{rule("concurrency: &c 1, port: *c"), "aliases (*NAME) are not supported; write the value out"},
		{rule("concurrency: 1, errno: 5"), "F must be a string"},
		{rule("concurrency: x"), "F must be a whole number"},
		{rule("concurrency: 99999999999999999999"), "F V is outside A..B"},
		{rule("adaptive: {multiple: x}"), "F must be a number"},
		{rule("concurrency: 1, shadow: yes"), "F must be true or false"},
		{rule("perWindow: {permits: 1, window: 5}"), "F must be a duration such as 30s or 1m"},
		{"maxRules: 0\n", "F 0 is not allowed; leave it out for the default"},
		{rule("adaptive: {maxHealthy: 0s}"), "adaptive.maxHealthy 0 is not allowed; leave it out for none"},
		{rule("adaptive: {baseline: 0s}"), "adaptive.baseline 0 is not allowed; leave it out for none"},
		{rule("adaptive: {maxHealthy: -1s}"), "F D must be positive"},
		{rule("concurrency: 1, unit: ''"), "unit is empty; leave it out for the whole host"},
		{rule("concurrency: 1, errno: ''"), "errno is empty; leave it out for EPERM"},
		{rule("concurrency: 1, shared: {redis: '', key: k}"), "shared.redis is empty: give the URL of the Redis server that keeps the budget"},
		{rule("concurrency: 1, shared: {redis: 'redis://r', key: k, durability: ''}"), "shared.durability is empty; leave it out for ephemeral"},
		{rule("adaptive: {samples: ''}"), "adaptive.samples is empty; leave it out for request"},
		{"maxRules: 2000000\n", "maxRules N is outside 1..1048576"},
		{"maxRules: 1\n" + rule("concurrency: 1") + "  - {name: b, destination: 10.0.0.2, concurrency: 1}\n", "N rules do not fit maxRules M"},
		{rule("concurrency: 1") + "  - {name: a, destination: 10.0.0.2, concurrency: 1}\n", "name N is already used by the rule at line L"},
		{rule("concurrency: 1, port: 0"), "port N is outside 1..65535; leave it out for any port"},
		{rule("concurrency: 0"), "concurrency must be at least 1"},
		{rule("perWindow: {permits: 1, window: 1m, segments: 33}"), "perWindow.segments N is outside 1..32"},
		{rule("adaptive: {probeEvery: -1}"), "adaptive.probeEvery N must be at least 0 (0: no probes, the reference loop)"},
		{rule("adaptive: {probeEvery: 5, baseline: 1ms}"), "adaptive: ProbeEvery N with a fixed Baseline: probes learn a baseline, and this one is given"},
		{rule("adaptive: {maxHealthy: 1ms, baseline: 2ms}"), "adaptive: MaxHealthy D must be above Baseline B: every normal call would decrease the limit"},
		{rule("adaptive: {samples: bogus}"), `adaptive.samples "S" is not connect or request`},
		{"metrics: 5\n", "metrics must be a mapping of rules"},
		{"metrics: {rules: a}\n", "metrics.rules must be a list of rule names or patterns"},
		{"metrics: {rules: ['']}\n", "metrics.rules has an empty name"},
		{"metrics: {rules: ['a[']}\n", `metrics.rules "P" is not a pattern: E`},
		{rule("concurrency: 1, shared: {}"), "shared.redis is missing: the URL of the Redis server that keeps the budget"},
		{rule("concurrency: 1, shared: {}"), "shared.key is missing: the Redis key every host sharing the budget names"},
		{rule("concurrency: 1, shared: {redis: 'redis://r', key: k, durability: lasting}"), `shared.durability "D" is not ephemeral or persistent`},
		{rule("concurrency: 1, shared: {redis: 'redis://r', key: k, replicas: 17}"), "shared.replicas N is not between 0 and 16"},
	}
	placeholder := regexp.MustCompile(`\b([A-Z]|NAME)\b|…`)
	for _, tt := range tests {
		if !strings.Contains(list, "`"+tt.doc+"`") {
			t.Errorf("docs/policy.md does not list `%s`", tt.doc)
		}
		want := regexp.MustCompile("^" + placeholder.ReplaceAllString(regexp.QuoteMeta(tt.doc), ".+") + "$")
		_, err := Parse([]byte(tt.in))
		e, _ := errors.AsType[*Error](err)
		if e == nil {
			t.Errorf("%q: %v, want a problem `%s`", tt.in, err, tt.doc)
			continue
		}
		found := false
		for _, p := range e.Problems {
			found = found || want.MatchString(p.Msg)
		}
		if !found {
			t.Errorf("%q: problems %s; want one `%s`", tt.in, dump(e.Problems), tt.doc)
		}
	}
}

// TestDocsMapFlags: docs/policy.md's table of limit set's flags gives
// each flag's field, as Fields does.
func TestDocsMapFlags(t *testing.T) {
	data, err := os.ReadFile("../../docs/policy.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range Fields() {
		if row := "| `--" + f.Flag + "` | `" + f.Path + "` |"; f.Flag != "" && !strings.Contains(string(data), row) {
			t.Errorf("docs/policy.md lacks the row %s", row)
		}
	}
}
