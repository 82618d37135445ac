package policy

import (
	"bytes"
	"fmt"
	"strings"
	"time"

	"github.com/egressd/egressd/pkg/adaptive"
	"go.yaml.in/yaml/v3"
)

// Format writes p, a valid policy, as a file that [Parse] reads back as p,
// for the
// daemon's state file and for showing rules to an operator: a rule shown by
// the CLI can be pasted into a policy file as it is. Fields at their
// defaults are left out, so the file keeps following the defaults.
func Format(p *Policy) ([]byte, error) {
	file := fileYAML{MaxRules: p.MaxRules, Rules: make([]ruleYAML, len(p.Rules))}
	if len(p.MetricsRules) > 0 {
		file.Metrics = &metricsYAML{Rules: p.MetricsRules}
	}
	for i, r := range p.Rules {
		file.Rules[i] = formatRule(r)
	}
	return encode(file, "policy")
}

// FormatRule writes one valid rule as the YAML mapping it is in a policy
// file's rules list ("name: x\ndestination: …"): what the CLI sends the
// daemon, and what an operator can paste under rules:.
func FormatRule(r Rule) ([]byte, error) {
	return encode(formatRule(r), "rule")
}

func encode(v any, what string) ([]byte, error) {
	var b bytes.Buffer
	enc := yaml.NewEncoder(&b)
	enc.SetIndent(2)
	if err := enc.Encode(v); err != nil {
		return nil, fmt.Errorf("encode %s: %w", what, err)
	}
	if err := enc.Close(); err != nil {
		return nil, fmt.Errorf("encode %s: %w", what, err)
	}
	return b.Bytes(), nil
}

// The *YAML types give the file's layout; limits are written in flow style,
// one line each, as the examples in the docs are.
type (
	fileYAML struct {
		MaxRules int          `yaml:"maxRules,omitempty"`
		Metrics  *metricsYAML `yaml:"metrics,omitempty"`
		Rules    []ruleYAML   `yaml:"rules"`
	}
	metricsYAML struct {
		Rules []string `yaml:"rules,flow"`
	}
	ruleYAML struct {
		Name        string         `yaml:"name"`
		Destination string         `yaml:"destination"`
		Port        uint16         `yaml:"port,omitempty"`
		Protocols   []string       `yaml:"protocols,omitempty,flow"`
		UDPIdle     time.Duration  `yaml:"udpIdle,omitempty"`
		Unit        string         `yaml:"unit,omitempty"`
		Cgroup      string         `yaml:"cgroup,omitempty"`
		Concurrency int            `yaml:"concurrency,omitempty"`
		PerSecond   *perSecondYAML `yaml:"perSecond,omitempty,flow"`
		PerWindow   *perWindowYAML `yaml:"perWindow,omitempty,flow"`
		Adaptive    *adaptiveYAML  `yaml:"adaptive,omitempty,flow"`
		Shadow      bool           `yaml:"shadow,omitempty"`
		Errno       string         `yaml:"errno,omitempty"`
		Shared      *sharedYAML    `yaml:"shared,omitempty,flow"`
	}
	sharedYAML struct {
		Redis       string        `yaml:"redis"`
		Key         string        `yaml:"key"`
		FailureMode string        `yaml:"failureMode,omitempty"`
		Durability  string        `yaml:"durability,omitempty"`
		Lease       time.Duration `yaml:"lease,omitempty"`
		Replicas    int           `yaml:"replicas,omitempty"`
	}
	perSecondYAML struct {
		Permits int `yaml:"permits"`
		Burst   int `yaml:"burst,omitempty"`
	}
	perWindowYAML struct {
		Permits  int           `yaml:"permits"`
		Window   time.Duration `yaml:"window"`
		Segments int           `yaml:"segments,omitempty"`
	}
	adaptiveYAML struct {
		Minimum        int           `yaml:"minimum,omitempty"`
		Maximum        int           `yaml:"maximum,omitempty"`
		Initial        int           `yaml:"initial,omitempty"`
		Multiple       float64       `yaml:"multiple,omitempty"`
		DecreaseFactor float64       `yaml:"decreaseFactor,omitempty"`
		ProbeEvery     *int          `yaml:"probeEvery,omitempty"`
		ProbeFactor    float64       `yaml:"probeFactor,omitempty"`
		MaxHealthy     time.Duration `yaml:"maxHealthy,omitempty"`
		Baseline       time.Duration `yaml:"baseline,omitempty"`
		Samples        string        `yaml:"samples,omitempty"`
	}
)

func formatRule(r Rule) ruleYAML {
	y := ruleYAML{
		Name:        r.Name,
		Destination: r.Destination.String(),
		Port:        r.Port,
		Unit:        r.Scope.Unit,
		Cgroup:      r.Scope.Cgroup,
		Shadow:      r.Shadow,
		Errno:       r.Errno,
		UDPIdle:     r.UDPIdle,
	}
	if r.Protocols != 0 {
		y.Protocols = strings.Split(r.Protocols.String(), ",")
	}
	if r.IsShared() {
		s := r.Shared
		y.Shared = &sharedYAML{Redis: s.Redis, Key: s.Key, FailureMode: s.FailureMode, Durability: s.Durability, Lease: s.Lease, Replicas: s.Replicas}
	}
	switch l := r.Limit.(type) {
	case Concurrency:
		y.Concurrency = int(l)
	case PerSecond:
		y.PerSecond = &perSecondYAML{Permits: l.Permits, Burst: l.Burst}
	case PerWindow:
		y.PerWindow = &perWindowYAML{Permits: l.Permits, Window: l.Window, Segments: l.Segments}
	case Adaptive:
		y.Adaptive = &adaptiveYAML{
			Minimum:        l.Minimum,
			Maximum:        l.Maximum,
			Initial:        l.Initial,
			Multiple:       l.Multiple,
			DecreaseFactor: l.DecreaseFactor,
			ProbeFactor:    l.ProbeFactor,
			MaxHealthy:     l.MaxHealthy,
			Baseline:       l.Baseline,
			Samples:        string(l.Samples),
		}
		switch {
		case l.ProbeEvery == adaptive.NoProbes:
			y.Adaptive.ProbeEvery = new(int) // the file's spelling of NoProbes
		case l.ProbeEvery != 0:
			y.Adaptive.ProbeEvery = &l.ProbeEvery
		}
	}
	return y
}
