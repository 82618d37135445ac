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
// Time is an argument, not a clock the package reads, so every rule can be
// tested at fixed instants, and the daemon can feed kernel timestamps from its
// ring buffer. The package imports only the standard library: the daemon turns
// the OnChange callback into a kernel map update and a metric, the SDK into its
// own limiter's size.
package adaptive
