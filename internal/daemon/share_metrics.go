package daemon

import (
	"github.com/prometheus/client_golang/prometheus"
)

// shareDescs are the metrics of shared budgets, one sample per shared rule
// (those of the other shape's omitted).
type shareDescs struct {
	slots, fair, granted, returned, unconfirmed  *prometheus.Desc
	up, mode, errors, frozen, expired, stateLost *prometheus.Desc
	unconfirmedGrowth                            *prometheus.Desc
}

func newShareDescs() shareDescs {
	rule := []string{"rule"}
	return shareDescs{
		slots:             prometheus.NewDesc("egressd_shared_slots", "Slots of a shared concurrency budget this host holds in Redis.", rule, nil),
		fair:              prometheus.NewDesc("egressd_shared_fair_share_slots", "This host's fair share of a shared concurrency budget, as Redis last computed it from every host's demand.", rule, nil),
		granted:           prometheus.NewDesc("egressd_shared_granted_permits_total", "Permits of a shared rate this host claimed from Redis and granted to the kernel.", rule, nil),
		returned:          prometheus.NewDesc("egressd_shared_returned_permits_total", "Permits of a shared rate this host handed back to Redis unspent.", rule, nil),
		unconfirmed:       prometheus.NewDesc("egressd_shared_unconfirmed_permits_total", "Permits of a shared rate claimed but never granted to the kernel, because Redis replicas did not confirm the claim in time.", rule, nil),
		up:                prometheus.NewDesc("egressd_shared_store_up", "1 while the Redis server keeping a shared budget answers, 0 while the rule's failure mode is in force.", rule, nil),
		mode:              prometheus.NewDesc("egressd_shared_failure_mode_info", "The failure mode a shared rule applies while Redis is unreachable: 1 for the configured mode (throw, allow or deny).", []string{"rule", "mode"}, nil),
		errors:            prometheus.NewDesc("egressd_shared_store_errors_total", "Redis calls for a shared budget that failed.", rule, nil),
		frozen:            prometheus.NewDesc("egressd_shared_frozen", "1 while a shared concurrency budget's growth is frozen because Redis lost its state (or saw it first, when ephemeral): hosts only take back what their kernels hold.", rule, nil),
		expired:           prometheus.NewDesc("egressd_shared_expired", "1 while Redis has been unreachable so long that this host's slots may have expired there: its kernel admits nothing new on them.", rule, nil),
		unconfirmedGrowth: prometheus.NewDesc("egressd_shared_unconfirmed_growths_total", "Times a shared concurrency share's growth was left unused because Redis replicas did not confirm it in time.", rule, nil),
		stateLost:         prometheus.NewDesc("egressd_shared_state_lost_total", "Times Redis answered with a new epoch for a shared concurrency budget: it had lost the budget's state.", rule, nil),
	}
}

func (s shareDescs) describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{s.slots, s.fair, s.granted, s.returned, s.unconfirmed, s.up, s.mode, s.errors, s.frozen, s.expired, s.stateLost, s.unconfirmedGrowth} {
		ch <- d
	}
}

func (s shareDescs) collect(ch chan<- prometheus.Metric, name string, v shareView) {
	gauge := func(d *prometheus.Desc, x float64) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, x, name)
	}
	counter := func(d *prometheus.Desc, x uint64) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(x), name)
	}
	if v.rate {
		counter(s.granted, v.grants.Claimed)
		counter(s.returned, v.grants.Returned)
		counter(s.unconfirmed, v.grants.Unconfirmed)
	} else {
		gauge(s.slots, float64(v.slots.Held))
		gauge(s.fair, float64(max(v.slots.Fair, 0)))
		gauge(s.frozen, bit(v.frozen))
		gauge(s.expired, bit(v.slots.Expired))
		counter(s.stateLost, v.lost)
		counter(s.unconfirmedGrowth, v.unconfirmed)
	}
	gauge(s.up, bit(!v.outage.Failing()))
	ch <- prometheus.MustNewConstMetric(s.mode, prometheus.GaugeValue, 1, name, v.mode)
	counter(s.errors, v.errors)
}

func bit(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
