// SPDX-License-Identifier: (MIT OR GPL-2.0)

// A rule and its state as the datapath keeps them, and the arithmetic of
// the two rate shapes: a token bucket (take_token) and a sliding window
// (take_window). egressd.c admits connections with them; progrun.c runs the
// same code under BPF_PROG_RUN, so that a test can hold it to pkg/limit's
// Go arithmetic, which claims to equal it.

#ifndef EGRESSD_RULE_H
#define EGRESSD_RULE_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#define NSEC_PER_SEC 1000000000ULL
/* A refill up to this long keeps elapsed * rate below 2^64 at any rate
 * user space allows (10^6 per second); a longer one is first capped at
 * the bucket's fill time. */
#define LONG_REFILL_NS (100ULL * NSEC_PER_SEC)
#define MAX_SEGMENTS 32

enum shape {
	SHAPE_CONCURRENCY,
	SHAPE_PER_SECOND,
	SHAPE_PER_WINDOW,
	SHAPE_GRANTED, /* admit while spent < granted: user space grants permits */
	SHAPE_LEN,
};

/* Per-rule counters. */
enum counter {
	COUNTER_ADMITTED,
	COUNTER_REFUSED,
	COUNTER_SHADOW_REFUSED, /* would have been refused; admitted in shadow mode */
	COUNTER_RELEASED,
	COUNTER_ESTABLISHED,
	COUNTER_CONNECT_FAILED, /* released without ever reaching ESTABLISHED */
	COUNTER_UNTRACKED,	/* admitted without socket state (allocation failed) */
	COUNTER_REQUESTS,
	COUNTER_RESPONSES,	/* those an earlier build counted; rule_responses has the rest */
	COUNTER_ABORTED,	/* released while a request was in flight */
	COUNTER_LEN,		/* in flight: requests - responses - aborted */
};

struct rule {
	__u32 gen;
	__u8 shape;
	__u8 flags;
	__u16 refuse_errno; /* 0 = EPERM */
	__u32 limit; /* live connections, permits per second or per window */
	__u32 burst; /* per-second bucket size */
	__u32 segments;
	__u32 epoch; /* bumped when the shape's parameters change: state restarts */
	__u64 segment_ns;
	/* SHAPE_GRANTED: permits granted since the slot was created. User
	 * space raises it as it claims a share of a budget kept elsewhere, and
	 * lowers it no further than what is spent when it hands permits back. */
	__u64 granted;
	/* SHAPE_CONCURRENCY: a shared rule's share holds until until_ns (0:
	 * for good); from then connect() is admitted against limit_after. User
	 * space pushes until_ns on as Redis renews the share, so a daemon that
	 * stopped (killed, paused) cannot leave its kernel spending slots that
	 * Redis has since given to other hosts. */
	__u64 until_ns;
	__u32 limit_after;
	__u32 _pad;
};

/* What the programs change of a rule. The first cache line holds what
 * admission touches. */
struct rule_state {
	struct bpf_spin_lock lock;
	__u32 epoch; /* rule.epoch this state was started for; under the lock */
	__s64 live;  /* atomic; not under the lock */
	__u64 spent; /* SHAPE_GRANTED permits taken; atomic, never restarted */
	/* token bucket, under the lock */
	__u64 tokens; /* permits scaled by NSEC_PER_SEC */
	__u64 refilled_ns; /* the latest clock a take read; a window's too */
	__u64 counters[COUNTER_LEN]; /* atomic */
	/* sliding window, under the lock */
	__u64 segment_id[MAX_SEGMENTS];
	__u32 segment_count[MAX_SEGMENTS];
};

/* Token bucket: returns 0 to admit, else the nanoseconds to the next token. */
static __always_inline __u64 take_token(struct rule_state *st, const struct rule *r, __u64 now)
{
	__u64 cap = (__u64)r->burst * NSEC_PER_SEC;
	__u64 rate = r->limit;
	__u64 wait = 0;

	bpf_spin_lock(&st->lock);
	if (st->epoch != r->epoch) {
		st->epoch = r->epoch;
		st->tokens = cap;
		st->refilled_ns = now;
	}
	/* Another CPU may have stored a later time: never go backwards. */
	__u64 elapsed = now > st->refilled_ns ? now - st->refilled_ns : 0;
	/* Refilling for longer than an empty bucket takes to fill (cap / rate,
	 * rounded up) adds nothing, and capping elapsed there keeps elapsed *
	 * rate within cap + rate: a bucket slower to fill than LONG_REFILL_NS
	 * still fills all the way. Only a long refill pays the division. */
	if (elapsed > LONG_REFILL_NS && rate) {
		__u64 fill = (cap + rate - 1) / rate;

		if (elapsed > fill)
			elapsed = fill;
	}
	__u64 t = st->tokens + elapsed * rate;
	if (t > cap)
		t = cap;
	if (now > st->refilled_ns)
		st->refilled_ns = now;
	if (t >= NSEC_PER_SEC)
		t -= NSEC_PER_SEC;
	else if (rate)
		wait = (NSEC_PER_SEC - t + rate - 1) / rate;
	else
		wait = NSEC_PER_SEC;
	st->tokens = t;
	bpf_spin_unlock(&st->lock);
	return wait;
}

/* Sliding window of n segments. Segments are numbered from the clock
 * (now / segment_ns); slot i of segment_id/segment_count holds segment
 * number segment_id[i], and counts only while that segment is one of the
 * last n. Only the first n slots are read: fewer cache lines. Fixed-trip
 * loops without breaks keep the verifier's work linear. Returns 0 to
 * admit, else the nanoseconds until the oldest counted segment leaves the
 * window. */
static __always_inline __u64 take_window(struct rule_state *st, const struct rule *r, __u64 now)
{
	__u64 n = r->segments;
	__u64 seg_ns = r->segment_ns;

	if (n == 0 || n > MAX_SEGMENTS || seg_ns == 0)
		return 0; /* user space validates; never refuse on a broken rule */
	__u64 cur = now / seg_ns;
	__u64 total = 0, oldest = ~0ULL, wait = 0;

	bpf_spin_lock(&st->lock);
	if (st->epoch != r->epoch) {
#pragma unroll
		for (int i = 0; i < MAX_SEGMENTS; i++) {
			st->segment_id[i] = 0;
			st->segment_count[i] = 0;
		}
		st->epoch = r->epoch;
	}
	/* Another CPU may have taken at a later time (it read the clock after
	 * this one and took the lock first): take at that time, so that a
	 * stale reading neither leaves the newer segment's permits out of the
	 * total, admitting past the limit, nor counts its own in an older
	 * segment. Only then is the division done again. */
	if (now < st->refilled_ns) {
		now = st->refilled_ns;
		cur = now / seg_ns;
	} else {
		st->refilled_ns = now;
	}
	__u32 idx = (cur % n) & (MAX_SEGMENTS - 1);
	if (st->segment_id[idx] != cur) {
		st->segment_id[idx] = cur;
		st->segment_count[idx] = 0;
	}
#pragma unroll
	for (int i = 0; i < MAX_SEGMENTS; i++) {
		if (i >= n)
			continue;
		__u64 id = st->segment_id[i];
		__u32 c = st->segment_count[i];

		if (id + n > cur && id <= cur && c) {
			total += c;
			if (id < oldest)
				oldest = id;
		}
	}
	if (total < r->limit)
		st->segment_count[idx]++;
	else
		wait = (oldest + n) * seg_ns - now;
	bpf_spin_unlock(&st->lock);
	return wait;
}

#endif /* EGRESSD_RULE_H */
