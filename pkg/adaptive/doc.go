// Package adaptive finds a concurrency limit for one destination by watching
// latency, so that nobody has to divide a dependency's capacity by a replica
// count that goes stale on the next scaling change.
//
// A [Controller] is fed each call's latency ([Controller.Sample]) and reads
// it in rounds of one limit's worth of completed calls. At a round's end, if
// the round's fastest call took more than Multiple × the baseline (a queue,
// not a tail), the limit is multiplied by DecreaseFactor, never below
// Minimum; otherwise, if the limit constrained the round (in-flight reached
// it, or an acquire was refused: [Controller.Constrained]), it grows by one,
// never above Maximum. Until there is a baseline it holds at Initial.
// [Options.MaxHealthy] and a fixed [Options.Baseline] are optional guards.
//
// By default the baseline is learned in drain probes: now and then the limit
// is held at ⌈limit × ProbeFactor⌉ so that the calls admitted meanwhile find
// the dependency without our queue. Probes fall in windows of the wall clock,
// so hosts whose clocks agree probe together; during one the limit in force
// is below the settled one ([Controller.Probing], [Controller.State]).
// ProbeEvery [NoProbes] gives the reference loop instead, judged against the
// 10th percentile of the last five minutes of calls: under demand above
// capacity those calls carry the loop's own queue, and the limit climbs to
// Maximum.
//
// Time is an argument (read as wall time for the probe windows), so every
// rule is tested at fixed instants; OnChange reports each move. The package
// imports only the standard library. docs/design.md ("The adaptive loop")
// has the probes in full, the reasons, and what bench/adaptivesim measured.
package adaptive
