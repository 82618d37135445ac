// Package adaptive finds a concurrency limit for one destination by watching
// latency, so that nobody has to divide a dependency's capacity by a replica
// count that goes stale on the next scaling change.
//
// Latency under load is the only signal that tells a dependency that keeps up
// from one that queues. A [Controller] reads it in rounds; a round is one
// limit's worth of completed calls, so the loop reacts at the pace the
// dependency is actually driven at, not on a timer. At the end of a round it
// compares the round's fastest call with a baseline, what a fast call costs:
//
//   - Fastest above Multiple × baseline: even the fastest call waited, which is
//     a queue rather than a tail, so the limit is multiplied by DecreaseFactor
//     (rounded down, never below Minimum).
//   - Otherwise, if the limit constrained the round (in-flight reached it or an
//     acquire was refused, reported through [Controller.Constrained]), the
//     limit grows by one, never above Maximum.
//   - Otherwise nothing changes. A limit that grew while idle would ratchet to
//     Maximum in a quiet period and meet the next burst with no limit at all.
//
// Decrease is multiplicative and increase additive for the reason TCP pairs
// them: being too high costs the dependency, being too low costs only us, so
// the two directions must not move at the same speed.
//
// Minimum is a liveness guarantee: a dependency that is slow for reasons that
// have nothing to do with our concurrency would otherwise drive the limit to
// zero, and then no call would ever sample its recovery. Maximum bounds the
// damage when the measurement is wrong. Until there is a baseline the limit
// holds at Initial and [Controller.Baseline] reports none.
//
// Two guards are optional: [Options.MaxHealthy], a latency above which a
// round's fastest call decreases the limit whatever the baseline says, and a
// fixed [Options.Baseline] for a dependency whose normal latency is known.
//
// # The baseline: drain probes, by default
//
// The reference loop judges rounds against the 10th percentile of the last
// five minutes of calls. [Options.ProbeEvery] [NoProbes] gives exactly that.
// It is not the default because of what bench/adaptivesim measured: the
// loop's equilibrium tolerates a queue (a round's fastest call may take up
// to Multiple × baseline), so under demand that stays above capacity every
// call of the five minutes carries our own queue, the 10th percentile learns
// it as normal, and the limit climbs. With Poisson arrivals at 1.5 × the
// capacity of 40 servers, the limit reaches Maximum (200, 5c) in 18 s, stays
// there, and when the capacity halves falls only to 156 (median) against a
// band of [20, 44]; p99 is 89.6 ms against 33.7 ms with probes and 28.2 ms
// for a limit that knows the capacity. Ten hosts calling one dependency this
// way hold 601 between them where 40 to 88 would do.
//
// By default the baseline is learned from drain probes instead, the idea of
// BBR's ProbeRTT: now and then hold the limit at ⌈limit × ProbeFactor⌉ (one
// half) so that the calls admitted meanwhile find the dependency without
// our queue, and measure a fast call on those calls only. Rounds are then
// judged against the 10th percentile of the probes' calls, probe by probe
// weighing a twentieth less (about 400 calls). A probe measures batches of
// at least 20 calls admitted since the batch began (calls admitted before
// drain unmeasured, calls admitted during it count after it ends), and:
//
//   - ends with a batch whose 10th percentile is within 1.2 × the baseline
//     and no faster than the batch before; its fastest batch (by median)
//     joins the baseline if its median is within 1.05 × the baseline's;
//   - on a batch that still meets a queue, ours or other callers', counts it
//     as a round that shows one (the limit it restores decreases), goes
//     deeper (× ProbeFactor again) and measures afresh, and restores at most
//     the limit that would have probed where it found the dependency drained;
//     a batch that even its fastest call waited for ends it, as the limit is
//     falling, not the baseline;
//   - ends, once the window's last probes have begun (below), when its
//     limit was cut twice with its batches' 10th percentile no lower: the
//     dependency is slower, not queued, so it restores the limit it began
//     from and its fastest batch replaces the baseline. A dependency 1.2
//     to Multiple times slower, which no probe drains and no round sees as
//     a queue, is believed so. Until it can tell which, it goes on cutting;
//   - does not start at the end of a round that decreased the limit.
//
// Many hosts call one dependency without a shared budget, and each host's
// queue is only a part of its queue: one host halving its limit drains
// nothing, so every host would learn the others' queue, and the hosts'
// limits ratchet up together. Probes therefore happen in windows the hosts
// share without talking: at the multiples, since the Unix epoch, of a
// period of ProbeEvery rounds (a round counted as Multiple × baseline,
// 100 × 2 × 5 ms ≈ 1 s here) rounded up to a power of two, so that hosts
// whose clocks agree and whose baselines agree within a factor of two share
// them. Each host begins its probe at a random moment within ± ProbeJitter
// (15%) of the period around the window's start, so that they do not begin
// in lockstep, and a probe that meets a queue holds on until the window's
// last probes have begun, when the dependency drains. A host's first probe,
// before any probe confirmed its baseline, goes to Minimum, measures 200
// calls and holds on that long whatever it finds: hosts that start together
// learn one baseline, and one that joins later learns it at the next window.
// Hosts must agree: the round rule shares a dependency fairly only when
// their baselines are within a few percent (bench/adaptivesim: ±3% apart,
// Jain's index 0.97; ±20%, 0.81), which is why a baseline is hundreds of
// calls.
//
// A dependency that got more than Multiple times slower is believed after
// five minutes (the reference window's length) in which every probe met a
// queue with the limit at Minimum: the probes are forgotten, and the window judges until
// a probe confirms a baseline again.
//
// Measured in bench/adaptivesim (one host, capacity c ∈ {10, 20, 40}
// halving for the middle minute of three, open and closed loop; and ten
// hosts against c = 40): the median settled limit lies at 1.4–1.6c, its
// 95th percentile at most 2c, a halving is followed within 2–5 rounds,
// goodput is 98.5–99.3%, p99 33.7–34.3 ms (1.2 × the oracle's); ten hosts
// hold 84–86 at c = 40 (open loop) and 65–67 (closed), 40 after the
// halving, with Jain's index of their shares at 0.92–1.00. What probes
// cost: 0.7–1.5 points of goodput against the same rule judged by the true
// baseline (most at small c), and for the length of each probe a limit in
// force below the settled one, by design. What they cannot fix: Minimum ×
// hosts above the dependency's capacity leaves no probe able to drain it
// (ten hosts at Minimum 4 are exactly twice c/2 = 20 at the halving), and a
// queue built by callers that do not probe is measured as the dependency's
// normal.
//
// Time is an argument, not a clock the package reads, so every rule can be
// tested at fixed instants, and the daemon can feed kernel timestamps from its
// ring buffer; the probe windows read it as wall time (the Unix epoch). The
// package imports only the standard library: the daemon turns the OnChange
// callback into a kernel map update and a metric, the SDK into its own
// limiter's size.
package adaptive
