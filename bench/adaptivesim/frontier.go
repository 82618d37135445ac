package main

import (
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
)

// The frontier asks whether the targets against the peers can be met at
// all: a limit fixed at k × the servers in force (it knows the capacity,
// as the oracle does, and follows a halving at once) is judged by the same
// verdict as egressd's rows, for each k. A scenario where no k meets every
// target is one where a limit that settles at some multiple of the
// capacity, as a round rule does, cannot; targets met by disjoint k in
// different scenarios cannot be met by one setting.

// frontierTimes are the k of the frontier: 1.0 to 2.5 by 0.1.
var frontierTimes = func() []float64 {
	var out []float64
	for i := 10; i <= 25; i++ {
		out = append(out, float64(i)/10)
	}
	return out
}()

// FrontierScenario is one scenario's frontier.
type FrontierScenario struct {
	Scenario *Scenario
	Rows     []*Result // one per frontierTimes, in order
	// Met is the k whose rows meet every target.
	Met []float64
	// BelowP99 and AboveGoodput are the k whose p99 is below every
	// peer's and whose goodput is above every peer's.
	BelowP99, AboveGoodput []float64
	BestP99, BestGoodput   *Result // the peers' best
	Settled                float64 // egressd's median settled limit at c, ÷ c
}

// Frontier runs the fixed limits on every one-host scenario of single (the
// rows of Run) and judges them against that scenario's rows.
func Frontier(single []*Result) []FrontierScenario {
	var out []FrontierScenario
	for _, group := range groups(single) {
		sc := group[0].Scenario
		f := FrontierScenario{Scenario: sc}
		for _, r := range group {
			switch {
			case r.Kind == Egressd:
				f.Settled = r.Median[0] / float64(sc.Servers)
			case r.Kind != Peer:
			case f.BestP99 == nil:
				f.BestP99, f.BestGoodput = r, r
			default:
				if r.P99 < f.BestP99.P99 {
					f.BestP99 = r
				}
				if r.Goodput > f.BestGoodput.Goodput {
					f.BestGoodput = r
				}
			}
		}
		for _, k := range frontierTimes {
			sp := spec{name: fmt.Sprintf("fixed %.1f×c", k), kind: Reference}
			tr := Simulate(sc, func(int) Controller { return &oracleController{sc: sc, share: 1, times: k} })
			r := analyse(sc, sp, tr)
			f.Rows = append(f.Rows, r)
			if strings.HasSuffix(verdict(r, group), "every target MET") {
				f.Met = append(f.Met, k)
			}
			if f.BestP99 != nil && r.P99 < f.BestP99.P99 {
				f.BelowP99 = append(f.BelowP99, k)
			}
			if f.BestGoodput != nil && r.Goodput > f.BestGoodput.Goodput {
				f.AboveGoodput = append(f.AboveGoodput, k)
			}
		}
		out = append(out, f)
	}
	return out
}

// WriteFrontier prints each scenario's frontier and the k, if any, that
// meets every target in every scenario.
func WriteFrontier(w io.Writer, frontier []FrontierScenario) {
	fmt.Fprintln(w, "\nFrontier: a limit fixed at k × the servers in force (k = 1.0 to 2.5; it knows the capacity, as the oracle does),")
	fmt.Fprintln(w, "judged by the same targets. Can any multiple of the capacity meet them?")
	everywhere := frontierTimes
	for _, f := range frontier {
		fmt.Fprintf(w, "  %s: every target met at k: %s; p99 below the peers' best (%s, %s) at k: %s; goodput above their best (%.1f%%, %s) at k: %s; egressd settles at %.1f\n",
			f.Scenario.Name, ks(f.Met), ms(f.BestP99.P99), f.BestP99.Controller, ks(f.BelowP99),
			100*f.BestGoodput.Goodput, f.BestGoodput.Controller, ks(f.AboveGoodput), f.Settled)
		// The k of Met are frontierTimes' own values: equal, not close.
		everywhere = slices.DeleteFunc(slices.Clone(everywhere), func(k float64) bool { return !slices.Contains(f.Met, k) })
	}
	fmt.Fprintf(w, "  every target met in every scenario at k: %s\n", ks(everywhere))
}

// ks prints a set of k compactly: runs of consecutive k as ranges.
func ks(set []float64) string {
	if len(set) == 0 {
		return "none"
	}
	var parts []string
	for i := 0; i < len(set); {
		j := i
		for j+1 < len(set) && math.Abs(set[j+1]-set[j]-0.1) < 1e-9 {
			j++
		}
		if j == i {
			parts = append(parts, fmt.Sprintf("%.1f", set[i]))
		} else {
			parts = append(parts, fmt.Sprintf("%.1f–%.1f", set[i], set[j]))
		}
		i = j + 1
	}
	return strings.Join(parts, ", ")
}
