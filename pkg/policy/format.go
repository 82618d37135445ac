package policy

import (
	"bytes"
	"fmt"

	"go.yaml.in/yaml/v3"
)

// Format writes p, a valid policy, as a file that [Parse] reads back as p,
// for the daemon's state file and for showing rules to an operator: a rule
// shown by the CLI can be pasted into a policy file as it is. Fields at
// their defaults are left out, so the file keeps following the defaults;
// limits and shared budgets are written one line each, as the examples in
// the docs are.
func Format(p *Policy) ([]byte, error) {
	file := &yaml.Node{Kind: yaml.MappingNode}
	if p.MaxRules != 0 {
		file.Content = append(file.Content, scalar("maxRules"), itoa(p.MaxRules))
	}
	if len(p.MetricsRules) > 0 {
		metrics := &yaml.Node{Kind: yaml.MappingNode, Content: []*yaml.Node{scalar("rules"), list(p.MetricsRules)}}
		file.Content = append(file.Content, scalar("metrics"), metrics)
	}
	rules := &yaml.Node{Kind: yaml.SequenceNode, Content: make([]*yaml.Node, len(p.Rules))}
	for i, r := range p.Rules {
		rules.Content[i] = draftOf(r).node(topFields)
	}
	file.Content = append(file.Content, scalar("rules"), rules)
	return encode(file, "policy")
}

// FormatRule writes one valid rule as the YAML mapping it is in a policy
// file's rules list ("name: x\ndestination: …"): what the CLI sends the
// daemon, and what an operator can paste under rules:.
func FormatRule(r Rule) ([]byte, error) {
	return encode(draftOf(r).node(topFields), "rule")
}

func encode(n *yaml.Node, what string) ([]byte, error) {
	var b bytes.Buffer
	enc := yaml.NewEncoder(&b)
	enc.SetIndent(2)
	if err := enc.Encode(n); err != nil {
		return nil, fmt.Errorf("encode %s: %w", what, err)
	}
	if err := enc.Close(); err != nil {
		return nil, fmt.Errorf("encode %s: %w", what, err)
	}
	return b.Bytes(), nil
}
