package cli

import (
	"time"

	"github.com/urfave/cli/v2"

	"github.com/egressd/egressd/pkg/policy"
)

// ruleFlags are limit set's flags: one for each field of a policy rule
// that has one, as package policy describes them. They are made afresh
// for each App, since a cli.Flag remembers whether it was set.
func ruleFlags() []cli.Flag {
	var flags []cli.Flag
	for _, f := range policy.Fields() {
		if f.Flag == "" {
			continue
		}
		switch f.Value.(type) {
		case int:
			flags = append(flags, &cli.IntFlag{Name: f.Flag, Usage: f.Usage, DefaultText: f.Default, Required: f.Required})
		case float64:
			flags = append(flags, &cli.Float64Flag{Name: f.Flag, Usage: f.Usage, DefaultText: f.Default, Required: f.Required})
		case time.Duration:
			flags = append(flags, &cli.DurationFlag{Name: f.Flag, Usage: f.Usage, DefaultText: f.Default, Required: f.Required})
		case bool:
			flags = append(flags, &cli.BoolFlag{Name: f.Flag, Usage: f.Usage, DefaultText: f.Default, Required: f.Required})
		default:
			flags = append(flags, &cli.StringFlag{Name: f.Flag, Usage: f.Usage, DefaultText: f.Default, Required: f.Required})
		}
	}
	return flags
}

// rule is the rule limit set's flags describe, built and checked by
// package policy as a policy file's rule is.
func rule(c *cli.Context, name string) (policy.Rule, error) {
	given := map[string]any{}
	for _, f := range c.Command.Flags {
		if n := f.Names()[0]; c.IsSet(n) {
			given[n] = c.Value(n)
		}
	}
	return policy.FromFlags(name, given)
}
