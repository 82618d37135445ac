// Command adaptivesim compares egressd's adaptive concurrency controller
// (pkg/adaptive) with failsafe-go's adaptive limiter and Netflix's Gradient2
// on a deterministic, virtual-time model of a dependency whose capacity halves
// and recovers, one host and many. It prints the tables and the verdicts on
// issue 14's targets, and writes one PNG of the limit over time per
// scenario. See README.md.
package main

import (
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
)

func main() {
	cfg := DefaultConfig
	flag.Uint64Var(&cfg.Seed, "seed", cfg.Seed, "seed of every random stream")
	flag.Func("servers", "comma-separated c of the one-host scenarios (default 10,20,40)", func(s string) error {
		cfg.Servers = nil
		for f := range strings.SplitSeq(s, ",") {
			c, err := strconv.Atoi(f)
			if err != nil || c < 2 {
				return fmt.Errorf("servers: %q is not a whole number of at least 2", f)
			}
			cfg.Servers = append(cfg.Servers, c)
		}
		return nil
	})
	flag.DurationVar(&cfg.Mean, "mean", cfg.Mean, "mean service time")
	flag.Float64Var(&cfg.Sigma, "sigma", cfg.Sigma, "σ of the service time's logarithm")
	flag.Float64Var(&cfg.Load, "load", cfg.Load, "open loop: arrival rate as a multiple of full capacity")
	flag.IntVar(&cfg.Clients, "clients", cfg.Clients, "closed loop: clients per host (0: 3c / hosts)")
	flag.DurationVar(&cfg.Phase, "phase", cfg.Phase, "length of each phase (full, half, full capacity)")
	flag.IntVar(&cfg.Hosts, "hosts", cfg.Hosts, "hosts of the many-hosts runs (0: none)")
	flag.IntVar(&cfg.ManyServers, "many-servers", cfg.ManyServers, "c of the many-hosts runs")
	flag.IntVar(&cfg.ProbeEvery, "probe", cfg.ProbeEvery, "the egressd row's ProbeEvery (0: its default, 100)")
	flag.Float64Var(&cfg.Multiple, "multiple", cfg.Multiple, "the egressd row's Multiple (0: its default, 2)")
	plotDir := flag.String("png", ".", "directory for limit-<scenario>.png; empty for none")

	// failsafe-go's limiter reads the wall clock, so its runs need a
	// testing/synctest bubble, and a bubble needs a *testing.T: the command
	// hosts its one job as a test. testing.Main parses the flags above along
	// with its own, and exits.
	testing.Main(matchAll, []testing.InternalTest{{
		Name: "adaptivesim",
		F: func(t *testing.T) {
			single, many := Run(t, cfg)
			WriteTable(os.Stdout, cfg, single, many)
			WriteFrontier(os.Stdout, Frontier(single))
			if *plotDir != "" {
				if err := writePlots(*plotDir, cfg, single, many); err != nil {
					t.Fatalf("plot: %v", err)
				}
			}
		},
	}}, nil, nil)
}

func matchAll(string, string) (bool, error) { return true, nil }
