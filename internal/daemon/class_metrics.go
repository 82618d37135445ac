package daemon

import "github.com/prometheus/client_golang/prometheus"

// classDescs are the sums of the rules of each class: every rule is in
// them, whichever rules have series of their own. Counters are since the
// daemon started; a rule that leaves a class (removed, or changed) leaves
// what it counted in it.
type classDescs struct {
	rules, leases, live, inFlight, connectFailed *prometheus.Desc
	released, remarked, drifting, unreachable    *prometheus.Desc
}

// classLabels are a class's labels, in the order collect gives them.
var classLabels = []string{"shape", "scope", "shared", "shadow"}

func newClassDescs() classDescs {
	with := func(extra ...string) []string { return append(append([]string(nil), classLabels...), extra...) }
	return classDescs{
		rules:         prometheus.NewDesc("egressd_class_rules", "Rules of the class, by state: installed in the kernel or pending.", with("state"), nil),
		leases:        prometheus.NewDesc("egressd_class_leases_total", "Connections and UDP flows the class's rules were asked for, by outcome (as egressd_leases_total), since the daemon started.", with("outcome"), nil),
		live:          prometheus.NewDesc("egressd_class_live_connections", "Connections and UDP flows holding a slot of one of the class's rules now.", with(), nil),
		inFlight:      prometheus.NewDesc("egressd_class_in_flight_requests", "Requests sent and not yet answered on the connections of the class's rules.", with(), nil),
		connectFailed: prometheus.NewDesc("egressd_class_connect_failures_total", "Admitted connections of the class's rules that ended before reaching ESTABLISHED, since the daemon started.", with(), nil),
		released:      prometheus.NewDesc("egressd_class_recount_released_total", "Slots of the class's rules the recounts gave back, by cause (as egressd_recount_released_total).", with("cause"), nil),
		remarked:      prometheus.NewDesc("egressd_class_recount_remarked_total", "Sockets of the class's rules whose marks the recounts put back.", with(), nil),
		drifting:      prometheus.NewDesc("egressd_class_recount_drifting_rules", "Rules of the class whose last recount found drift (egressd_recount_drift not 0).", with(), nil),
		unreachable:   prometheus.NewDesc("egressd_class_shared_unreachable_rules", "Rules of a shared class whose Redis is out of reach now (egressd_shared_store_up 0).", with(), nil),
	}
}

func (c classDescs) describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.rules, c.leases, c.live, c.inFlight, c.connectFailed, c.released, c.remarked, c.drifting, c.unreachable} {
		ch <- d
	}
}

// collect reports the sums of the classes that have rules, as the last
// read took them.
func (c classDescs) collect(ch chan<- prometheus.Metric, totals *[classes]classTotals) {
	for i := range totals {
		tot, cl := &totals[i], class(i)
		if tot.installed+tot.pending == 0 {
			continue
		}
		labels := []string{cl.shape(), cl.scope(), boolLabel(cl.shared()), boolLabel(cl.shadow())}
		gauge := func(d *prometheus.Desc, x float64, extra ...string) {
			ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, x, append(labels, extra...)...)
		}
		counter := func(d *prometheus.Desc, i int, extra ...string) {
			ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(tot.counts[i]), append(labels, extra...)...)
		}
		gauge(c.rules, float64(tot.installed), "installed")
		gauge(c.rules, float64(tot.pending), "pending")
		counter(c.leases, countAdmitted, "acquired")
		counter(c.leases, countRefused, "denied")
		counter(c.leases, countShadowRefused, "shadow_denied")
		gauge(c.live, float64(tot.live))
		gauge(c.inFlight, float64(tot.inFlight))
		counter(c.connectFailed, countConnectFailed)
		counter(c.released, countReleasedDrift, "drift")
		counter(c.released, countReleasedFreed, "freed_socket")
		counter(c.remarked, countRemarked)
		gauge(c.drifting, float64(tot.drifting))
		if cl.shared() {
			gauge(c.unreachable, float64(tot.unreachable))
		}
	}
}

func boolLabel(b bool) string {
	if b {
		return "true"
	}
	return "false"
}
