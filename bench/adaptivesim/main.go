// Command adaptivesim compares egressd's adaptive concurrency controller
// (pkg/adaptive) with failsafe-go's adaptive limiter and Netflix's Gradient2
// on a deterministic, virtual-time model of a dependency whose capacity halves
// and recovers. It prints one table and writes one SVG of the limit over time
// per scenario. See README.md.
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

func main() {
	cfg := DefaultConfig
	flag.Uint64Var(&cfg.Seed, "seed", cfg.Seed, "seed of every random stream")
	flag.IntVar(&cfg.Servers, "servers", cfg.Servers, "servers c at full capacity")
	flag.DurationVar(&cfg.Mean, "mean", cfg.Mean, "mean service time")
	flag.Float64Var(&cfg.Sigma, "sigma", cfg.Sigma, "σ of the service time's logarithm")
	flag.Float64Var(&cfg.Load, "load", cfg.Load, "open loop: arrival rate as a multiple of full capacity")
	flag.IntVar(&cfg.Clients, "clients", cfg.Clients, "closed loop: clients (0: 3 × servers)")
	flag.DurationVar(&cfg.Phase, "phase", cfg.Phase, "length of each phase (full, half, full capacity)")
	flag.IntVar(&cfg.ProbeEvery, "probe", cfg.ProbeEvery, "the egressd probe row's ProbeEvery (rounds between drain probes)")
	svgDir := flag.String("svg", ".", "directory for limit-<scenario>.svg; empty for none")

	// failsafe-go's limiter reads the wall clock, so its runs need a
	// testing/synctest bubble, and a bubble needs a *testing.T: the command
	// hosts its one job as a test. testing.Main parses the flags above along
	// with its own, and exits.
	testing.Main(matchAll, []testing.InternalTest{{
		Name: "adaptivesim",
		F: func(t *testing.T) {
			results := Run(t, cfg)
			WriteTable(os.Stdout, cfg, results)
			if *svgDir == "" {
				return
			}
			for _, sc := range cfg.Scenarios() {
				path := filepath.Join(*svgDir, "limit-"+sc.Name+".svg")
				if err := os.WriteFile(path, PlotSVG(sc, results), 0o644); err != nil {
					t.Fatalf("plot: %v", err)
				}
				fmt.Println("wrote", path)
			}
		},
	}}, nil, nil)
}

func matchAll(string, string) (bool, error) { return true, nil }
