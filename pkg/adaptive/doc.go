// Package adaptive finds a concurrency limit for one destination by watching
// latency, so that nobody has to divide a dependency's capacity by a replica
// count that goes stale on the next scaling change.
//
// Latency under load is the only signal that tells a dependency that keeps up
// from one that queues. A [Controller] reads it in rounds; a round is one
// limit's worth of completed calls, so the loop reacts at the pace the
// dependency is actually driven at, not on a timer. At the end of a round it
// compares the round's fastest call with a baseline, the 10th percentile of the
// last five minutes of calls:
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
// damage when the measurement is wrong, and it can be: a process that starts
// while the dependency is already queueing learns the queued latency as normal
// and grows to Maximum. Set Maximum to a number the dependency can survive,
// not one you expect never to reach.
//
// Until the window holds enough calls to have a 10th percentile the limit
// holds at Initial and [Controller.Baseline] reports none.
//
// # Where the specified loop fails: sustained demand above capacity
//
// The loop above is the specification, and it is what every default gives.
// It has a failure worse than the one the specification documents. Its
// equilibrium tolerates a queue: a round's fastest call may take up to
// Multiple × baseline, so at the defaults about 1.3–1.8 × what the dependency
// serves at once is in flight. Under demand that stays above capacity, every
// call in the five-minute window was made at that equilibrium, so once such
// calls are more than 90% of the window, which takes seconds at thousands of
// calls a second, the 10th percentile is queued latency. The threshold rises
// with it, the limit rises, the queue grows, and the baseline follows: a
// process that started healthy ends where the specification says only a
// process started during queueing does. The window's length does not help;
// what counts is the share of calls in it, not their age.
//
// Measured in bench/adaptivesim (deterministic simulation: 40 servers,
// lognormal service time, mean 10ms, p10 4.7ms; Poisson arrivals at 1.5 ×
// capacity; the servers halve for the middle minute of three): the baseline
// goes 4.8ms (0.1s) → 9.3ms (2s) → 16.6ms (8s) → 26.5ms (28s); the limit
// goes 29 → 104 → 167 and reaches Maximum (200, 5 × capacity) at 18s and
// never leaves it; when the servers halve it falls only to 133–173 against a
// target of at most 44, and never follows the drop. Goodput stays at 99.9%,
// but p99 is 89.6ms against 34ms for the same rule judged against the true
// no-queue baseline, and 28ms for a limit that knows the capacity. With 120
// closed-loop clients the limit sits at 121, the most they can constrain,
// and p99 (64.7ms) is no better than no limit at all (71.0ms).
//
// # Drain probes (opt-in)
//
// [Options.ProbeEvery] turns on the fix, off by default so that the default
// stays the specification. It borrows BBR's ProbeRTT: to know what a call
// costs without our queue, now and then take our queue away. After the first
// round judged with a baseline, and then every ProbeEvery rounds, the
// controller starts a probe: [Controller.Limit] becomes ⌈limit ×
// ProbeFactor⌉ (default one half, never below Minimum), OnChange is called
// so that the daemon pushes it into the kernel, and [Controller.Probing]
// reports the limit the probe will restore. Half the limit admits calls into
// an empty queue whenever the limit is at most twice what the dependency
// serves at once, which is where the loop settles.
//
// The probe's calls are the ones admitted during it. Sample is given only
// the end of a call and its latency, so a call's start is now − latency:
// calls that started before the probe, under the full limit and possibly
// queued, drain unmeasured; calls that started during it are measured, also
// when they complete after it has ended. (Counting the calls that merely
// complete during the probe would measure exactly the queued ones, since
// those complete first; counting only those admitted during it that complete
// before it ends would keep the fastest.) The probe ends once max(probe
// limit, 10) of its calls have completed: OnChange restores the limit, no
// round is judged on the probe, refusals during it are forgotten, and the
// next round starts afresh. now and latency must come from one clock; should
// they not, so that no call seems to be the probe's, a probe ends anyway
// after twice the completions it should have needed.
//
// Rounds are then judged against the 10th percentile of the calls of the
// last three probes pooled, of those that ended in the last five minutes,
// instead of the window's. Pooling makes 30 calls or more a sample where one
// probe's 10th percentile would be its first or second fastest call; one
// probe that met a queue anyway (it came right after a capacity drop) moves
// the pooled 10th percentile only to about the 15th of the other two; a
// dependency that really got slower is believed after three probes. With no
// probe in the last five minutes (before the first, or after a quiet spell),
// rounds are judged against the window as specified, and a probe starts at
// the next round's end.
//
// In the same simulation with ProbeEvery 100: the limit settles in 15
// rounds at 51–74 (1.3–1.9 × capacity), follows the drop within 3 rounds to
// 24–41 (capacity 20), and p99 is 34.2ms at 99.6% goodput; a probe costs
// about 0.3% of goodput at 100 rounds, 1.5% at 20. What probes do not fix:
// a queue built by other clients of the dependency is measured as its
// normal, as BBR measures other flows; with capacity near Minimum (10
// servers halving to 5) the loop is too coarse to stay inside [c, 2.2c]; and
// for the length of each probe the limit in force is half the settled one,
// 0.65–0.9 × capacity here, by design, which a test of the kernel limit must
// allow for.
//
// Time is an argument, not a clock the package reads, so every rule can be
// tested at fixed instants, and the daemon can feed kernel timestamps from its
// ring buffer. The package imports only the standard library: the daemon turns
// the OnChange callback into a kernel map update and a metric, the SDK into its
// own limiter's size.
package adaptive
