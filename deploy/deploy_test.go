// Package deploy holds what operators load next to egressd: Prometheus
// recording and alerting rules (prometheus/) and a Grafana dashboard
// (grafana/). Its tests run promtool on the rules and their unit tests,
// check every dashboard query's syntax with promtool, and hold every
// metric the rules and the dashboard query to the families the daemon's
// code defines.
package deploy

import (
	"bufio"
	"encoding/json"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"

	"github.com/egressd/egressd/internal/docstest"
)

const (
	rulesFile     = "prometheus/egressd-rules.yml"
	rulesTestFile = "prometheus/egressd-rules.test.yml"
	dashboardFile = "grafana/egressd-dashboard.json"
	daemonDir     = "../internal/daemon"
	metricsDoc    = "../docs/metrics.md"
)

func promtool(t *testing.T) string {
	t.Helper()
	p, err := exec.LookPath("promtool")
	if err != nil {
		t.Skip("skipping: promtool is not installed (Debian: apt-get install prometheus; make deps installs it)")
	}
	return p
}

func runPromtool(t *testing.T, dir string, args ...string) {
	t.Helper()
	cmd := exec.Command(promtool(t), args...)
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	t.Logf("promtool %s:\n%s", strings.Join(args, " "), out)
}

func TestRulesCheck(t *testing.T) {
	runPromtool(t, ".", "check", "rules", rulesFile)
}

func TestRulesUnitTests(t *testing.T) {
	runPromtool(t, "prometheus", "test", "rules", filepath.Base(rulesTestFile))
}

// ruleFile is the part of a Prometheus rule file the tests read.
type ruleFile struct {
	Groups []struct {
		Name  string `yaml:"name"`
		Rules []struct {
			Record string `yaml:"record"`
			Alert  string `yaml:"alert"`
			Expr   string `yaml:"expr"`
		} `yaml:"rules"`
	} `yaml:"groups"`
}

func readRules(t *testing.T) ruleFile {
	t.Helper()
	b, err := os.ReadFile(rulesFile)
	if err != nil {
		t.Fatal(err)
	}
	var rf ruleFile
	if err := yaml.Unmarshal(b, &rf); err != nil {
		t.Fatal(err)
	}
	return rf
}

// The alerts the issue asks for, by name: a test fails if one goes.
func TestAlertsPresent(t *testing.T) {
	var alerts, records []string
	for _, g := range readRules(t).Groups {
		for _, r := range g.Rules {
			if r.Alert != "" {
				alerts = append(alerts, r.Alert)
			} else {
				records = append(records, r.Record)
			}
		}
	}
	for _, want := range []string{"EgressdRuleRefusingMost", "EgressdSharedBudgetUnreachable", "EgressdRulePending", "EgressdEventsLost", "EgressdRecountDrift", "EgressdDownDatapathPinned"} {
		if !slices.Contains(alerts, want) {
			t.Errorf("no alert %s", want)
		}
	}
	for _, want := range []string{"rule:egressd_refusal:ratio_rate5m", "rule:egressd_limit_utilisation:ratio", "rule:egressd_rate_utilisation:ratio_rate1m"} {
		if !slices.Contains(records, want) {
			t.Errorf("no recording rule %s", want)
		}
	}
	docstest.Mentions(t, "../docs/prometheus-grafana.md", append(alerts, records...)...)
	// Every alert has a unit test in the test file.
	tests, err := os.ReadFile(rulesTestFile)
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range alerts {
		if !strings.Contains(string(tests), "alertname: "+a+"\n") {
			t.Errorf("alert %s has no test in %s", a, rulesTestFile)
		}
	}
}

// dashboard is the part of a Grafana dashboard the tests read.
type dashboard struct {
	UID        string  `json:"uid"`
	Panels     []panel `json:"panels"`
	Templating struct {
		List []struct {
			Name       string `json:"name"`
			Type       string `json:"type"`
			Definition string `json:"definition"`
		} `json:"list"`
	} `json:"templating"`
}

type panel struct {
	ID         int    `json:"id"`
	Type       string `json:"type"`
	Title      string `json:"title"`
	Datasource *struct {
		UID string `json:"uid"`
	} `json:"datasource"`
	GridPos *struct{ H, W, X, Y int } `json:"gridPos"`
	Targets []struct {
		Expr string `json:"expr"`
	} `json:"targets"`
}

func readDashboard(t *testing.T) dashboard {
	t.Helper()
	b, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	var d dashboard
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	return d
}

// dashboardQueries returns every PromQL query of the dashboard: panel
// targets and template variables' label_values() selectors.
func dashboardQueries(t *testing.T, d dashboard) []string {
	t.Helper()
	var out []string
	for _, p := range d.Panels {
		for _, tg := range p.Targets {
			out = append(out, tg.Expr)
		}
	}
	labelValues := regexp.MustCompile(`^label_values\((.*),\s*\w+\)$`)
	for _, v := range d.Templating.List {
		if v.Type != "query" {
			continue
		}
		m := labelValues.FindStringSubmatch(v.Definition)
		if m == nil {
			t.Fatalf("variable %s: %q is not label_values(selector, label)", v.Name, v.Definition)
		}
		out = append(out, m[1])
	}
	return out
}

// TestDashboardShape: each panel but the rows has a place, a query and
// the dashboard's Prometheus variable; ids are unique.
func TestDashboardShape(t *testing.T) {
	d := readDashboard(t)
	if d.UID == "" || len(d.Panels) == 0 {
		t.Fatal("no uid or no panels")
	}
	ids := map[int]bool{}
	for _, p := range d.Panels {
		if ids[p.ID] {
			t.Errorf("panel id %d used twice", p.ID)
		}
		ids[p.ID] = true
		if p.GridPos == nil || p.GridPos.W == 0 || p.GridPos.H == 0 {
			t.Errorf("panel %q has no place on the grid", p.Title)
		}
		if p.Type == "row" {
			continue
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q queries nothing", p.Title)
		}
		if p.Datasource == nil || p.Datasource.UID != "${datasource}" {
			t.Errorf("panel %q does not use the dashboard's Prometheus variable", p.Title)
		}
	}
	// What the issue asks the dashboard to show, by the metric showing it.
	all := strings.Join(dashboardQueries(t, d), "\n")
	for _, m := range []string{"egressd_limit", "egressd_live_connections", "egressd_in_flight_requests", "egressd_leases_total",
		"egressd_connect_latency_seconds_bucket", "egressd_request_latency_seconds_bucket", "egressd_baseline_latency_seconds",
		"egressd_shared_slots", "egressd_shared_granted_permits_total"} {
		if !strings.Contains(all, m) {
			t.Errorf("the dashboard does not show %s", m)
		}
	}
}

// TestDashboardQueriesParse has promtool parse every dashboard query, as
// the expression of a recording rule, with Grafana's variables replaced
// by values Prometheus would see.
func TestDashboardQueriesParse(t *testing.T) {
	p := promtool(t)
	vars := strings.NewReplacer("$__rate_interval", "1m", "$instance", ".*", "$rule", ".*")
	var b strings.Builder
	b.WriteString("groups:\n  - name: dashboard\n    rules:\n")
	for i, q := range dashboardQueries(t, readDashboard(t)) {
		b.WriteString("      - record: dashboard:query" + strconv.Itoa(i) + "\n        expr: " + strconv.Quote(vars.Replace(q)) + "\n")
	}
	file := filepath.Join(t.TempDir(), "dashboard-rules.yml")
	if err := os.WriteFile(file, []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(p, "check", "rules", file).CombinedOutput(); err != nil {
		t.Fatalf("a dashboard query does not parse: %v\n%s", err, out)
	}
}

// daemonFamilies returns the metric families the daemon's code defines
// (the names given to prometheus.NewDesc in internal/daemon), with their
// types as docs/metrics.md gives them. internal/daemon's TestMetricsLint
// holds the families it serves to the same names, and docs/metrics.md to
// documenting each.
func daemonFamilies(t *testing.T) map[string]string {
	t.Helper()
	entries, err := os.ReadDir(daemonDir)
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	families := map[string]string{}
	for _, e := range entries {
		if !strings.HasSuffix(e.Name(), ".go") || strings.HasSuffix(e.Name(), "_test.go") {
			continue
		}
		file, err := parser.ParseFile(fset, filepath.Join(daemonDir, e.Name()), nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		ast.Inspect(file, func(n ast.Node) bool {
			call, ok := n.(*ast.CallExpr)
			if !ok || len(call.Args) == 0 {
				return true
			}
			sel, ok := call.Fun.(*ast.SelectorExpr)
			if !ok || sel.Sel.Name != "NewDesc" {
				return true
			}
			if lit, ok := call.Args[0].(*ast.BasicLit); ok && lit.Kind == token.STRING {
				name, err := strconv.Unquote(lit.Value)
				if err == nil {
					families[name] = ""
				}
			}
			return true
		})
	}
	if _, ok := families["egressd_leases_total"]; !ok || len(families) < 10 {
		t.Fatalf("found %d families in %s (%v): the parse no longer finds the daemon's metrics", len(families), daemonDir, families)
	}
	f, err := os.Open(metricsDoc)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	row := regexp.MustCompile("^\\| `(egressd_[a-z0-9_]+)` \\| (counter|gauge|histogram) \\|")
	s := bufio.NewScanner(f)
	for s.Scan() {
		if m := row.FindStringSubmatch(s.Text()); m != nil {
			if _, ok := families[m[1]]; ok {
				families[m[1]] = m[2]
			}
		}
	}
	for name, typ := range families {
		if typ == "" {
			t.Errorf("%s gives no type for %s", metricsDoc, name)
		}
	}
	return families
}

// identifier is a PromQL metric or recording rule name.
var identifier = regexp.MustCompile(`[a-zA-Z_:][a-zA-Z0-9_:]*`)

// queried returns the daemon metric names (egressd_…) and recording rule
// names (with a colon) an expression reads.
func queried(expr string) (metrics, records []string) {
	// Label values and label matchers' strings are not names.
	expr = regexp.MustCompile(`"[^"]*"`).ReplaceAllString(expr, `""`)
	for _, id := range identifier.FindAllString(expr, -1) {
		switch {
		case strings.Contains(id, ":"):
			records = append(records, id)
		case strings.HasPrefix(id, "egressd_"):
			metrics = append(metrics, id)
		}
	}
	return metrics, records
}

// exported reports whether a series name is one the daemon serves: a
// family, or a histogram family's _bucket, _sum or _count.
func exported(families map[string]string, name string) bool {
	if _, ok := families[name]; ok {
		return true
	}
	for _, suffix := range []string{"_bucket", "_sum", "_count"} {
		if base, ok := strings.CutSuffix(name, suffix); ok && families[base] == "histogram" {
			return true
		}
	}
	return false
}

// TestQueriedMetricsAreExported: the rules and the dashboard query only
// what the daemon exports, and recording rules that exist.
func TestQueriedMetricsAreExported(t *testing.T) {
	families := daemonFamilies(t)
	rf := readRules(t)
	var defined []string
	type query struct{ where, expr string }
	var queries []query
	for _, g := range rf.Groups {
		for _, r := range g.Rules {
			if r.Record != "" {
				defined = append(defined, r.Record)
			}
			queries = append(queries, query{rulesFile + ": " + r.Record + r.Alert, r.Expr})
		}
	}
	for _, q := range dashboardQueries(t, readDashboard(t)) {
		queries = append(queries, query{dashboardFile, q})
	}
	seen := 0
	for _, q := range queries {
		metrics, records := queried(q.expr)
		seen += len(metrics)
		for _, m := range metrics {
			if !exported(families, m) {
				t.Errorf("%s queries %s, which the daemon does not export", q.where, m)
			}
		}
		for _, r := range records {
			if !slices.Contains(defined, r) {
				t.Errorf("%s queries %s, which no recording rule in %s defines", q.where, r, rulesFile)
			}
		}
	}
	if seen == 0 {
		t.Fatal("no metric found in any query: the extraction is broken")
	}
}

// TestQueriedFindsNames: the name extraction the check above relies on.
func TestQueriedFindsNames(t *testing.T) {
	m, r := queried(`sum by (rule) (rate(egressd_leases_total{outcome="egressd_not_a_metric"}[5m])) / rule:egressd_refusal:ratio_rate5m > on (rule) egressd_limit`)
	if !slices.Equal(m, []string{"egressd_leases_total", "egressd_limit"}) || !slices.Equal(r, []string{"rule:egressd_refusal:ratio_rate5m"}) {
		t.Errorf("metrics %q, records %q", m, r)
	}
	families := map[string]string{"egressd_connect_latency_seconds": "histogram", "egressd_limit": "gauge"}
	for name, want := range map[string]bool{
		"egressd_connect_latency_seconds_bucket": true,
		"egressd_limit":                          true,
		"egressd_limit_count":                    false,
		"egressd_made_up":                        false,
	} {
		if got := exported(families, name); got != want {
			t.Errorf("exported(%s) = %v, want %v", name, got, want)
		}
	}
}

// Modes a daemon's metrics come in: every rule with series of its own
// (no more rules than --metrics-rules), a few rules with series of their
// own and every rule in its class's sums (more), and the sums alone
// (--metrics-rules 0).
const (
	perRuleMode = "per-rule"
	boundedMode = "bounded"
	sumsMode    = "sums only"
)

// modeRule is a rule of the test host, and whether it has series of its
// own in the bounded mode.
type modeRule struct {
	name, shape       string
	requests, shared  bool
	rate, chosenBound bool
}

// modeRules are the test host's rules: one of each kind, and idle rules
// of their classes that only the per-rule mode shows one by one. In the
// bounded mode the chosen are one of each kind, as the busiest could be.
var modeRules = []modeRule{
	{name: "web", shape: "concurrency", chosenBound: true},
	{name: "api", shape: "perSecond", chosenBound: true},
	{name: "batch", shape: "perWindow", chosenBound: true},
	{name: "adapt", shape: "adaptive", requests: true, chosenBound: true},
	{name: "pool", shape: "concurrency", shared: true, chosenBound: true},
	{name: "prate", shape: "perSecond", shared: true, rate: true, chosenBound: true},
	{name: "idle1", shape: "concurrency"},
	{name: "idle2", shape: "perSecond"},
}

// modeSeries are the series a daemon serves in mode, as promtool input:
// each rule's when it has series of its own, each class's sums always,
// and the host's.
func modeSeries(mode string) []string {
	const at = `job="egressd",instance="h1:9464"`
	var out []string
	add := func(name, labels, values string) {
		out = append(out, fmt.Sprintf("      - series: '%s{%s%s}'\n        values: '%s'\n", name, at, labels, values))
	}
	counter, gauge, one := "0+60x30", "3x30", "1x30"
	type class struct{ shape, shared string }
	classes := map[class]bool{}
	perRule := 0
	for _, r := range modeRules {
		classes[class{r.shape, strconv.FormatBool(r.shared)}] = true
		if mode == sumsMode || mode == boundedMode && !r.chosenBound {
			continue
		}
		perRule++
		rule := fmt.Sprintf(`,rule="%s"`, r.name)
		for _, o := range []string{"acquired", "denied", "shadow_denied"} {
			add("egressd_leases_total", rule+`,outcome="`+o+`"`, counter)
		}
		for _, g := range []string{"egressd_live_connections", "egressd_in_flight_requests", "egressd_limit"} {
			add(g, rule, gauge)
		}
		add("egressd_connect_failures_total", rule, counter)
		add("egressd_rule_info", rule+`,shape="`+r.shape+`"`, one)
		add("egressd_recount_drift", rule, one)
		add("egressd_recount_released_total", rule+`,cause="drift"`, counter)
		histograms := []string{"egressd_connect_latency_seconds"}
		if r.requests {
			histograms = append(histograms, "egressd_request_latency_seconds")
		}
		for _, h := range histograms {
			for _, le := range []string{"0.001", "0.002", "+Inf"} {
				add(h+"_bucket", rule+`,le="`+le+`"`, counter)
			}
			add(h+"_sum", rule, "0+0.1x30")
			add(h+"_count", rule, counter)
		}
		switch {
		case r.shape == "perWindow":
			add("egressd_limit_window_seconds", rule, "60x30")
		case r.shape == "adaptive":
			add("egressd_baseline_latency_seconds", rule, "0.001x30")
		case r.rate:
			add("egressd_shared_granted_permits_total", rule, counter)
			add("egressd_shared_returned_permits_total", rule, "0+6x30")
		case r.shared:
			add("egressd_shared_slots", rule, gauge)
		}
		if r.shared {
			add("egressd_shared_store_up", rule, "0x30")
			add("egressd_shared_failure_mode_info", rule+`,mode="throw"`, one)
			add("egressd_shared_store_errors_total", rule, counter)
		}
	}
	for c := range classes {
		labels := fmt.Sprintf(`,shape="%s",scope="host",shared="%s",shadow="false"`, c.shape, c.shared)
		add("egressd_class_rules", labels+`,state="installed"`, gauge)
		for _, o := range []string{"acquired", "denied", "shadow_denied"} {
			add("egressd_class_leases_total", labels+`,outcome="`+o+`"`, counter)
		}
		add("egressd_class_live_connections", labels, gauge)
		add("egressd_class_in_flight_requests", labels, gauge)
		add("egressd_class_connect_failures_total", labels, counter)
		add("egressd_class_recount_released_total", labels+`,cause="drift"`, counter)
		add("egressd_class_recount_drifting_rules", labels, one)
		if c.shared == "true" {
			add("egressd_class_shared_unreachable_rules", labels, one)
		}
	}
	add("up", "", one)
	add("egressd_build_info", `,version="test",goversion="go"`, one)
	add("egressd_rules", `,state="installed"`, strconv.Itoa(len(modeRules))+"x30")
	add("egressd_rules", `,state="pending"`, "0x30")
	add("egressd_events_lost_total", `,kind="refusal"`, counter)
	add("egressd_per_rule_series_rules", `,reason="busiest"`, strconv.Itoa(perRule)+"x30")
	return out
}

// everyRuleRows are the dashboard's rows whose panels show every rule,
// whatever has series of its own.
var everyRuleRows = []string{"Host", "Classes (every rule)"}

// TestDashboardBothModes: in each mode, promtool finds data for every
// panel that can have some: those of every rule always, those of rules
// with series of their own in the per-rule and the bounded modes (the
// rule variable too), none of them relying on series of every rule.
func TestDashboardBothModes(t *testing.T) {
	p := promtool(t)
	d := readDashboard(t)
	vars := strings.NewReplacer("$__rate_interval", "1m", "$instance", ".*", "$rule", ".*")
	type query struct{ row, expr string }
	var queries []query
	row := ""
	for _, pn := range d.Panels {
		if pn.Type == "row" {
			row = pn.Title
			continue
		}
		for _, tg := range pn.Targets {
			queries = append(queries, query{row, tg.Expr})
		}
	}
	for _, q := range dashboardQueries(t, dashboard{Templating: d.Templating}) {
		queries = append(queries, query{"variables", q})
	}
	rules, err := filepath.Abs(rulesFile)
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "rule_files:\n  - %s\nevaluation_interval: 1m\ntests:\n", rules)
	for _, mode := range []string{perRuleMode, boundedMode, sumsMode} {
		fmt.Fprintf(&b, "  # %s\n  - interval: 1m\n    input_series:\n%s    promql_expr_test:\n", mode, strings.Join(modeSeries(mode), ""))
		for _, q := range queries {
			if mode == sumsMode && !slices.Contains(everyRuleRows, q.row) {
				continue
			}
			// absent() of a query with data is empty.
			fmt.Fprintf(&b, "      - expr: %s\n        eval_time: 10m\n        exp_samples: []\n", strconv.Quote("absent("+vars.Replace(q.expr)+")"))
		}
	}
	file := filepath.Join(t.TempDir(), "dashboard-modes.test.yml")
	if err := os.WriteFile(file, []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(p, "test", "rules", file).CombinedOutput(); err != nil {
		t.Fatalf("a dashboard query has no data in a mode (absent() gave a sample):\n%s", out)
	}
	if n := len(queries); n < 30 {
		t.Fatalf("%d queries found: the panels' walk is broken", n)
	}
}
