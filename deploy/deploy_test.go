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
