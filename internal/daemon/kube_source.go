package daemon

import (
	"context"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/egressd/egressd/internal/kube"
	"github.com/egressd/egressd/pkg/cgroups"
	"github.com/egressd/egressd/pkg/control"
	"github.com/egressd/egressd/pkg/policy"
)

// newKube makes the Kubernetes source Config.Kube asks for; it reaches
// no server until it runs.
func (d *Daemon) newKube() error {
	if d.cfg.Kube == nil {
		return nil
	}
	cfg := *d.cfg.Kube
	mount, err := cgroups.Mount()
	if err != nil {
		return err
	}
	cfg.CgroupMount, cfg.Logger = mount, d.log
	d.kube, err = kube.New(cfg)
	if err == nil {
		d.api.kube = d.kube
	}
	return err
}

// kubeSink is the table as the Kubernetes source changes it.
type kubeSink struct{ t *table }

func (s kubeSink) Apply(ctx context.Context, rules []kube.Rule) (map[string]string, error) {
	k := kubeRules{rules: make([]policy.Rule, len(rules)), sources: make([]string, len(rules))}
	for i, r := range rules {
		k.rules[i], k.sources[i] = r.Rule, r.Source
	}
	return s.t.setKube(ctx, k, time.Now())
}

func (s kubeSink) Refused() (map[string]string, <-chan struct{}) {
	return s.t.kubeRefused(), s.t.kubeChanged
}

func (s kubeSink) Rescan(ctx context.Context) { s.t.refresh(ctx, time.Now(), true) }

// kubeStatus is the source's state as egressd status shows it.
func kubeStatus(st kube.Status) *control.Kube {
	return &control.Kube{Node: st.Node, Connected: st.Connected, Since: st.Since, Error: st.Error,
		Limits: st.Limits, Refused: st.Refused, Pods: st.Pods, Rules: st.Rules}
}

// kubeMetrics says at scrape time whether the API server is reached and
// what the limits make on this node.
type kubeMetrics struct {
	src                               *kube.Source
	connected, limits, pods, kubeRule *prometheus.Desc
}

func newKubeMetrics(src *kube.Source) *kubeMetrics {
	return &kubeMetrics{
		src:       src,
		connected: prometheus.NewDesc("egressd_kube_connected", "1 while the API server answers the daemon's watches of pods and EgressLimits; 0 while it does not, and the rules last known stay in force.", nil, nil),
		limits:    prometheus.NewDesc("egressd_kube_limits", "EgressLimits that select pods of this node, by state: applied, or refused (a problem with the object, or a clash with another rule; see its Events).", []string{"state"}, nil),
		pods:      prometheus.NewDesc("egressd_kube_pods", "Pods bound to this node.", nil, nil),
		kubeRule:  prometheus.NewDesc("egressd_kube_rules", "Rules the EgressLimits make on this node: one per limit and pod it selects.", nil, nil),
	}
}

func (m *kubeMetrics) Describe(ch chan<- *prometheus.Desc) {
	ch <- m.connected
	ch <- m.limits
	ch <- m.pods
	ch <- m.kubeRule
}

func (m *kubeMetrics) Collect(ch chan<- prometheus.Metric) {
	st := m.src.Status()
	ch <- prometheus.MustNewConstMetric(m.connected, prometheus.GaugeValue, bit(st.Connected))
	ch <- prometheus.MustNewConstMetric(m.limits, prometheus.GaugeValue, float64(st.Limits-st.Refused), "applied")
	ch <- prometheus.MustNewConstMetric(m.limits, prometheus.GaugeValue, float64(st.Refused), "refused")
	ch <- prometheus.MustNewConstMetric(m.pods, prometheus.GaugeValue, float64(st.Pods))
	ch <- prometheus.MustNewConstMetric(m.kubeRule, prometheus.GaugeValue, float64(st.Rules))
}
