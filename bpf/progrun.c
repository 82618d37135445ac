//go:build ignore

// SPDX-License-Identifier: (MIT OR GPL-2.0)
//
// Test-only: the datapath's token bucket and sliding window (rule.h) in a
// syscall program that BPF_PROG_RUN runs one take at a time, on a clock
// the test chooses. pkg/loader's TestKernelLimiterArithmetic holds their
// decisions to pkg/limit's. Nothing here is loaded by the daemon.

#include "rule.h"

char __license[] SEC("license") = "Dual MIT/GPL";

/* One take: the rule and the clock reading in, the wait out (0: admitted). */
struct step {
	struct rule rule;
	__u64 now;
	__u64 wait;
};

/* The state of the rule under test; the test zeroes it to start afresh. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct rule_state);
} state SEC(".maps");

/* Takes with the rule's shape: its bucket if it is per second, else its
 * window. */
SEC("syscall")
int progrun_take(struct step *s)
{
	__u32 zero = 0;
	struct rule r = s->rule;
	struct rule_state *st = bpf_map_lookup_elem(&state, &zero);

	if (!st)
		return 1;
	s->wait = r.shape == SHAPE_PER_SECOND ? take_token(st, &r, s->now) : take_window(st, &r, s->now);
	return 0;
}
