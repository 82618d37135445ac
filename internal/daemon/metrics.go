package daemon

import (
	"errors"
	"log/slog"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/egressd/egressd/pkg/adaptive"
	"github.com/egressd/egressd/pkg/kernelrule"
	"github.com/egressd/egressd/pkg/loader"
)

// metrics is a Collector that reads the kernel's counters at scrape time,
// so a scrape always sees the maps as they are. A map that cannot be read
// yields no samples rather than wrong ones. Every rule is in the sums of
// its class (egressd_class_*); at most maxRules rules have series of
// their own (tracker.go says which).
type metrics struct {
	cfg   *Config
	log   *slog.Logger
	dp    datapath
	table *table
	// maxRules is how many rules get series of their own; 0 none.
	maxRules int

	reloadsOK, reloadsFailed atomic.Uint64
	// mu makes reads of every rule one at a time, and guards what they
	// remember: t, and what the log last said of the choice.
	mu      sync.Mutex
	t       *tracker
	said    said
	classes classDescs

	leases, live, inFlight, connectFailed, limit, baseline *prometheus.Desc
	connectLatency, requestLatency                         *prometheus.Desc
	lost, driftDesc, reloads, buildInfo, rules             *prometheus.Desc
	released, remarked                                     *prometheus.Desc
	loadOK, perRuleMax, perRule                            *prometheus.Desc
	shares                                                 shareDescs
	probing, settled, probes                               *prometheus.Desc
	ruleInfo, window                                       *prometheus.Desc
}

func newMetrics(cfg *Config, t *table, maxRules int, log *slog.Logger) *metrics {
	rule := []string{"rule"}
	return &metrics{
		cfg:            cfg,
		log:            log,
		table:          t,
		maxRules:       maxRules,
		t:              newTracker(),
		classes:        newClassDescs(),
		leases:         prometheus.NewDesc("egressd_leases_total", "Connections and UDP flows asked for, by outcome: acquired, denied (refused) or shadow_denied (would have been refused; admitted in shadow mode).", []string{"rule", "outcome"}, nil),
		live:           prometheus.NewDesc("egressd_live_connections", "Connections and UDP flows holding a slot of the rule now.", rule, nil),
		inFlight:       prometheus.NewDesc("egressd_in_flight_requests", "Requests sent and not yet answered on the rule's connections (rules that track requests).", rule, nil),
		connectFailed:  prometheus.NewDesc("egressd_connect_failures_total", "Admitted connections that ended before reaching ESTABLISHED.", rule, nil),
		limit:          prometheus.NewDesc("egressd_limit", "The limit in force: live connections, permits per second or permits per window; an adaptive rule's current limit.", rule, nil),
		baseline:       prometheus.NewDesc("egressd_baseline_latency_seconds", "An adaptive rule's baseline latency: the 10th percentile of the calls of its drain probes, or with probeEvery 0 (and before the first probe) of the last five minutes of calls.", rule, nil),
		probing:        prometheus.NewDesc("egressd_adaptive_probing", "1 while a drain probe holds an adaptive rule's limit down, 0 otherwise.", rule, nil),
		settled:        prometheus.NewDesc("egressd_adaptive_settled_limit", "The limit an adaptive rule's loop settled on: egressd_limit outside drain probes, and during one the limit it restores.", rule, nil),
		probes:         prometheus.NewDesc("egressd_adaptive_probes_total", "Drain probes an adaptive rule's loop ended.", rule, nil),
		connectLatency: prometheus.NewDesc("egressd_connect_latency_seconds", "Time from the first SYN connect() sends to ESTABLISHED.", rule, nil),
		requestLatency: prometheus.NewDesc("egressd_request_latency_seconds", "Time from a request's first outbound payload to the next inbound payload.", rule, nil),
		lost:           prometheus.NewDesc("egressd_events_lost_total", "Events that never reached the daemon, by kind: refusal records the kernel overwrote before the daemon read them, latency samples dropped because the ring buffer was full.", []string{"kind"}, nil),
		driftDesc:      prometheus.NewDesc("egressd_recount_drift", "How far the live sockets' states counted at the last recount fall outside what the kernel's live count and the connections opened and closed during the walk allow; a positive drift is given back by the next recount that sees it too, so nonzero for long means accounting the recount cannot repair.", rule, nil),
		released:       prometheus.NewDesc("egressd_recount_released_total", "Slots the recounts gave back, by cause: freed_socket (held by a socket freed without giving it back) or drift (counted by the kernel and held by no socket at two recounts in a row).", []string{"rule", "cause"}, nil),
		remarked:       prometheus.NewDesc("egressd_recount_remarked_total", "Sockets holding a slot whose marks another program had taken off, put back by the recounts.", rule, nil),
		reloads:        prometheus.NewDesc("egressd_policy_reloads_total", "Policy loads, by outcome.", []string{"outcome"}, nil),
		loadOK:         prometheus.NewDesc("egressd_policy_last_load_ok", "1 when the last load of the policy file (the start's or a reload) was applied whole; 0 when it was refused and the rules before it stay, or the run-time limits conflicted with it at start (until a run-time change puts them in force).", nil, nil),
		buildInfo:      prometheus.NewDesc("egressd_build_info", "Always 1; labels say which build runs.", []string{"version", "goversion"}, nil),
		rules:          prometheus.NewDesc("egressd_rules", "Rules by state: installed in the kernel or pending (unit not running, host name not resolved).", []string{"state"}, nil),
		perRuleMax:     prometheus.NewDesc("egressd_per_rule_series_max_rules", "The most rules the metrics serve series of their own for (egressd run --metrics-rules); every rule is in the egressd_class_* sums.", nil, nil),
		perRule:        prometheus.NewDesc("egressd_per_rule_series_rules", "Rules with series of their own in this scrape, by why: all (there are no more rules than the bound), named (by the policy's metrics.rules), trouble (drift at the last recount, or a shared budget's Redis out of reach) or busiest (refusals a second lately, then live connections).", []string{"reason"}, nil),
		ruleInfo:       prometheus.NewDesc("egressd_rule_info", "Always 1; shape says what egressd_limit counts: concurrency, adaptive, perSecond or perWindow, as in the policy; protocols what the rule counts: tcp, udp or tcp,udp.", []string{"rule", "shape", "protocols"}, nil),
		window:         prometheus.NewDesc("egressd_limit_window_seconds", "The window a perWindow rule's egressd_limit is per.", rule, nil),
		shares:         newShareDescs(),
	}
}

func (m *metrics) reloaded(ok bool) {
	if ok {
		m.reloadsOK.Add(1)
	} else {
		m.reloadsFailed.Add(1)
	}
}

// recorded keeps what a recount found: each rule's drift, and what it
// gave back and put back.
func (m *metrics) recorded(rc map[string]loader.Recount) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.t.recorded(rc)
}

func (m *metrics) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{m.leases, m.live, m.inFlight, m.connectFailed, m.limit, m.baseline, m.connectLatency, m.requestLatency, m.lost, m.driftDesc, m.released, m.remarked, m.reloads, m.loadOK, m.buildInfo, m.rules,
		m.perRuleMax, m.perRule, m.probing, m.settled, m.probes, m.ruleInfo, m.window} {
		ch <- d
	}
	m.classes.describe(ch)
	m.shares.describe(ch)
}

func (m *metrics) Collect(ch chan<- prometheus.Metric) {
	ch <- prometheus.MustNewConstMetric(m.buildInfo, prometheus.GaugeValue, 1, m.cfg.Version, runtime.Version())
	ch <- prometheus.MustNewConstMetric(m.reloads, prometheus.CounterValue, float64(m.reloadsOK.Load()), "success")
	ch <- prometheus.MustNewConstMetric(m.reloads, prometheus.CounterValue, float64(m.reloadsFailed.Load()), "failure")
	ch <- prometheus.MustNewConstMetric(m.perRuleMax, prometheus.GaugeValue, float64(m.maxRules))
	if lost, err := m.dp.Lost(); err == nil {
		ch <- prometheus.MustNewConstMetric(m.lost, prometheus.CounterValue, float64(lost.Refusals), "refusal")
		ch <- prometheus.MustNewConstMetric(m.lost, prometheus.CounterValue, float64(lost.Samples), "sample")
	}
	var chosen []string
	var recounts map[string]recountView
	table, err := m.read(func(t *tracker) {
		var why [whyLen]int
		chosen, why = choose(t.candidates(), t.rulesRead(), m.maxRules)
		t.chose(chosen)
		recounts = t.recountViews(chosen)
		for i, n := range why {
			ch <- prometheus.MustNewConstMetric(m.perRule, prometheus.GaugeValue, float64(n), whyNames[i])
		}
		m.classes.collect(ch, &t.totals)
		m.say(t, why)
	})
	ch <- prometheus.MustNewConstMetric(m.rules, prometheus.GaugeValue, float64(table.installed), "installed")
	ch <- prometheus.MustNewConstMetric(m.rules, prometheus.GaugeValue, float64(table.pending), "pending")
	ch <- prometheus.MustNewConstMetric(m.loadOK, prometheus.GaugeValue, bit(table.loadOK))
	if err != nil {
		m.log.Error("metrics: read counters", "err", err)
		return
	}
	t := m.table.viewChosen(chosen)
	m.collectLoops(ch, t.loops)
	for name, v := range t.shares {
		m.shares.collect(ch, name, v)
	}
	status, err := chosenStatus(m.dp, t.installed, table.installed)
	if err != nil {
		m.log.Error("metrics: read counters", "err", err)
		return
	}
	m.collectKernel(ch, status, t, recounts)
}

// tableCounts is what a read found of the table as a whole.
type tableCounts struct {
	installed, pending int
	// loadOK is whether the last load of the policy file was applied
	// whole, as status says.
	loadOK bool
}

// read reads every rule's counts into the tracker, the table's rules
// under the table's lock and then the kernel's without it, and calls fn
// with the tracker, whose lock it holds. It reports what it found of the
// table even when the kernel cannot be read (then fn is not called).
func (m *metrics) read(fn func(t *tracker)) (tableCounts, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	t := m.t
	tc := m.table.census(t, time.Now())
	i := 0
	err := m.dp.Counts(func(r *loader.Rule, s *loader.Stats) {
		t.count(i, r.Name, s)
		i++
	})
	if err != nil {
		return tc, err
	}
	t.end()
	fn(t)
	return tc, nil
}

// said is what the log said last of the choice of rules with series of
// their own.
type said struct {
	bounded, overNamed bool
}

// say logs when the choice of rules with series of their own starts or
// stops leaving rules out, and when the policy names more rules than the
// bound.
func (m *metrics) say(t *tracker, why [whyLen]int) {
	n := t.rulesRead()
	now := said{bounded: why[whyAll] < n, overNamed: t.named > m.maxRules}
	if now.bounded != m.said.bounded {
		switch {
		case now.bounded && m.maxRules == 0:
			m.log.Info("metrics: no rule has series of its own (--metrics-rules 0); every rule is in its class's sums (egressd_class_*)", "rules", n)
		case now.bounded:
			m.log.Warn("metrics: more rules than --metrics-rules; the rest are only in their classes' sums (egressd_class_*)",
				"rules", n, "metrics_rules", m.maxRules, "named", why[whyNamed], "trouble", why[whyTrouble], "busiest", why[whyBusiest])
		default:
			m.log.Info("metrics: every rule has series of its own again", "rules", n, "metrics_rules", m.maxRules)
		}
	}
	if now.overNamed && !m.said.overNamed {
		m.log.Warn("metrics: the policy's metrics.rules names more rules than --metrics-rules; some have no series of their own",
			"named", t.named, "metrics_rules", m.maxRules)
	}
	m.said = now
}

// tableView is what the series of the chosen rules need of the rule
// table, copied under its lock.
type tableView struct {
	// installed are the chosen rules in the kernel.
	installed []string
	loops     map[string]*adaptive.Controller
	shares    map[string]shareView
	// rates are shared rates' rules as the policy gives them (sharedRate).
	rates map[string]*loader.Rule
}

// viewChosen is what the series of the chosen rules need of the table.
func (t *table) viewChosen(chosen []string) tableView {
	t.mu.Lock()
	defer t.mu.Unlock()
	v := tableView{loops: map[string]*adaptive.Controller{}, shares: map[string]shareView{}, rates: map[string]*loader.Rule{}}
	for _, name := range chosen {
		e, ok := t.entries[name]
		if !ok {
			continue
		}
		if e.share != nil {
			v.shares[name] = e.share.view()
		}
		if !e.installed() {
			continue
		}
		v.installed = append(v.installed, name)
		if e.ctrl != nil {
			v.loops[name] = e.ctrl
		}
		if r := e.sharedRate(); r != nil {
			v.rates[name] = r
		}
	}
	return v
}

// census starts tr's read of every rule's counts at now with the table's
// rules, in its order: each rule's class, and whether it is installed or
// in trouble (its Redis unreachable). It returns what it found of the
// table as a whole.
func (t *table) census(tr *tracker, now time.Time) tableCounts {
	t.mu.Lock()
	defer t.mu.Unlock()
	tr.begin(now, len(t.order))
	tc := tableCounts{loadOK: t.reload.OK}
	if t.policy != nil {
		tr.name(t.policy.MetricsRules)
	}
	for i, e := range t.order {
		unreachable := e.share != nil && e.share.view().outage.Failing()
		tr.classify(i, e.spec.Name, classOf(e), e.installed(), unreachable)
		if e.installed() {
			tc.installed++
		} else {
			tc.pending++
		}
	}
	return tc
}

// chosenStatus reads the counters and latency histograms of the rules
// named (sorted), of installed in the kernel: one by one, or all at once
// with Status when they are a quarter of them or more, which then costs
// less.
func chosenStatus(dp datapath, names []string, installed int) ([]loader.RuleStatus, error) {
	if len(names) == 0 {
		return nil, nil
	}
	if len(names)*4 >= installed {
		all, err := dp.Status()
		if err != nil {
			return nil, err
		}
		want := make(map[string]bool, len(names))
		for _, n := range names {
			want[n] = true
		}
		out := slices.DeleteFunc(all, func(s loader.RuleStatus) bool { return !want[s.Name] })
		slices.SortFunc(out, func(a, b loader.RuleStatus) int { return strings.Compare(a.Name, b.Name) })
		return out, nil
	}
	out := make([]loader.RuleStatus, 0, len(names))
	for _, name := range names {
		r, err := dp.Rule(name)
		if errors.Is(err, loader.ErrUnknownRule) {
			continue // removed since the table was read
		}
		if err != nil {
			return nil, err
		}
		st, err := dp.Stats(name)
		if errors.Is(err, loader.ErrUnknownRule) {
			continue
		}
		if err != nil {
			return nil, err
		}
		out = append(out, loader.RuleStatus{Rule: r, Stats: st})
	}
	return out, nil
}

// collectLoops reports the adaptive loops. It runs outside the table's
// lock: State takes the loop's, which OnChange holds while it takes the
// table's.
func (m *metrics) collectLoops(ch chan<- prometheus.Metric, loops map[string]*adaptive.Controller) {
	for name, c := range loops {
		st := c.State()
		if st.Baseline > 0 {
			ch <- prometheus.MustNewConstMetric(m.baseline, prometheus.GaugeValue, st.Baseline.Seconds(), name)
		}
		ch <- prometheus.MustNewConstMetric(m.probing, prometheus.GaugeValue, bit(st.Probing), name)
		ch <- prometheus.MustNewConstMetric(m.settled, prometheus.GaugeValue, float64(st.Settled), name)
		ch <- prometheus.MustNewConstMetric(m.probes, prometheus.CounterValue, float64(st.Probes), name)
	}
}

// recountView is what the recounts found of a rule, for its series.
type recountView struct {
	counts        counters
	drift         int64
	driftRecorded bool
}

// recountViews are the recounts' findings of the rules named.
func (t *tracker) recountViews(names []string) map[string]recountView {
	out := make(map[string]recountView, len(names))
	for _, name := range names {
		if r := t.rules[name]; r != nil {
			v := recountView{counts: r.last}
			v.drift, v.driftRecorded = t.driftOf(r)
			out[name] = v
		}
	}
	return out
}

// collectKernel reports the kernel's counters of the rules in status,
// sorted by name. Each family goes out in the order the registry sorts it
// to (label values in label name order), which its sort then finds done.
func (m *metrics) collectKernel(ch chan<- prometheus.Metric, status []loader.RuleStatus, t tableView, recounts map[string]recountView) {
	each := func(f func(s *loader.RuleStatus)) {
		for i := range status {
			f(&status[i])
		}
	}
	for _, o := range []struct {
		outcome string
		n       func(*loader.Stats) uint64
	}{
		{"acquired", func(st *loader.Stats) uint64 { return st.Admitted }},
		{"denied", func(st *loader.Stats) uint64 { return st.Refused }},
		{"shadow_denied", func(st *loader.Stats) uint64 { return st.ShadowRefused }},
	} {
		each(func(s *loader.RuleStatus) {
			ch <- prometheus.MustNewConstMetric(m.leases, prometheus.CounterValue, float64(o.n(&s.Stats)), s.Name, o.outcome)
		})
	}
	each(func(s *loader.RuleStatus) {
		ch <- prometheus.MustNewConstMetric(m.live, prometheus.GaugeValue, float64(s.Stats.Live), s.Name)
	})
	each(func(s *loader.RuleStatus) {
		ch <- prometheus.MustNewConstMetric(m.inFlight, prometheus.GaugeValue, float64(s.Stats.InFlight), s.Name)
	})
	each(func(s *loader.RuleStatus) {
		ch <- prometheus.MustNewConstMetric(m.connectFailed, prometheus.CounterValue, float64(s.Stats.ConnectFailed), s.Name)
	})
	m.collectLimits(ch, status, t)
	each(func(s *loader.RuleStatus) {
		if rc := recounts[s.Name]; rc.driftRecorded {
			ch <- prometheus.MustNewConstMetric(m.driftDesc, prometheus.GaugeValue, float64(rc.drift), s.Name)
		}
	})
	for _, cause := range []struct {
		name  string
		count int
	}{
		{"drift", countReleasedDrift},
		{"freed_socket", countReleasedFreed},
	} {
		each(func(s *loader.RuleStatus) {
			ch <- prometheus.MustNewConstMetric(m.released, prometheus.CounterValue, float64(recounts[s.Name].counts[cause.count]), s.Name, cause.name)
		})
	}
	each(func(s *loader.RuleStatus) {
		ch <- prometheus.MustNewConstMetric(m.remarked, prometheus.CounterValue, float64(recounts[s.Name].counts[countRemarked]), s.Name)
	})
	each(func(s *loader.RuleStatus) { ch <- histogram(m.connectLatency, s.Stats.ConnectLatency, s.Name) })
	// 31 series that stay empty for a rule that tracks no requests.
	each(func(s *loader.RuleStatus) {
		if s.Requests {
			ch <- histogram(m.requestLatency, s.Stats.RequestLatency, s.Name)
		}
	})
}

// collectLimits reports each rule's limit and what it counts, as the
// policy asks them where the kernel's rule says otherwise: a shared
// rate's kernel rule grants permits. Families go out sorted, as
// collectKernel's.
func (m *metrics) collectLimits(ch chan<- prometheus.Metric, status []loader.RuleStatus, t tableView) {
	asked := func(s *loader.RuleStatus) *loader.Rule {
		if r, ok := t.rates[s.Name]; ok {
			return r
		}
		return &s.Rule
	}
	for i := range status {
		ch <- prometheus.MustNewConstMetric(m.limit, prometheus.GaugeValue, float64(asked(&status[i]).Limit), status[i].Name)
	}
	for i := range status {
		shape := policyShapes[asked(&status[i]).Shape]
		if _, ok := t.loops[status[i].Name]; ok {
			shape = "adaptive"
		}
		ch <- prometheus.MustNewConstMetric(m.ruleInfo, prometheus.GaugeValue, 1, status[i].Name, shape, status[i].Protocols.String())
	}
	for i := range status {
		if r := asked(&status[i]); r.Shape == loader.ShapePerWindow {
			ch <- prometheus.MustNewConstMetric(m.window, prometheus.GaugeValue, r.Window.Seconds(), status[i].Name)
		}
	}
}

// policyShapes names kernel shapes as the policy does. A rule of the
// policy is never granted: that is a shared rate's kernel rule.
var policyShapes = [kernelrule.ShapeLen]string{
	loader.ShapeConcurrency: "concurrency",
	loader.ShapePerSecond:   "perSecond",
	loader.ShapePerWindow:   "perWindow",
	loader.ShapeGranted:     "granted",
}

// histogram turns the kernel's power-of-two microsecond buckets into a
// Prometheus histogram in seconds.
func histogram(desc *prometheus.Desc, h loader.Histogram, rule string) prometheus.Metric {
	buckets := make(map[float64]uint64, loader.HistogramBuckets-1)
	var cum uint64
	for i := range loader.HistogramBuckets - 1 {
		cum += h.Buckets[i]
		buckets[loader.UpperBound(i).Seconds()] = cum
	}
	return prometheus.MustNewConstHistogram(desc, h.Count, h.Sum.Seconds(), buckets, rule)
}
