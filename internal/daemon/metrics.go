package daemon

import (
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/egressd/egressd/pkg/adaptive"
	"github.com/egressd/egressd/pkg/kernelrule"
	"github.com/egressd/egressd/pkg/loader"
)

// metrics is a Collector that reads the kernel's counters at scrape time,
// so a scrape always sees the maps as they are and the daemon keeps no
// copy. A map that cannot be read yields no samples rather than wrong ones.
type metrics struct {
	d *Daemon

	reloadsOK, reloadsFailed atomic.Uint64
	// recountMu guards what recounts found: each rule's drift at the
	// last, and what all gave back and put back since the start.
	recountMu sync.Mutex
	drift     map[string]int64
	recounted map[string]recounted

	leases, live, inFlight, connectFailed, limit, baseline *prometheus.Desc
	connectLatency, requestLatency                         *prometheus.Desc
	lost, driftDesc, reloads, buildInfo, rules             *prometheus.Desc
	released, remarked                                     *prometheus.Desc
	loadOK                                                 *prometheus.Desc
	shares                                                 shareDescs
	probing, settled, probes                               *prometheus.Desc
	ruleInfo, window                                       *prometheus.Desc
}

func newMetrics(d *Daemon) *metrics {
	rule := []string{"rule"}
	return &metrics{
		d:              d,
		drift:          map[string]int64{},
		recounted:      map[string]recounted{},
		leases:         prometheus.NewDesc("egressd_leases_total", "Connections asked for, by outcome: acquired, denied (refused) or shadow_denied (would have been refused; admitted in shadow mode).", []string{"rule", "outcome"}, nil),
		live:           prometheus.NewDesc("egressd_live_connections", "Connections holding a slot of the rule now.", rule, nil),
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

// recounted is what the recounts did for a rule since the daemon started.
type recounted struct {
	freed, givenBack, remarked uint64
}

// recorded keeps a recount's drift for the next scrape, and adds what it
// gave back and put back to the rules' counts.
func (m *metrics) recorded(rc map[string]loader.Recount) {
	drift := make(map[string]int64, len(rc))
	m.recountMu.Lock()
	defer m.recountMu.Unlock()
	for name, r := range rc {
		drift[name] = r.Drift()
		c := m.recounted[name]
		c.freed += uint64(r.Freed)
		c.givenBack += uint64(r.GivenBack)
		c.remarked += uint64(r.Remarked)
		m.recounted[name] = c
	}
	m.drift = drift
}

func (m *metrics) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{m.leases, m.live, m.inFlight, m.connectFailed, m.limit, m.baseline, m.connectLatency, m.requestLatency, m.lost, m.driftDesc, m.released, m.remarked, m.reloads, m.loadOK, m.buildInfo, m.rules,
		m.probing, m.settled, m.probes, m.ruleInfo, m.window} {
		ch <- d
	}
	m.shares.describe(ch)
}

func (m *metrics) Collect(ch chan<- prometheus.Metric) {
	ch <- prometheus.MustNewConstMetric(m.buildInfo, prometheus.GaugeValue, 1, m.d.cfg.Version, runtime.Version())
	ch <- prometheus.MustNewConstMetric(m.reloads, prometheus.CounterValue, float64(m.reloadsOK.Load()), "success")
	ch <- prometheus.MustNewConstMetric(m.reloads, prometheus.CounterValue, float64(m.reloadsFailed.Load()), "failure")
	if lost, err := m.d.dp.Lost(); err == nil {
		ch <- prometheus.MustNewConstMetric(m.lost, prometheus.CounterValue, float64(lost.Refusals), "refusal")
		ch <- prometheus.MustNewConstMetric(m.lost, prometheus.CounterValue, float64(lost.Samples), "sample")
	}
	t := m.d.tableView()
	ch <- prometheus.MustNewConstMetric(m.rules, prometheus.GaugeValue, float64(t.installed), "installed")
	ch <- prometheus.MustNewConstMetric(m.rules, prometheus.GaugeValue, float64(t.pending), "pending")
	loadOK := 0.0
	if t.loadOK {
		loadOK = 1
	}
	ch <- prometheus.MustNewConstMetric(m.loadOK, prometheus.GaugeValue, loadOK)
	m.collectLoops(ch, t.loops)
	for name, v := range t.shares {
		m.shares.collect(ch, name, v)
	}
	m.collectKernel(ch, t)
}

// tableView is what the metrics read of the rule table, copied under its
// lock.
type tableView struct {
	installed, pending int
	// loadOK is whether the last load of the policy file was applied
	// whole, as status says.
	loadOK bool
	loops  map[string]*adaptive.Controller
	shares map[string]shareView
	// rates are shared rates' rules as the policy gives them (sharedRate).
	rates map[string]*loader.Rule
}

func (d *Daemon) tableView() tableView {
	d.mu.Lock()
	defer d.mu.Unlock()
	t := tableView{loadOK: d.reload.OK, loops: map[string]*adaptive.Controller{}, shares: map[string]shareView{}, rates: map[string]*loader.Rule{}}
	for name, e := range d.entries {
		if e.share != nil {
			t.shares[name] = e.share.view()
		}
		if !e.installed() {
			t.pending++
			continue
		}
		t.installed++
		if e.ctrl != nil {
			t.loops[name] = e.ctrl
		}
		if r := e.sharedRate(); r != nil {
			t.rates[name] = r
		}
	}
	return t
}

// collectLoops reports the adaptive loops. It runs outside the daemon's
// lock: State takes the loop's, which OnChange holds while it takes the
// daemon's.
func (m *metrics) collectLoops(ch chan<- prometheus.Metric, loops map[string]*adaptive.Controller) {
	for name, c := range loops {
		st := c.State()
		if st.Baseline > 0 {
			ch <- prometheus.MustNewConstMetric(m.baseline, prometheus.GaugeValue, st.Baseline.Seconds(), name)
		}
		probing := 0.0
		if st.Probing {
			probing = 1
		}
		ch <- prometheus.MustNewConstMetric(m.probing, prometheus.GaugeValue, probing, name)
		ch <- prometheus.MustNewConstMetric(m.settled, prometheus.GaugeValue, float64(st.Settled), name)
		ch <- prometheus.MustNewConstMetric(m.probes, prometheus.CounterValue, float64(st.Probes), name)
	}
}

// collectKernel reports the kernel's counters of every rule. Each family
// goes out in the order the registry sorts it to (label values in label
// name order), which its sort then finds done: with 100,000 rules that
// sort was a second a scrape.
func (m *metrics) collectKernel(ch chan<- prometheus.Metric, t tableView) {
	status, err := m.d.dp.Status()
	if err != nil {
		m.d.log.Error("metrics: read counters", "err", err)
		return
	}
	slices.SortFunc(status, func(a, b loader.RuleStatus) int { return strings.Compare(a.Name, b.Name) })
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
	// The last recount may have counted rules removed since: per-rule
	// series are the kernel's rules'.
	m.recountMu.Lock()
	each(func(s *loader.RuleStatus) {
		if drift, ok := m.drift[s.Name]; ok {
			ch <- prometheus.MustNewConstMetric(m.driftDesc, prometheus.GaugeValue, float64(drift), s.Name)
		}
	})
	for _, cause := range []struct {
		name string
		n    func(recounted) uint64
	}{
		{"drift", func(c recounted) uint64 { return c.givenBack }},
		{"freed_socket", func(c recounted) uint64 { return c.freed }},
	} {
		each(func(s *loader.RuleStatus) {
			ch <- prometheus.MustNewConstMetric(m.released, prometheus.CounterValue, float64(cause.n(m.recounted[s.Name])), s.Name, cause.name)
		})
	}
	each(func(s *loader.RuleStatus) {
		ch <- prometheus.MustNewConstMetric(m.remarked, prometheus.CounterValue, float64(m.recounted[s.Name].remarked), s.Name)
	})
	m.recountMu.Unlock()
	each(func(s *loader.RuleStatus) { ch <- histogram(m.connectLatency, s.Stats.ConnectLatency, s.Name) })
	// 31 series that stay empty for a rule that tracks no requests:
	// with 100,000 rules, 3.1 million of them, 200 MB a scrape.
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
