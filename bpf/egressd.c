//go:build ignore

// SPDX-License-Identifier: (MIT OR GPL-2.0)
//
// egressd datapath: per-destination admission of outbound TCP connections.
//
// Admission (cgroup/connect4, cgroup/connect6): find the most specific rule for
// (socket cgroup, destination address, port) and check its one shape:
// concurrency (live connections), per-second token bucket, sliding window, or
// permits granted by user space (a host's share of a budget kept in Redis).
// A refusal returns 0, which the caller's connect() sees as EPERM, or as the
// rule's errno when one is set (bpf_set_retval).
//
// Accounting: an admitted socket holds one slot of its rule, recorded in its
// sock_state. The slot is given back exactly once (compare-and-swap on
// sock_state.word) at the first of: sockops STATE_CB entering TCP_CLOSE for
// an established connection (RST, timeout, disconnect while the fd stays
// open), sockops RTO_CB when TCP gives up on a connect(), cgroup/sock_release
// (close, process exit, and a connect() refused by the peer, disconnected
// or failing before tcp_connect()), a second connect() on the same socket,
// or the recount's sweep, for a socket freed without any of these.
//
// Cost: only admitted sockets are tracked, and connect() marks them with a
// sockops callback flag (bpf_setsockopt TCP_BPF_SOCK_OPS_CB_FLAGS). Every
// other program but sock_release returns at once for a socket without it,
// so a connection no rule admitted costs each a test of one bit, and
// sock_release a test of the socket's cookie. A tracked socket's state
// lives in sock_table, an array indexed by the socket's cookie (cookies
// count up, so live sockets rarely collide): in the entry its cookie picks
// in the table's first 16 (the hot part, in the CPU's nearest cache), else
// in its first 1,024 (the warm part, in the TLB), else in the whole table,
// and in the overflow hash only when all three are held by other live
// sockets.
//
// UDP (cgroup/sendmsg4/6, recvmsg4/6, attached while a rule counts UDP
// flows) runs for every datagram sent to an address. One to an address no
// UDP rule's destinations may hold returns after three array lookups
// (udp_dests); one on the flow its socket's last datagram found, after
// the socket's entry of udp_table (an array indexed by cookie, as
// sock_table; udp_socks, a hash, holds the states of sockets whose entry
// another holds) and that flow, reading a clock once a jiffy. Only a
// datagram to a new destination looks at the socket's other flows and
// looks up a rule.
//
// Refusals: a refused connect() takes no state and sends nothing. It
// notes itself in its CPU's run in progress, a record folding refusals of
// one process to one destination in a row (a storm from one client is one
// record counting up); another starts when another process or destination
// is refused, the finished one going into the CPU's log of the last
// LOG_SLOTS. User space maps both into memory and reads them, without a
// system call: to tell a caller whether an EPERM was ours, and for the
// events it shows, every tenth of a second while refusals come. Once none
// came for a while the reader sleeps, and the next refusal rings its bell
// (refusal_bell): a refusal storm costs one wakeup.
//
// Latency samples go to user space on a ring buffer. A record wakes the
// reader only if none did for wake_every_ns (or wake_bytes are waiting);
// the reader polls for the rest.
//
// Requests (cgroup_skb egress/ingress, attached only while a rule asks for
// them): a socket is in flight from its first outbound payload after an
// inbound one until the next inbound payload; that interval is a sample.
//
// Rule identity: user space owns slots in the rules array. A slot carries a
// generation; sockets remember (slot, gen), so a socket of a deleted rule
// never touches the counts of a later rule that reuses its slot.

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_core_read.h>

#include "rule.h"

#define SOCK_STREAM 1
#define SOCK_DGRAM 2
#define IPPROTO_TCP 6
#define IPPROTO_UDP 17
#define BPF_TCP_ESTABLISHED_STATE 1 /* a connected UDP socket's sk_state too */
#define SOL_TCP 6
#define TCP_BPF_SOCK_OPS_CB_FLAGS 1008
#define ETH_P_IP 0x0800
#define ETH_P_IPV6 0x86DD
#define MAX_SCOPE_LEVEL 15
#define HIST_BUCKETS 28

char __license[] SEC("license") = "Dual MIT/GPL";

/* Host-wide counters. */
enum global_counter {
	GLOBAL_SAMPLES_LOST, /* latency samples dropped: ring buffer full */
	GLOBAL_STORAGE,	     /* sockets a build before tracked in socket storage (this one never does) */
	GLOBAL_LEN,
};

enum sample_kind {
	SAMPLE_CONNECT, /* connect()'s first SYN to ESTABLISHED */
	SAMPLE_REQUEST, /* first outbound payload to next inbound payload */
	SAMPLE_LEN,
};

/* rule.flags */
#define RULE_F_ACTIVE (1 << 0)
#define RULE_F_SHADOW (1 << 1)
#define RULE_F_SAMPLES (1 << 2)	 /* send latency samples to user space */
#define RULE_F_REQUESTS (1 << 3) /* track in-flight requests */

/* The transports a rule counts. A rule key's port field holds the port in
 * its low 16 bits and the protocol above them, so that a rule's TCP keys
 * and UDP keys are apart; TCP is 0, what every key of a build before UDP
 * was. */
enum proto {
	PROTO_TCP,
	PROTO_UDP,
	PROTO_LEN,
};
#define PROTO_SHIFT 16

/* Key classes, so that lookups that cannot match are skipped. Each class
 * has a bit for exact keys (a whole address: rule_exact) and one for
 * prefixes (rule_prefixes). config.classes holds the classes in use;
 * scopes holds those of the rules scoped to one cgroup. Each protocol has
 * CLASS_BITS of them: TCP's the low ones, as in builds before UDP. */
#define CLASS_SCOPED_PORT 0
#define CLASS_SCOPED_ANY 1
#define CLASS_HOST_PORT 2
#define CLASS_HOST_ANY 3
#define CLASS_LEN 4
#define EXACT(c) (1u << (c))
#define PREFIX(c) (1u << ((c) + CLASS_LEN))
#define ANY_KEY(c) (EXACT(c) | PREFIX(c))
#define SCOPED_CLASSES (ANY_KEY(CLASS_SCOPED_PORT) | ANY_KEY(CLASS_SCOPED_ANY))
#define PORT_CLASSES (ANY_KEY(CLASS_SCOPED_PORT) | ANY_KEY(CLASS_HOST_PORT))
#define ANYPORT_CLASSES (ANY_KEY(CLASS_SCOPED_ANY) | ANY_KEY(CLASS_HOST_ANY))
#define CLASS_BITS 8
#define CLASS_MASK ((1u << CLASS_BITS) - 1)

struct datapath_config {
	__u32 classes;
	__u32 scope_levels; /* bit L: some scoped rule names a cgroup at depth L */
	/* A record wakes the ring's reader if none did for this long, or
	 * this much data waits; otherwise the reader polls. */
	__u64 wake_every_ns;
	__u64 wake_bytes;
};

/* Finished runs kept in refusal_log per CPU; a power of two. */
#define LOG_SLOTS 2048

/* Rule key: scope and port match exactly, the address by prefix. The
 * first 96 bits (port, scope) are always inside the prefix. IPv4 is
 * ::ffff:a.b.c.d. A whole address is a key of rule_exact, with prefixlen
 * the full 224 bits; a shorter prefix is a key of the rule_prefixes trie. */
struct rule_key {
	__u32 prefixlen;
	__u32 port; /* host byte order; 0 = any port */
	__u64 scope; /* cgroup id; 0 = host-wide */
	__u8 addr[16];
};
#define RULE_KEY_FIXED_BITS 96
#define RULE_KEY_FULL_BITS (RULE_KEY_FIXED_BITS + 128)

/* What user space needs, with the rule's keys, to rebuild its view of a
 * rule after a restart; the programs never read it. */
struct rule_meta {
	__u8 name[64];
	__u64 scope;
	__u32 scope_level;
	__u32 port;
};

/* The count is the buckets' sum: one atomic less per sample. */
struct hist {
	__u64 sum_ns;
	__u64 buckets[HIST_BUCKETS]; /* bucket i: [2^(i-1), 2^i) microseconds */
	__u64 _line[3];
};

/* sock_state.word: the owning socket's cookie << 2 | SS_AWAITING | SS_HELD.
 * Every change of held or awaiting is a compare-and-swap of the whole
 * word, so it happens exactly once and only to the socket that owns it,
 * even while a table entry passes to another socket. */
#define SS_HELD 1ULL
#define SS_AWAITING 2ULL
#define SS_FLAGS (SS_HELD | SS_AWAITING)

/* A cache line each: a tracked connect() touches one line of the table.
 * Fields a build before did not write are zero in the entries it left. */
struct sock_state {
	__u64 word;
	__u32 rule;
	__u32 gen;
	__u8 established;
	__u8 rule_flags;
	/* The callback flags this datapath turned on for the socket that were
	 * off: the only ones it turns off again. */
	__u8 added;
	__u8 overflow; /* the state is in sock_overflow */
	__u8 _pad[4];
	__u64 connect_ns; /* when the first SYN went; 0 before */
	__u64 sent_ns;
	/* The socket's address in the kernel, for the recount to tell a
	 * socket that was freed without giving its slot back (see
	 * sock_alive); 0 in entries a build before took. */
	__u64 sk;
	__u64 _line[2];
};

/* A UDP socket's flows: one per destination it connect()ed to or sent a
 * datagram to with an address, each holding a slot of its rule as a TCP
 * connection does. word is as sock_state's, which makes each flow's
 * release happen once. */
#define UDP_FLOWS 8
#define FLOW_CONNECTED 1 /* udp_flow.flags: the flow of connect(), which does not idle out */

struct udp_flow {
	__u64 word;
	__u32 rule;
	__u32 gen;
	__u64 active_ns; /* bpf_ktime_get_coarse_ns: a datagram egressd last saw go or come */
	__u8 addr[16];
	__u16 port;
	__u8 flags;
	__u8 _pad;
	/* The jiffy of active_ns, whose clock moves once a jiffy: a datagram
	 * in the same jiffy reads no clock (0 in flows a build before took). */
	__u32 tick;
};

struct udp_sock {
	__u64 sk; /* the socket's address, as sock_state.sk */
	struct udp_flow flows[UDP_FLOWS];
};

/* An entry of udp_table: a UDP socket's flows, as in udp_socks, with what
 * lets a datagram find its flow without looking at the others. */
#define UDP_TABLE 1024
struct udp_entry {
	__u64 cookie; /* its socket's; 0: free */
	/* bit i: flow i was taken since the socket took the entry. Every flow
	 * holding a slot has its bit: a release looks at no other. */
	__u32 used;
	__u8 last;	/* the flow the socket's last datagram found or opened */
	__u8 connected; /* some flow was connect()'s since */
	__u8 _pad[2];
	struct udp_sock us;
};

/* A run of refusals of one process to one destination by one rule, on one
 * CPU. A cache line. */
struct refusal_note {
	__u64 time_ns; /* CLOCK_MONOTONIC, the latest */
	__u64 retry_after_ns; /* the latest; 0: no hint */
	__u64 cgroup;
	__u32 seq;   /* the run's number on its CPU, from 1; 0 while written */
	__u32 count; /* refusals folded in */
	__u32 pid;
	__u32 rule;
	__u32 gen;
	__u16 port;
	__u8 shape;
	__u8 shadow; /* NOTE_SHADOW, NOTE_UDP */
	__u8 addr[16];
};
#define NOTE_SHADOW 2 /* would have been refused; admitted in shadow mode (RULE_F_SHADOW, as builds before wrote it) */
#define NOTE_UDP 4    /* a UDP flow's (a send or a connect()), not a TCP connection's */

/* A CPU's run in progress; it goes into refusal_log when another starts.
 * Two cache lines, so that CPUs do not share one. */
struct refusal_run {
	struct refusal_note cur;
	__u64 done; /* runs in refusal_log: cur.seq - 1 once cur is set */
	__u64 _line[7];
};

struct sample {
	__u64 time_ns; /* CLOCK_MONOTONIC, when it ended */
	__u64 latency_ns;
	__u32 rule;
	__u32 gen;
	__u8 kind;
	__u8 _pad[7];
};

/* What a rule's state gained in one set of maps, for egressd_merge to add
 * to another: the loader moves rules to tables of another size while the
 * old programs run, and adds what they counted after its copy. */
struct merge_args {
	__u32 slot;
	__u32 epoch; /* of the state the gains are from, at their end */
	__s64 live;
	__s64 spent;
	__u64 tokens; /* taken from the bucket: subtracted */
	/* That state's bucket and latest clock reading, for a copy it started after */
	__u64 bucket_tokens;
	__u64 refilled_ns;
	__u64 counters[COUNTER_LEN];
	__u64 segment_id[MAX_SEGMENTS];
	__u32 segment_count[MAX_SEGMENTS];
	__u64 hist_sum[SAMPLE_LEN];
	__u64 hist_buckets[SAMPLE_LEN][HIST_BUCKETS];
};

/* What the recount found of a state (sweep_item.what, iter_rec.what). */
enum rec_what {
	REC_HELD = 1,	  /* holds a slot, its socket alive */
	REC_AWAITING = 2, /* and a request is in flight */
	REC_FREED = 4,	  /* its socket was freed holding a slot, which the sweep gave back */
	REC_REMARKED = 8, /* the marks another program took off are back */
	REC_EXPIRED = 16, /* a UDP flow idle for longer than its idle time, which the sweep ended */
};

/* A state for the recount's sweep to look at: user space sets cookie and
 * idx, the sweep the rest. User space hands it the held states, and the
 * overflow table's others, which it removes if their socket was freed. */
struct sweep_item {
	__u64 cookie;
	/* its sock_table entry; SWEEP_OVERFLOW: its sock_overflow entry;
	 * SWEEP_UDP | i: flow i of its udp_socks entry, SWEEP_UDP |
	 * UDP_FLOWS: that entry, which goes if its socket was freed;
	 * SWEEP_UDP | SWEEP_UDP_TABLE | k << 4 | i: the same of entry k of
	 * udp_table, given back if its socket was freed */
	__u32 idx;
	__u32 what; /* enum rec_what; 0: not held (any more) */
	__u32 rule;
	__u32 gen;
	__u64 idle_ns; /* a UDP flow's idle time; 0: none */
};
#define SWEEP_OVERFLOW 0xffffffffu
#define SWEEP_UDP 0x80000000u
#define SWEEP_UDP_TABLE 0x40000000u

/* sweep_args is egressd_sweep's context. */
struct sweep_args {
	__u32 n; /* items in sweep */
};

/* A rule's counts, the head of its rule_state that user space reads of
 * every rule (egressd_counts): the state holds a bpf_spin_lock, so it
 * cannot be mapped into user space's memory, and a lookup of each copies
 * the sliding window's segments too. */
struct rule_counts {
	__s64 live;
	__u64 spent;
	__u64 counters[COUNTER_LEN];
};

/* counts_args is egressd_counts' context. */
struct counts_args {
	__u32 first; /* the slot counts[0] is of */
	__u32 n;     /* slots to copy */
};

/* One socket the remark walk found. */
struct iter_rec {
	__u32 rule;
	__u32 gen;
	__u32 what;
	__u32 _pad;
};

/* A rule's responses, counted apart from its other counters: a response
 * comes in on the CPU that takes the connection's packets, often not the
 * one that sent the request, and one line written from both moved between
 * them at every packet. A cache line each. */
struct response_count {
	__u64 n;
	__u64 _line[7];
};

const struct rule_key *unused_rule_key __attribute__((unused));
const struct response_count *unused_response_count __attribute__((unused));
const struct rule_meta *unused_rule_meta __attribute__((unused));
const struct refusal_note *unused_refusal_note __attribute__((unused));
const struct sample *unused_sample __attribute__((unused));
const struct iter_rec *unused_iter_rec __attribute__((unused));
const struct sweep_item *unused_sweep_item __attribute__((unused));
const struct sweep_args *unused_sweep_args __attribute__((unused));
const struct rule_counts *unused_rule_counts __attribute__((unused));
const struct counts_args *unused_counts_args __attribute__((unused));
const struct udp_sock *unused_udp_sock __attribute__((unused));
const struct udp_entry *unused_udp_entry __attribute__((unused));
const enum proto *unused_proto __attribute__((unused));
const struct sock_state *unused_sock_state __attribute__((unused));
const struct merge_args *unused_merge_args __attribute__((unused));
const enum shape *unused_shape __attribute__((unused));
const enum counter *unused_counter __attribute__((unused));
const enum global_counter *unused_global_counter __attribute__((unused));
const enum sample_kind *unused_sample_kind __attribute__((unused));
const enum rec_what *unused_rec_what __attribute__((unused));

/* sock_table has a power-of-two size; the loader sets its mask, and those
 * of its first entries a socket tries before the rest: the hot part, few
 * enough to stay in the CPU's nearest cache, and the warm part, in its
 * TLB (see find_state). */
volatile const __u32 sock_table_mask = 0;
volatile const __u32 sock_warm_mask = 0;
volatile const __u32 sock_hot_mask = 0;
/* The refusal log has a part per possible CPU; the loader sets how many. */
volatile const __u32 log_cpus = 1;

/* The loader sets max_entries of the rule-indexed maps (MaxRules) and of
 * the key maps. Arrays the programs touch per connection are mmapable only
 * to have page-aligned values: their entries, a multiple of 64 bytes,
 * then start on cache lines. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct datapath_config);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} config SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct rule_key);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rule_exact SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 4096);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct rule_key);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rule_prefixes SEC(".maps");

/* cgroup id -> class bits of the rules scoped to it */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u64);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} scopes SEC(".maps");

/* bit p set: some TCP rule names port p */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 65536 / 64);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} ports SEC(".maps");

/* bit p set: some UDP rule names port p */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 65536 / 64);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} udp_ports SEC(".maps");

/* Where UDP rules' destinations are, whatever their port and scope, for a
 * datagram to look up a rule only if one may hold its address (see
 * udp_ruled). The first UDP_BUCKETS bits are set by prefixes shorter than
 * a network (an IPv4 /24, an IPv6 /48), one for each IPv4 /16 and each
 * IPv6 /32 (its first 16 bits XOR its next 16) they hold; the 1 <<
 * UDP_HASH_BITS after by networks and whole addresses, hashed (see
 * udp_hash): a bit for each address of a prefix of at most 128 (an IPv4
 * /25 or longer, an IPv6 /121 or longer), and one for each network any
 * other longer prefix is in (each of an IPv4 /17 to /23's). */
#define UDP_BUCKETS (2 << 16)
#define UDP_HASH_BITS 20
#define UDP_NET4 0x55555555u /* what a network's hash is salted with */
#define UDP_NET6 0xaaaaaaaau
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, (UDP_BUCKETS + (1 << UDP_HASH_BITS)) / 64);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} udp_dests SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, 4096);
	__type(key, __u32);
	__type(value, struct rule);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rules SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 4096);
	__type(key, __u32);
	__type(value, struct rule_meta);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rule_metas SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, 4096);
	__type(key, __u32);
	__type(value, struct rule_state);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rule_states SEC(".maps");

/* index: rule * SAMPLE_LEN + kind */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, 4096 * SAMPLE_LEN);
	__type(key, __u32);
	__type(value, struct hist);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} latency SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, 4096);
	__type(key, __u32);
	__type(value, struct response_count);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rule_responses SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, GLOBAL_LEN);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} global_counters SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, 65536);
	__type(key, __u32);
	__type(value, struct sock_state);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} sock_table SEC(".maps");

/* The states of tracked sockets whose table entries other live sockets
 * hold, by cookie. A hash rather than socket storage: the recount can walk
 * it, so that a state whose socket was freed without giving its slot back
 * is found (socket storage goes with its socket), and an entry costs less
 * to make. The loader sets max_entries; a socket admitted when it is full
 * goes untracked. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 1 << 18);
	__type(key, __u64);
	__type(value, struct sock_state);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} sock_overflow SEC(".maps");

/* The flows of UDP sockets, by cookie: an entry from a socket's first flow
 * a rule admitted to its release. The loader sets max_entries; a flow
 * admitted when it is full goes untracked. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 1 << 16);
	__type(key, __u64);
	__type(value, struct udp_sock);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} udp_socks SEC(".maps");

/* The flows of UDP sockets, by cookie: the entry a socket's cookie picks,
 * taken at its first flow a rule admitted if no live socket holds it, and
 * given back at its release. Cookies count up, so sockets that come and
 * go one after another take entries a few apart, whose lines stay in the
 * CPU's caches; a socket whose entry another holds keeps its flows in
 * udp_socks. Only the flows in use of an entry are looked at: the last a
 * datagram found, at the next; those taken, at the release. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, UDP_TABLE);
	__type(key, __u32);
	__type(value, struct udp_entry);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} udp_table SEC(".maps");

/* Where builds before put those states; kept so that their sockets are
 * still found. */
struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct sock_state);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} sock_states SEC(".maps");

/* The recount's states to look at, one sweep (egressd_sweep) at a time:
 * user space writes which, the sweep writes what it found. One loader's
 * own, never pinned. */
#define SWEEP_LEN 4096
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, SWEEP_LEN);
	__type(key, __u32);
	__type(value, struct sweep_item);
} sweep SEC(".maps");

/* The counts of COUNTS_LEN rules from counts_args.first on, as
 * egressd_counts copied them, mapped into user space's memory. One
 * loader's own, never pinned. */
#define COUNTS_LEN 4096
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, COUNTS_LEN);
	__type(key, __u32);
	__type(value, struct rule_counts);
} counts SEC(".maps");

/* Per CPU by index, mapped into user space's memory (user space reads
 * them without system calls): refusal_runs[cpu], and run seq of a CPU in
 * refusal_log[cpu * LOG_SLOTS + (seq - 1) % LOG_SLOTS]. The loader sizes
 * them for the possible CPUs. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct refusal_run);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} refusal_runs SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, LOG_SLOTS);
	__type(key, __u32);
	__type(value, struct refusal_note);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} refusal_log SEC(".maps");

/* The refusal reader's bell: once nothing was refused for a while, the
 * reader sets bell_armed[0] to 1 and waits on refusal_bell, and the next
 * refusal sets it back to 0 and rings (a record that wakes the reader). A
 * storm rings once; an idle daemon sleeps. One loader's own, never
 * pinned. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} bell_armed SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 4096);
} refusal_bell SEC(".maps");

/* when a sample last woke the reader */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} woken SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 1 << 20);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} samples SEC(".maps");

/* Kernel types read through BTF. */
struct sock_common {
	unsigned char skc_state;
	struct {
		struct {
			int counter;
		} refs;
	} skc_refcnt;
	struct {
		__s64 counter;
	} skc_cookie;
} __attribute__((preserve_access_index));
struct sock;
struct tcp_sock {
	__u8 bpf_sock_ops_cb_flags;
	__u64 tcp_mstamp;
} __attribute__((preserve_access_index));

extern void *bpf_cast_to_kern_ctx(void *) __ksym;
extern void *bpf_rdonly_cast(const void *obj, __u32 btf_id) __ksym;

/* connect() marks a socket it admitted with RTO_CB, whose callback runs
 * only on a retransmission timeout: the mark costs nothing until then, and
 * unlike STATE_CB it calls sockops for none of the state changes connect()
 * is about to make. Sockops sets STATE_CB once the connection is
 * established. The flags are the socket's, shared with every other sockops
 * program above or below (another egressd's too), so they are hints:
 * sockops, the packet programs and the recount's repair of the marks skip
 * a socket without TRACKED, but no slot depends on them. sock_release, a
 * second connect() and STATE_CB find a socket's state by its cookie,
 * whatever its flags say, and a datapath turns off only the flags it
 * turned on (sock_state.added), once its slot is given back. */
#define TRACKED BPF_SOCK_OPS_RTO_CB_FLAG
/* A tracked socket whose state is not in sock_table's hot part. That
 * callback runs only on a retransmission, and returns at once. Another
 * program may set it too: find_state then looks in the hot part last. */
#define ELSEWHERE BPF_SOCK_OPS_RETRANS_CB_FLAG

static __always_inline __u8 cb_flags(const void *sk)
{
	const struct tcp_sock *tp = bpf_rdonly_cast(sk, bpf_core_type_id_kernel(struct tcp_sock));

	return tp->bpf_sock_ops_cb_flags;
}

/* cookie_of reads a socket's cookie: a load, where bpf_get_socket_cookie
 * is a helper call that also makes one up for a socket that has none. A
 * socket has one once something asked for it (connect() does for every
 * socket it tracks); 0 means none, and so no state of ours. */
static __always_inline __u64 cookie_of(const void *sk)
{
	const struct sock_common *skc = bpf_rdonly_cast(sk, bpf_core_type_id_kernel(struct sock_common));

	return skc->skc_cookie.counter;
}

/* tcp_stamp_ns is TCP's latest time stamp of sk (tcp_mstamp), on
 * bpf_ktime_get_ns's clock to the microsecond: at NEEDS_ECN, when connect()
 * sends its first SYN (tcp_connect() stamps the SYN just before); at
 * ACTIVE_ESTABLISHED, when the SYN-ACK came in (TCP stamps each packet a
 * socket in SYN_SENT takes). A load, where the helper's clock read waits
 * for every load before it. */
static __always_inline __u64 tcp_stamp_ns(const void *sk)
{
	const struct tcp_sock *tp = bpf_rdonly_cast(sk, bpf_core_type_id_kernel(struct tcp_sock));

	return tp->tcp_mstamp * 1000;
}

static __always_inline void count(struct rule_state *st, enum counter c, __s64 delta)
{
	if (c < COUNTER_LEN)
		__sync_fetch_and_add(&st->counters[c], delta);
}

static __always_inline void count_global(__u32 idx)
{
	__u64 *v = bpf_map_lookup_elem(&global_counters, &idx);

	/* Atomic even per CPU: a softirq program may interrupt a process
	 * context one on the same CPU. */
	if (v)
		__sync_fetch_and_add(v, 1);
}

static __always_inline __u64 wake_flags(void *ring, const struct datapath_config *cfg, __u64 now)
{
	__u32 zero = 0;
	__u64 *last = bpf_map_lookup_elem(&woken, &zero);

	if (bpf_ringbuf_query(ring, BPF_RB_AVAIL_DATA) >= cfg->wake_bytes)
		return BPF_RB_FORCE_WAKEUP;
	if (!last)
		return 0; /* the kernel's own choice */
	__u64 l = *last;
	if (now - l >= cfg->wake_every_ns && __sync_val_compare_and_swap(last, l, now) == l)
		return BPF_RB_FORCE_WAKEUP;
	return BPF_RB_NO_WAKEUP;
}

static __always_inline struct datapath_config *get_config(void)
{
	__u32 zero = 0;

	return bpf_map_lookup_elem(&config, &zero);
}

static __always_inline __u32 log2_u64(__u64 v)
{
	__u32 r = 0;

	if (v >> 32) { v >>= 32; r += 32; }
	if (v >> 16) { v >>= 16; r += 16; }
	if (v >> 8) { v >>= 8; r += 8; }
	if (v >> 4) { v >>= 4; r += 4; }
	if (v >> 2) { v >>= 2; r += 2; }
	if (v >> 1) { r += 1; }
	return r;
}

static __always_inline void record_latency(__u32 slot, __u32 gen, __u8 flags,
					   enum sample_kind kind, __u64 now, __u64 ns)
{
	__u32 idx = slot * SAMPLE_LEN + kind;
	struct hist *h = bpf_map_lookup_elem(&latency, &idx);

	if (h) {
		__u64 us = ns / 1000;
		__u32 b = us ? log2_u64(us) + 1 : 0;

		if (b >= HIST_BUCKETS)
			b = HIST_BUCKETS - 1;
		__sync_fetch_and_add(&h->sum_ns, ns);
		__sync_fetch_and_add(&h->buckets[b], 1);
	}
	if (!(flags & RULE_F_SAMPLES))
		return;
	struct datapath_config *cfg = get_config();
	if (!cfg)
		return;
	struct sample *s = bpf_ringbuf_reserve(&samples, sizeof(*s), 0);
	if (!s) {
		count_global(GLOBAL_SAMPLES_LOST);
		return;
	}
	s->time_ns = now;
	s->latency_ns = ns;
	s->rule = slot;
	s->gen = gen;
	s->kind = kind;
	bpf_ringbuf_submit(s, wake_flags(&samples, cfg, now));
}

/* entry_of returns the table entry idx if it is the socket's. */
static __always_inline struct sock_state *entry_of(__u32 idx, __u64 cookie)
{
	struct sock_state *ss = bpf_map_lookup_elem(&sock_table, &idx);

	return ss && ss->word >> 2 == cookie ? ss : 0;
}

/* find_state returns the state of a tracked socket (flags: its callback
 * flags): a sock_table entry while the entry is its own, else its entry
 * in sock_overflow (or the socket storage a build before used). A socket's entry is the one its cookie picks in the table's hot
 * part, else (ELSEWHERE) the one it picks in the warm part, else in the
 * whole table. Cookies count up, so sockets that come and go one after
 * another reuse the hot part's few lines, still in the CPU's nearest
 * cache; the warm part's were last touched a thousand sockets before, but
 * on pages the TLB still holds; the whole table's, a table's length of
 * sockets before. An unmarked socket not in the hot part is one a build
 * before admitted: in the warm part (that build's hot part) or, before
 * that, in the whole table; the later probes find those. */
static __always_inline struct sock_state *find_state(void *sk, __u64 cookie, __u8 flags)
{
	__u32 hot = cookie & sock_hot_mask, warm = cookie & sock_warm_mask, far = cookie & sock_table_mask;
	struct sock_state *ss;

	if (!(flags & ELSEWHERE) && (ss = entry_of(hot, cookie)))
		return ss;
	if (warm != hot && (ss = entry_of(warm, cookie)))
		return ss;
	if (far != warm && (ss = entry_of(far, cookie)))
		return ss;
	if ((ss = bpf_map_lookup_elem(&sock_overflow, &cookie)))
		return ss;
	ss = bpf_sk_storage_get(&sock_states, sk, 0, 0);
	if (ss || !(flags & ELSEWHERE))
		return ss;
	return entry_of(hot, cookie);
}

/* Gives back the slot of the socket at addr; every path calls this, only
 * the first caller does anything. What the state says of the slot is read
 * while the socket holds it: once released, a table entry may pass to
 * another socket at once. A table entry's address goes first, while the
 * entry is still the socket's: the recount then never takes a later owner,
 * whose address is not yet written, for this socket, freed. An overflow
 * entry is the socket's for good (its key is the cookie), and keeps it.
 * Returns 1 if this call gave a slot back to its rule. */
static __always_inline int release(struct sock_state *ss, __u64 cookie, __u64 addr)
{
	__u8 overflow = ss->overflow;

	if (!overflow)
		__sync_val_compare_and_swap(&ss->sk, addr, 0);
	__u64 w = ss->word;
	__u32 slot = ss->rule, gen = ss->gen, established = ss->established;
	int done = 0;

	/* Bounded: each failed swap means the word changed under us, which
	 * only arming or disarming a request does. */
	for (int i = 0; i < 8 && !done; i++) {
		if (w >> 2 != cookie || !(w & SS_HELD))
			return 0;
		__u64 got = __sync_val_compare_and_swap(&ss->word, w, cookie << 2);
		done = got == w;
		if (!done)
			w = got;
	}
	if (!done)
		return 0; /* still held: the next path releases it */

	struct rule *r = bpf_map_lookup_elem(&rules, &slot);
	if (!r || r->gen != gen)
		return 0; /* a retired rule's socket: nothing of the slot's rule now */
	struct rule_state *st = bpf_map_lookup_elem(&rule_states, &slot);
	if (!st)
		return 0;
	__sync_fetch_and_add(&st->live, -1);
	count(st, COUNTER_RELEASED, 1);
	if (!established)
		count(st, COUNTER_CONNECT_FAILED, 1);
	if (w & SS_AWAITING)
		count(st, COUNTER_ABORTED, 1);
	return 1;
}

static __always_inline long lookup_class(struct rule_key *key, __u32 cls, int c,
					 __u64 scope, __u32 port)
{
	__u32 *slot;

	key->scope = scope;
	key->port = port;
	if (cls & EXACT(c)) {
		slot = bpf_map_lookup_elem(&rule_exact, key);
		if (slot)
			return *slot;
	}
	if (cls & PREFIX(c)) {
		slot = bpf_map_lookup_elem(&rule_prefixes, key);
		if (slot)
			return *slot;
	}
	return -1;
}

static __always_inline int port_has_rules(__u32 port, int proto)
{
	__u32 word = port / 64;
	__u64 *bits = bpf_map_lookup_elem(proto == PROTO_UDP ? (void *)&udp_ports : (void *)&ports, &word);

	return bits && (*bits & (1ULL << (port % 64)));
}

/* DNS (53) and DNS over TLS (853) are limited only by rules that name the
 * port: a rule on any port of an address that is also the host's resolver
 * must not keep names from resolving. */
static __always_inline int dns_port(__u32 port)
{
	return port == 53 || port == 853;
}

/* scope_walk carries find_rule's scoped lookups through bpf_loop: one
 * verified body for every level, where an unrolled loop of fifteen made the
 * verifier walk a million instructions. */
struct scope_walk {
	struct rule_key key;
	__u32 classes;
	__u32 levels;
	__u32 port; /* with the protocol above it, as in rule_key */
	__u32 shift; /* the protocol's classes in scopes' values */
	long slot;
};

static long scope_step(__u64 i, struct scope_walk *w)
{
	int lvl = MAX_SCOPE_LEVEL - (int)i;

	if (lvl < 1 || !(w->levels & (1u << lvl)))
		return 0;
	__u64 id = bpf_get_current_ancestor_cgroup_id(lvl);
	if (!id)
		return 0;
	__u32 *cls = bpf_map_lookup_elem(&scopes, &id);
	if (!cls)
		return 0;
	__u32 c = (*cls >> (w->shift & 31)) & w->classes;
	long slot = lookup_class(&w->key, c, CLASS_SCOPED_PORT, id, w->port);
	if (slot < 0)
		slot = lookup_class(&w->key, c, CLASS_SCOPED_ANY, id, w->port & ~0xffffu);
	if (slot < 0)
		return 0;
	w->slot = slot;
	return 1;
}

/* Most specific first: a deeper scope over a shallower one over host-wide,
 * a port over any port, and within each the longest prefix (a whole
 * address in rule_exact over the trie's prefixes), among the rules of the
 * protocol. The scope is the cgroup of the process calling connect() or
 * sending; these programs cannot read the socket's own cgroup, which
 * differs only for a socket created before its process moved. */
static __always_inline long find_rule(struct rule_key *key, const struct datapath_config *cfg, int proto)
{
	__u32 port = key->port;
	__u32 shift = proto * CLASS_BITS;
	__u32 classes = (cfg->classes >> (shift & 31)) & CLASS_MASK;
	__u32 tagged = port | (__u32)proto << PROTO_SHIFT, any = (__u32)proto << PROTO_SHIFT;
	long slot;

	if (!((classes & PORT_CLASSES) && port_has_rules(port, proto)))
		classes &= ~PORT_CLASSES;
	if (dns_port(port))
		classes &= ~ANYPORT_CLASSES;
	if (classes & SCOPED_CLASSES) {
		struct scope_walk w = {.key = *key, .classes = classes, .levels = cfg->scope_levels, .port = tagged, .shift = shift, .slot = -1};

		bpf_loop(MAX_SCOPE_LEVEL, scope_step, &w, 0);
		if (w.slot >= 0)
			return w.slot;
	}
	if ((slot = lookup_class(key, classes, CLASS_HOST_PORT, 0, tagged)) >= 0)
		return slot;
	return lookup_class(key, classes, CLASS_HOST_ANY, 0, any);
}

/* window_wait runs take_window for a rule slot as a global function: the
 * verifier checks it once and sees its result as any number, where the
 * states the window's loop leaves would multiply through the rest of
 * connect(). */
__attribute__((noinline)) __u64 window_wait(__u32 slot, __u64 now)
{
	struct rule *r = bpf_map_lookup_elem(&rules, &slot);
	struct rule_state *st = bpf_map_lookup_elem(&rule_states, &slot);

	if (!r || !st)
		return 0;
	return take_window(st, r, now);
}

static __always_inline int same_addr(const __u8 *a, const __u8 *b)
{
	const __u64 *x = (const __u64 *)a, *y = (const __u64 *)b;

	return x[0] == y[0] && x[1] == y[1];
}

/* ring_bell wakes the refusal reader if it asked to be woken. */
static __always_inline void ring_bell(void)
{
	__u32 zero = 0;
	__u32 *armed = bpf_map_lookup_elem(&bell_armed, &zero);

	if (armed && *armed && __sync_val_compare_and_swap(armed, 1, 0) == 1)
		bpf_ringbuf_output(&refusal_bell, &zero, sizeof(zero), BPF_RB_FORCE_WAKEUP);
}

/* note_refusal folds a refusal into its CPU's run in progress when that is
 * the same process, destination and rule, and else moves the run into the
 * log and starts another. The CPU's own data, written without atomics:
 * should a preempted program share it, an event's count may miss a refusal
 * (the rule's counts do not). A run's seq is 0 while it is written and set
 * last, with a barrier, for user space reading along. */
static __always_inline void note_refusal(const struct rule_key *key, __u16 port, __u32 slot,
					 const struct rule *r, __u64 now, __u64 wait, __u8 shadow)
{
	__u32 cpu = bpf_get_smp_processor_id();
	struct refusal_run *run = bpf_map_lookup_elem(&refusal_runs, &cpu);
	__u32 pid = bpf_get_current_pid_tgid() >> 32;

	if (!run || cpu >= log_cpus)
		return;
	struct refusal_note *n = &run->cur;
	if (n->seq && n->pid == pid && n->port == port && n->rule == slot && n->gen == r->gen &&
	    n->shadow == shadow && same_addr(n->addr, key->addr)) {
		n->time_ns = now;
		n->retry_after_ns = wait;
		n->count++;
		ring_bell();
		return;
	}
	if (n->seq) {
		__u32 idx = cpu * LOG_SLOTS + ((n->seq - 1) & (LOG_SLOTS - 1));
		struct refusal_note *done = bpf_map_lookup_elem(&refusal_log, &idx);
		if (done) {
			done->seq = 0;
			done->time_ns = n->time_ns;
			done->retry_after_ns = n->retry_after_ns;
			done->cgroup = n->cgroup;
			done->count = n->count;
			done->pid = n->pid;
			done->rule = n->rule;
			done->gen = n->gen;
			done->port = n->port;
			done->shape = n->shape;
			done->shadow = n->shadow;
			__builtin_memcpy(done->addr, n->addr, sizeof(done->addr));
			__sync_lock_test_and_set(&done->seq, n->seq);
			run->done = n->seq;
		}
	}
	__u32 seq = run->done + 1;
	n->seq = 0;
	n->time_ns = now;
	n->retry_after_ns = wait;
	n->cgroup = bpf_get_current_cgroup_id();
	n->count = 1;
	n->pid = pid;
	n->rule = slot;
	n->gen = r->gen;
	n->port = port;
	n->shape = r->shape;
	n->shadow = shadow;
	__builtin_memcpy(n->addr, key->addr, sizeof(n->addr));
	__sync_lock_test_and_set(&n->seq, seq);
	ring_bell();
}

/* take_entry holds the table entry idx for the socket if no live socket
 * holds it. */
static __always_inline struct sock_state *take_entry(__u32 idx, __u64 mine)
{
	struct sock_state *ss = bpf_map_lookup_elem(&sock_table, &idx);

	if (!ss)
		return 0;
	__u64 w = ss->word;
	if (!(w & SS_FLAGS) && __sync_val_compare_and_swap(&ss->word, w, mine | SS_HELD) == w)
		return ss;
	return 0;
}

/* claim_state finds an admitted socket a place for its state and marks it
 * held: its own entry, a table entry no live socket holds (the hot part's
 * first, then the warm part's, see find_state), or a new entry in
 * sock_overflow. *mark is the ELSEWHERE flag the place needs. Held before
 * it is filled: no other socket takes it meanwhile, and no program runs
 * for this socket until connect() returns. */
static __always_inline struct sock_state *claim_state(__u64 cookie, struct sock_state *own, __u8 *mark)
{
	__u64 mine = cookie << 2;
	__u32 hot = cookie & sock_hot_mask, warm = cookie & sock_warm_mask, far = cookie & sock_table_mask;
	struct sock_state *ss;

	/* Another socket may have taken our released table entry. Ours,
	 * it keeps the mark it was found by. */
	if (own && __sync_val_compare_and_swap(&own->word, mine, mine | SS_HELD) == mine)
		return own;
	*mark = 0;
	if ((ss = take_entry(hot, mine)))
		return ss;
	*mark = ELSEWHERE;
	if (warm != hot && (ss = take_entry(warm, mine)))
		return ss;
	if (far != warm && (ss = take_entry(far, mine)))
		return ss;
	struct sock_state fresh = {.word = mine | SS_HELD, .overflow = 1};
	if (bpf_map_update_elem(&sock_overflow, &cookie, &fresh, BPF_NOEXIST))
		return 0;
	return bpf_map_lookup_elem(&sock_overflow, &cookie);
}

/* unhold gives up a state claim_state held, before anything counted it. */
static __always_inline void unhold(struct sock_state *ss, __u64 cookie)
{
	if (!ss->overflow)
		ss->sk = 0;
	__sync_lock_test_and_set(&ss->word, cookie << 2);
}

/* active_rule finds the rule of proto that applies to a new connection or
 * flow to key, with its state; -1 if none does, or if a program that ran
 * before this one (another datapath's, on a cgroup below) refused: the
 * call fails whatever this one says, so it takes nothing and counts
 * nothing. The lookups write the port of each class they try into the
 * key. */
static __always_inline long active_rule(struct rule_key *key, int proto, struct rule **rp, struct rule_state **stp)
{
	struct datapath_config *cfg = get_config();

	if (!cfg || !cfg->classes)
		return -1;
	long found = find_rule(key, cfg, proto);
	if (found < 0)
		return -1;
	__u32 slot = found;
	struct rule *r = bpf_map_lookup_elem(&rules, &slot);
	if (!r || !(r->flags & RULE_F_ACTIVE))
		return -1;
	struct rule_state *st = bpf_map_lookup_elem(&rule_states, &slot);
	if (!st)
		return -1;
	if (bpf_get_retval() < 0)
		return -1;
	*rp = r;
	*stp = st;
	return slot;
}

/* take_slot runs the rule's shape for one new TCP connection or UDP flow
 * to port: 1 if it takes a slot (counted live; the caller gives it back
 * if it can keep no state for it), 0 if it refuses (counted and noted,
 * the rule's errno set). In shadow mode a refusal is noted and the slot
 * taken. */
static __always_inline int take_slot(struct rule_key *key, __u16 port, __u32 slot, struct rule *r,
				     struct rule_state *st, int proto)
{
	/* The clock only where the shape needs it, or at a refusal: a read
	 * costs about 0.1 us here, a tenth of an admission. */
	__u64 now = 0;
	int shadow = r->flags & RULE_F_SHADOW;
	__u64 wait = 0;
	int refuse = 0;

	switch (r->shape) {
	case SHAPE_CONCURRENCY: {
		__u32 limit = r->limit;

		if (r->until_ns && (now = bpf_ktime_get_ns()) >= r->until_ns)
			limit = r->limit_after;
		if (__sync_fetch_and_add(&st->live, 1) >= (__s64)limit) {
			refuse = 1;
			if (!shadow)
				__sync_fetch_and_add(&st->live, -1);
		}
		break;
	}
	case SHAPE_PER_SECOND:
		now = bpf_ktime_get_ns();
		wait = take_token(st, r, now);
		refuse = wait != 0;
		if (!refuse || shadow)
			__sync_fetch_and_add(&st->live, 1);
		break;
	case SHAPE_PER_WINDOW:
		now = bpf_ktime_get_ns();
		wait = window_wait(slot, now);
		refuse = wait != 0;
		if (!refuse || shadow)
			__sync_fetch_and_add(&st->live, 1);
		break;
	case SHAPE_GRANTED:
		/* Count first, then compare: user space handing permits back
		 * lowers granted and then reads spent, so every permit it sees
		 * unspent stays so. No wait is known: more come when user space
		 * claims them. */
		if (__sync_fetch_and_add(&st->spent, 1) >= r->granted) {
			refuse = 1;
			if (!shadow)
				__sync_fetch_and_add(&st->spent, -1);
		}
		if (!refuse || shadow)
			__sync_fetch_and_add(&st->live, 1);
		break;
	default:
		return 0;
	}

	if (refuse) {
		if (!now)
			now = bpf_ktime_get_ns();
		count(st, shadow ? COUNTER_SHADOW_REFUSED : COUNTER_REFUSED, 1);
		note_refusal(key, port, slot, r, now, wait, (shadow ? NOTE_SHADOW : 0) | (proto == PROTO_UDP ? NOTE_UDP : 0));
		if (!shadow) {
			if (r->refuse_errno)
				bpf_set_retval(-(int)r->refuse_errno);
			return 0;
		}
	}
	return 1;
}

static __always_inline int on_connect(struct bpf_sock_addr *ctx, struct rule_key *key)
{
	struct bpf_sock *sk = ctx->sk;
	struct sock_state *own = 0;
	__u64 cookie = 0;

	if (!sk)
		return 1;
	int flags = cb_flags(sk);
	/* connect() runs this hook only on an unconnected socket, so a slot
	 * still held belongs to an attempt that already failed. Found by the
	 * cookie, not the mark, which another program may have cleared. */
	cookie = cookie_of(sk);
	if (cookie) {
		own = find_state(sk, cookie, flags);
		if (own)
			release(own, cookie, (__u64)sk);
	}

	__u16 port = key->port;
	struct rule *r;
	struct rule_state *st;
	long found = active_rule(key, PROTO_TCP, &r, &st);
	if (found < 0)
		return 1;
	__u32 slot = found;
	if (!take_slot(key, port, slot, r, st, PROTO_TCP))
		return 0;

	/* Admitted: the socket takes its state only now. */
	if (!cookie)
		cookie = bpf_get_socket_cookie(ctx);
	__u8 mark = flags & ELSEWHERE;
	struct sock_state *ss = claim_state(cookie, own, &mark);
	if (ss) {
		__u8 add = (TRACKED | mark) & ~flags;

		ss->rule = slot;
		ss->gen = r->gen;
		ss->rule_flags = r->flags;
		ss->established = 0;
		ss->connect_ns = 0; /* sockops' NEEDS_ECN, as the SYN goes */
		/* Its own entry again keeps what an earlier attempt added. */
		ss->added = (ss == own ? ss->added : 0) | add;
		ss->sk = (__u64)sk;
		flags |= add;
		if (!bpf_setsockopt(ctx, SOL_TCP, TCP_BPF_SOCK_OPS_CB_FLAGS, &flags, sizeof(flags))) {
			count(st, COUNTER_ADMITTED, 1);
			return 1;
		}
		unhold(ss, cookie);
	}
	/* Fail open rather than refuse for want of memory. */
	__sync_fetch_and_add(&st->live, -1);
	count(st, COUNTER_UNTRACKED, 1);
	return 1;
}

/* give_back gives a UDP flow's slot back; every path calls this, only the
 * first caller does anything (as release, for a socket's state). Returns
 * 1 if this call gave a slot back to its rule. */
static __always_inline int give_back(struct udp_flow *f, __u64 cookie)
{
	__u64 held = cookie << 2 | SS_HELD;
	__u32 slot = f->rule, gen = f->gen;

	if (f->word != held || __sync_val_compare_and_swap(&f->word, held, cookie << 2) != held)
		return 0;
	struct rule *r = bpf_map_lookup_elem(&rules, &slot);
	if (!r || r->gen != gen)
		return 0;
	struct rule_state *st = bpf_map_lookup_elem(&rule_states, &slot);
	if (!st)
		return 0;
	__sync_fetch_and_add(&st->live, -1);
	count(st, COUNTER_RELEASED, 1);
	return 1;
}

/* udp_dest reports whether f is the flow to addr and port. */
static __always_inline int udp_dest(const struct udp_flow *f, const __u8 *addr, __u16 port)
{
	return f->port == port && same_addr(f->addr, addr);
}

/* udp_hash is the bit of udp_dests of a network or address whose words,
 * as loaded, XOR to folded (with a network's salt). */
static __always_inline __u32 udp_hash(__u32 folded)
{
	return UDP_BUCKETS + (folded * 0x9e3779b1u >> (32 - UDP_HASH_BITS));
}

static __always_inline int udp_bit(__u32 b)
{
	__u32 word = b / 64;
	__u64 *bits = bpf_map_lookup_elem(&udp_dests, &word);

	return bits && (*bits >> (b % 64) & 1);
}

/* udp_ruled4 reports whether some UDP rule's destinations may hold an IPv4
 * address (as user_ip4), and udp_ruled the same of any: a send elsewhere
 * no rule limits, and costs three array lookups. */
static __always_inline int udp_ruled4(__u32 ip)
{
	return udp_bit(bpf_ntohl(ip) >> 16) || udp_bit(udp_hash((ip & bpf_htonl(0xffffff00)) ^ UDP_NET4)) ||
	       udp_bit(udp_hash(ip ^ bpf_htonl(0xffff)));
}

static __always_inline int udp_ruled(const __u8 *addr)
{
	const __u32 *w = (const __u32 *)addr;

	if (!w[0] && !w[1] && w[2] == bpf_htonl(0xffff))
		return udp_ruled4(w[3]);
	return udp_bit(65536 + (((__u32)addr[0] << 8 | addr[1]) ^ ((__u32)addr[2] << 8 | addr[3]))) ||
	       udp_bit(udp_hash(w[0] ^ (w[1] & bpf_htonl(0xffff0000)) ^ UDP_NET6)) ||
	       udp_bit(udp_hash(w[0] ^ w[1] ^ w[2] ^ w[3]));
}

/* udp_stamp says a datagram of f went or came now. */
static __always_inline void udp_stamp(struct udp_flow *f)
{
	__u32 tick = bpf_jiffies64();

	if (f->tick != tick) {
		f->tick = tick;
		f->active_ns = bpf_ktime_get_coarse_ns();
	}
}

/* udp_walk carries a scan of a socket's flows through bpf_loop. */
struct udp_walk {
	struct udp_sock *us;
	__u64 cookie;
	__u8 addr[16];
	__u16 port;
	__u8 give_back; /* give back what the scan passes (see udp_step) */
	__u8 connected; /* the socket is connected: keep its connect() flow */
	int found;	/* the flow to addr:port */
	int free;	/* a flow that holds nothing */
	int oldest;	/* the flow idle longest, of those not connect()'s */
	__u64 oldest_ns;
};

/* udp_step looks at flow i: the one to the walk's destination, one that
 * holds nothing, the one idle longest. With give_back set it gives back
 * every flow's slot (the socket's release); otherwise that of a connect()
 * flow of a socket no longer connected (a connect(AF_UNSPEC), which runs
 * no hook). */
static long udp_step(__u64 i, struct udp_walk *w)
{
	if (i >= UDP_FLOWS)
		return 1;
	struct udp_flow *f = &w->us->flows[i];
	__u64 held = w->cookie << 2 | SS_HELD;

	if (w->give_back || ((f->flags & FLOW_CONNECTED) && !w->connected)) {
		give_back(f, w->cookie);
		if (w->give_back)
			return 0;
	}
	if (f->word != held) {
		if (w->free < 0)
			w->free = i;
		return 0;
	}
	if (w->found < 0 && !(f->flags & FLOW_CONNECTED) && udp_dest(f, w->addr, w->port))
		w->found = i;
	if (!(f->flags & FLOW_CONNECTED) && (w->oldest < 0 || f->active_ns < w->oldest_ns)) {
		w->oldest = i;
		w->oldest_ns = f->active_ns;
	}
	return 0;
}

/* What a UDP socket's entry of udp_socks starts as. */
const struct udp_sock empty_udp_sock = {};

/* udp_flow_of returns flow i of us; none for a negative i. */
static __always_inline struct udp_flow *udp_flow_of(struct udp_sock *us, int i)
{
	__u32 k = i;

	if (k >= UDP_FLOWS)
		return 0;
	return &us->flows[k & (UDP_FLOWS - 1)];
}

/* udp_state returns the flows of the socket with cookie: its entry of
 * udp_table (*e set), else its entry of udp_socks; 0 if it has none. */
static __always_inline struct udp_sock *udp_state(__u64 cookie, struct udp_entry **e)
{
	__u32 idx = cookie & (UDP_TABLE - 1);
	struct udp_entry *t;

	*e = 0;
	if (!cookie)
		return 0;
	t = bpf_map_lookup_elem(&udp_table, &idx);
	if (t && t->cookie == cookie) {
		*e = t;
		return &t->us;
	}
	return bpf_map_lookup_elem(&udp_socks, &cookie);
}

/* udp_last returns the flow to addr and port if it is the one the
 * socket's last datagram found or opened, still the socket's and of its
 * rule's current generation. A connect() flow is not one: a datagram of
 * it goes to an address only on a socket disconnected since, which the
 * scan that ends that flow must look at. */
static __always_inline struct udp_flow *udp_last(struct udp_entry *e, __u64 cookie, const __u8 *addr, __u16 port)
{
	struct udp_flow *f = udp_flow_of(&e->us, e->last);

	if (!f || f->word != (cookie << 2 | SS_HELD) || (f->flags & FLOW_CONNECTED) || !udp_dest(f, addr, port))
		return 0;
	__u32 slot = f->rule;
	struct rule *r = bpf_map_lookup_elem(&rules, &slot);
	return r && r->gen == f->gen ? f : 0;
}

/* udp_end gives back every flow of a socket's state and frees it: an
 * entry of udp_table once its address is gone (the sweep takes an entry
 * without one for a live socket's), an entry of udp_socks deleted. */
static __always_inline void udp_end(struct udp_sock *us, struct udp_entry *e, __u64 cookie)
{
	struct udp_walk w = {.us = us, .cookie = cookie, .give_back = 1, .free = -1, .found = -1, .oldest = -1};

	if (!e) {
		bpf_loop(UDP_FLOWS, udp_step, &w, 0);
		bpf_map_delete_elem(&udp_socks, &cookie);
		return;
	}
	__u32 used = e->used, n = 0;
	for (int i = 0; i < UDP_FLOWS; i++)
		if (used >> i)
			n = i + 1;
	bpf_loop(n, udp_step, &w, 0);
	e->used = 0;
	e->last = 0;
	e->connected = 0;
	__sync_lock_test_and_set(&e->us.sk, 0);
	__sync_val_compare_and_swap(&e->cookie, cookie, 0);
}

/* udp_admit runs a rule for a new UDP flow of the socket, to key's
 * destination, and gives it a place among the socket's flows: one that
 * holds nothing, else the one idle longest, whose slot it gives back (its
 * next datagram is a new flow). A socket without flows takes the entry of
 * udp_table its cookie picks if no live socket holds it, else one of
 * udp_socks. Returns 0 if refused. */
static __always_inline int udp_admit(struct bpf_sock_addr *ctx, struct rule_key *key, __u64 cookie,
				     struct udp_sock *us, struct udp_entry *e, struct udp_walk *w, __u8 flags)
{
	__u16 port = key->port;
	struct rule *r;
	struct rule_state *st;
	long found = active_rule(key, PROTO_UDP, &r, &st);
	if (found < 0)
		return 1;
	__u32 slot = found;
	if (!take_slot(key, port, slot, r, st, PROTO_UDP))
		return 0;

	if (!cookie)
		cookie = bpf_get_socket_cookie(ctx);
	if (!us) {
		__u32 idx = cookie & (UDP_TABLE - 1);
		struct udp_entry *t = bpf_map_lookup_elem(&udp_table, &idx);
		/* Another of the socket's threads may have taken a place
		 * meanwhile: then its flows are looked at first. */
		__u64 was = t ? __sync_val_compare_and_swap(&t->cookie, 0, cookie) : 1;

		if (t && (was == 0 || was == cookie)) {
			e = t;
			us = &t->us;
			if (!was)
				t->us.sk = (__u64)ctx->sk;
		} else if (!bpf_map_update_elem(&udp_socks, &cookie, &empty_udp_sock, BPF_NOEXIST)) {
			us = bpf_map_lookup_elem(&udp_socks, &cookie);
			if (us)
				us->sk = (__u64)ctx->sk;
			was = 0;
		} else {
			us = bpf_map_lookup_elem(&udp_socks, &cookie);
			was = cookie;
		}
		w->us = us;
		w->free = 0;
		w->oldest = -1;
		if (us && was) {
			w->free = -1;
			bpf_loop(UDP_FLOWS, udp_step, w, 0);
		}
	}
	struct udp_flow *f = 0;
	int i = w->free >= 0 ? w->free : w->oldest;
	if (us) {
		f = udp_flow_of(us, i);
		if (f && w->free < 0)
			give_back(f, cookie);
	}
	if (!f) {
		/* Fail open rather than refuse for want of memory. */
		__sync_fetch_and_add(&st->live, -1);
		count(st, COUNTER_UNTRACKED, 1);
		return 1;
	}
	if (e) {
		/* Before the flow holds: a release then looks at it. */
		__sync_fetch_and_or(&e->used, 1u << (i & (UDP_FLOWS - 1)));
		e->last = i;
		if (flags & FLOW_CONNECTED)
			e->connected = 1;
	}
	f->rule = slot;
	f->gen = r->gen;
	f->tick = bpf_jiffies64();
	f->active_ns = bpf_ktime_get_coarse_ns();
	__builtin_memcpy(f->addr, key->addr, sizeof(f->addr));
	f->port = port;
	f->flags = flags;
	__sync_lock_test_and_set(&f->word, cookie << 2 | SS_HELD);
	count(st, COUNTER_ADMITTED, 1);
	return 1;
}

/* on_udp_connect admits a connected UDP socket's flow: the one it had
 * before (an earlier connect()) ends, the new one is admitted or refused
 * as a TCP connection is. It ends at the next connect(), the socket's
 * release, or, after a connect(AF_UNSPEC) (which runs no hook), at the
 * socket's next send to an address, or its release. */
static __always_inline int on_udp_connect(struct bpf_sock_addr *ctx, struct rule_key *key)
{
	struct bpf_sock *sk = ctx->sk;

	if (!sk)
		return 1;
	__u64 cookie = cookie_of(sk);
	struct udp_entry *e;
	struct udp_sock *us = udp_state(cookie, &e);
	struct udp_walk w = {.us = us, .cookie = cookie, .free = -1, .found = -1, .oldest = -1};

	if (us)
		bpf_loop(UDP_FLOWS, udp_step, &w, 0);
	return udp_admit(ctx, key, cookie, us, e, &w, FLOW_CONNECTED);
}

/* on_sendmsg runs for a datagram sent to an address (unconnected UDP, as
 * most QUIC stacks send) that some UDP rule's destinations may hold (see
 * udp_dests): the first to a destination opens the socket's flow to it,
 * admitted or refused; the later ones only say it is active. A datagram
 * on the flow the socket's last datagram found looks at no other. */
static __always_inline int on_sendmsg(struct bpf_sock_addr *ctx, struct rule_key *key)
{
	struct bpf_sock *sk = ctx->sk;
	struct datapath_config *cfg = get_config();

	if (!sk || !cfg)
		return 1;
	/* Sends no UDP rule could limit cost a test or two. */
	__u32 udp = cfg->classes >> CLASS_BITS & CLASS_MASK;
	__u16 port = key->port;
	if (!udp)
		return 1;
	if (!((udp & ANYPORT_CLASSES) && !dns_port(port)) && !((udp & PORT_CLASSES) && port_has_rules(port, PROTO_UDP)))
		return 1;
	__u64 cookie = cookie_of(sk);
	struct udp_entry *e;
	struct udp_sock *us = udp_state(cookie, &e);
	int connected = sk->state == BPF_TCP_ESTABLISHED_STATE;
	struct udp_flow *f;

	if (e && (connected || !e->connected) && (f = udp_last(e, cookie, key->addr, port))) {
		udp_stamp(f);
		return 1;
	}
	struct udp_walk w = {.us = us, .cookie = cookie, .port = port, .connected = connected, .free = -1, .found = -1, .oldest = -1};

	if (us) {
		__builtin_memcpy(w.addr, key->addr, sizeof(w.addr));
		bpf_loop(UDP_FLOWS, udp_step, &w, 0);
		f = udp_flow_of(us, w.found);
		if (f) {
			/* A flow of a rule deleted or replaced since is counted
			 * anew. */
			__u32 slot = f->rule;
			struct rule *r = bpf_map_lookup_elem(&rules, &slot);

			if (r && r->gen == f->gen) {
				udp_stamp(f);
				if (e)
					e->last = w.found;
				return 1;
			}
			give_back(f, cookie);
			w.free = w.found;
		}
	}
	return udp_admit(ctx, key, cookie, us, e, &w, 0);
}

/* on_recvmsg runs for a datagram received with its source asked for:
 * the flow to that source is active. */
static __always_inline int on_recvmsg(struct bpf_sock_addr *ctx, struct rule_key *key)
{
	struct bpf_sock *sk = ctx->sk;

	if (!sk)
		return 1;
	__u64 cookie = cookie_of(sk);
	struct udp_entry *e;
	struct udp_sock *us = udp_state(cookie, &e);
	if (!us)
		return 1;
	struct udp_flow *f = e ? udp_last(e, cookie, key->addr, key->port) : 0;
	if (!f) {
		struct udp_walk w = {.us = us, .cookie = cookie, .port = key->port, .connected = 1, .free = -1, .found = -1, .oldest = -1};

		__builtin_memcpy(w.addr, key->addr, sizeof(w.addr));
		bpf_loop(UDP_FLOWS, udp_step, &w, 0);
		f = udp_flow_of(us, w.found);
	}
	if (f)
		udp_stamp(f);
	return 1;
}

/* key4 and key6 are the rule key of a sock_addr hook's address. */
static __always_inline void key4(struct rule_key *key, struct bpf_sock_addr *ctx)
{
	__u32 ip = ctx->user_ip4;

	key->prefixlen = RULE_KEY_FULL_BITS;
	key->addr[10] = 0xff;
	key->addr[11] = 0xff;
	__builtin_memcpy(&key->addr[12], &ip, 4);
	key->port = bpf_ntohs((__u16)ctx->user_port);
}

static __always_inline void key6(struct rule_key *key, struct bpf_sock_addr *ctx)
{
	__u32 w;

	key->prefixlen = RULE_KEY_FULL_BITS;
	w = ctx->user_ip6[0];
	__builtin_memcpy(&key->addr[0], &w, 4);
	w = ctx->user_ip6[1];
	__builtin_memcpy(&key->addr[4], &w, 4);
	w = ctx->user_ip6[2];
	__builtin_memcpy(&key->addr[8], &w, 4);
	w = ctx->user_ip6[3];
	__builtin_memcpy(&key->addr[12], &w, 4);
	key->port = bpf_ntohs((__u16)ctx->user_port);
}

static __always_inline int is_tcp(struct bpf_sock_addr *ctx)
{
	return ctx->type == SOCK_STREAM && ctx->protocol == IPPROTO_TCP;
}

static __always_inline int is_udp(struct bpf_sock_addr *ctx)
{
	return ctx->type == SOCK_DGRAM && ctx->protocol == IPPROTO_UDP;
}

SEC("cgroup/connect4")
int egressd_connect4(struct bpf_sock_addr *ctx)
{
	struct rule_key key = {};

	if (is_tcp(ctx)) {
		key4(&key, ctx);
		return on_connect(ctx, &key);
	}
	if (is_udp(ctx)) {
		key4(&key, ctx);
		return on_udp_connect(ctx, &key);
	}
	return 1;
}

SEC("cgroup/connect6")
int egressd_connect6(struct bpf_sock_addr *ctx)
{
	struct rule_key key = {};

	if (is_tcp(ctx)) {
		key6(&key, ctx);
		return on_connect(ctx, &key);
	}
	if (is_udp(ctx)) {
		key6(&key, ctx);
		return on_udp_connect(ctx, &key);
	}
	return 1;
}

/* A datagram to an address no UDP rule's destinations may hold (see
 * udp_dests) returns before anything else, even the socket's protocol
 * (UDP-Lite's sends run these programs too): most of a host's, and what
 * every datagram sent to an address pays, beside the program's call. */
SEC("cgroup/sendmsg4")
int egressd_sendmsg4(struct bpf_sock_addr *ctx)
{
	if (!udp_ruled4(ctx->user_ip4) || !is_udp(ctx))
		return 1;
	struct rule_key key = {};

	key4(&key, ctx);
	return on_sendmsg(ctx, &key);
}

SEC("cgroup/sendmsg6")
int egressd_sendmsg6(struct bpf_sock_addr *ctx)
{
	struct rule_key key = {};

	key6(&key, ctx);
	if (!udp_ruled(key.addr) || !is_udp(ctx))
		return 1;
	return on_sendmsg(ctx, &key);
}

SEC("cgroup/recvmsg4")
int egressd_recvmsg4(struct bpf_sock_addr *ctx)
{
	struct rule_key key = {};

	if (!is_udp(ctx))
		return 1;
	key4(&key, ctx);
	return on_recvmsg(ctx, &key);
}

SEC("cgroup/recvmsg6")
int egressd_recvmsg6(struct bpf_sock_addr *ctx)
{
	struct rule_key key = {};

	if (!is_udp(ctx))
		return 1;
	key6(&key, ctx);
	return on_recvmsg(ctx, &key);
}

/* Runs for every socket below the cgroup, five times per connection
 * whatever its flags. STATE_CB runs only for a socket some program set
 * it for, which need not have left TRACKED set. */
SEC("sockops")
int egressd_sockops(struct bpf_sock_ops *skops)
{
	__u32 flags = skops->bpf_sock_ops_cb_flags;
	__u32 op = skops->op;

	if (!(flags & TRACKED) && op != BPF_SOCK_OPS_STATE_CB)
		return 1;
	struct bpf_sock *sk = skops->sk;
	struct sock_state *ss;
	__u64 cookie;

	switch (op) {
	case BPF_SOCK_OPS_RTO_CB:
		/* TCP gives up on the connection (args[2]: the attempt has
		 * expired): for a connect() still in SYN_SENT, where no
		 * STATE_CB runs, this is the one place to give back its slot
		 * before close(). */
		if (!skops->args[2] || !sk)
			return 1;
		cookie = cookie_of(sk);
		ss = find_state(sk, cookie, flags);
		if (ss)
			release(ss, cookie, (__u64)sk);
		return 1;
	case BPF_SOCK_OPS_NEEDS_ECN:
		/* The connect latency starts at the first SYN (a retransmitted
		 * one counts from the first). */
		if (!sk)
			return 1;
		cookie = cookie_of(sk);
		ss = find_state(sk, cookie, flags);
		if (ss && ss->word == (cookie << 2 | SS_HELD))
			ss->connect_ns = tcp_stamp_ns(sk);
		return 1;
	/* A connect() that met the peer's own SYN (a simultaneous open, or a
	 * socket connected to its own address) is established as a passive
	 * one; an accepted socket is never tracked. */
	case BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB:
	case BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB: {
		if (!sk)
			return 1;
		cookie = cookie_of(sk);
		ss = find_state(sk, cookie, flags);
		__u64 held = cookie << 2 | SS_HELD;
		if (!ss || ss->word != held)
			return 1;
		__u32 slot = ss->rule, gen = ss->gen;
		__u64 connect_ns = ss->connect_ns;
		/* A close() on another CPU may release the entry meanwhile and
		 * another socket take it: what was read is this socket's only
		 * if the word still says so after. Else a sample of another
		 * socket's connect time, a few nanoseconds, would become the
		 * rule's baseline. (The flag below could still land on the next
		 * socket's entry in the instants after: it only decides whether
		 * that socket's failure counts as a connect failure.) */
		if (*(volatile __u64 *)&ss->word != held)
			return 1;
		/* From here on, a connection reset or timed out gives back its
		 * slot as TCP closes it. Not from connect(): that would cost a
		 * run of this program for the change to ESTABLISHED too. */
		if (!(flags & BPF_SOCK_OPS_STATE_CB_FLAG)) {
			bpf_sock_ops_cb_flags_set(skops, flags | BPF_SOCK_OPS_STATE_CB_FLAG);
			ss->added |= BPF_SOCK_OPS_STATE_CB_FLAG;
		}
		ss->established = 1;
		struct rule *r = bpf_map_lookup_elem(&rules, &slot);
		struct rule_state *st = bpf_map_lookup_elem(&rule_states, &slot);
		if (!r || !st || r->gen != gen)
			return 1;
		count(st, COUNTER_ESTABLISHED, 1);
		__u64 now = tcp_stamp_ns(sk);
		if (connect_ns && now > connect_ns)
			record_latency(slot, gen, r->flags, SAMPLE_CONNECT, now, now - connect_ns);
		return 1;
	}
	case BPF_SOCK_OPS_STATE_CB: {
		if (skops->args[1] == BPF_TCP_ESTABLISHED || !sk)
			return 1;
		cookie = cookie_of(sk);
		if (!cookie)
			return 1;
		ss = find_state(sk, cookie, flags);
		if (!ss)
			return 1; /* not ours: its flags are whoever set them's */
		__u8 off = ss->added & (TRACKED | BPF_SOCK_OPS_STATE_CB_FLAG);
		if (skops->args[1] == BPF_TCP_CLOSE)
			release(ss, cookie, (__u64)sk);
		/* Released (usually by close() already): the socket's later
		 * state changes need not call us. Only what this datapath
		 * turned on goes off, and only while the entry is still this
		 * socket's, so that off is its own. */
		__u64 w = *(volatile __u64 *)&ss->word;
		if (off && w >> 2 == cookie && !(w & SS_FLAGS))
			bpf_sock_ops_cb_flags_set(skops, flags & ~off);
		return 1;
	}
	}
	return 1;
}

/* A UDP socket's release ends its flows, and its state goes. */
static __always_inline int udp_release(__u64 cookie)
{
	struct udp_entry *e;
	struct udp_sock *us = udp_state(cookie, &e);

	if (us)
		udp_end(us, e, cookie);
	return 1;
}

/* Every socket with a cookie is looked for, whatever its flags: a socket
 * another program took the mark off still holds its slot. Its overflow
 * entry, if it has one, goes with it: a socket closing connects no more,
 * where one that connects again takes its entry again. */
SEC("cgroup/sock_release")
int egressd_sock_release(struct bpf_sock *sk)
{
	int udp = sk->type == SOCK_DGRAM && sk->protocol == IPPROTO_UDP;

	if (!udp && (sk->type != SOCK_STREAM || sk->protocol != IPPROTO_TCP))
		return 1;
	__u64 cookie = cookie_of(sk);

	if (!cookie)
		return 1;
	if (udp)
		return udp_release(cookie);
	struct sock_state *ss = find_state(sk, cookie, cb_flags(bpf_cast_to_kern_ctx(sk)));

	if (!ss)
		return 1;
	__u8 overflow = ss->overflow;
	release(ss, cookie, (__u64)sk);
	if (overflow)
		bpf_map_delete_elem(&sock_overflow, &cookie);
	return 1;
}

/* TCP payload bytes of a (possibly GSO) skb; 0 for segments without payload
 * and for RST. cgroup_skb data starts at the network header, which with the
 * TCP header is in the linear data of every packet TCP builds; anything
 * else is read through bpf_skb_load_bytes. IPv6 extension headers are not
 * parsed (such packets count as no payload). */
static __always_inline __u32 tcp_payload_len(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	__u32 nh;
	__u8 h[2];

	if (skb->protocol == bpf_htons(ETH_P_IP)) {
		__u8 ip[10];
		__u8 *p = data;

		if ((void *)(p + sizeof(ip)) <= end)
			__builtin_memcpy(ip, p, sizeof(ip));
		else if (bpf_skb_load_bytes(skb, 0, ip, sizeof(ip)))
			return 0;
		if (ip[9] != IPPROTO_TCP)
			return 0;
		nh = (ip[0] & 0xf) * 4;
	} else if (skb->protocol == bpf_htons(ETH_P_IPV6)) {
		__u8 ip6[8];
		__u8 *p = data;

		if ((void *)(p + sizeof(ip6)) <= end)
			__builtin_memcpy(ip6, p, sizeof(ip6));
		else if (bpf_skb_load_bytes(skb, 0, ip6, sizeof(ip6)))
			return 0;
		if (ip6[6] != IPPROTO_TCP)
			return 0;
		nh = 40;
	} else {
		return 0;
	}
	/* byte 12: data offset in the upper nibble; byte 13: flags */
	__u8 *t = (__u8 *)data + (nh & 0x3c) + 12;
	if ((void *)(t + 2) <= end)
		__builtin_memcpy(h, t, 2);
	else if (bpf_skb_load_bytes(skb, nh + 12, h, 2))
		return 0;
	if (h[1] & 0x04)
		return 0;
	__u32 l4 = nh + (h[0] >> 4) * 4;
	return skb->len > l4 ? skb->len - l4 : 0;
}

/* skb_state returns the state of the tracked TCP socket a packet belongs
 * to; every other packet returns at once. */
static __always_inline struct sock_state *skb_state(struct __sk_buff *skb, __u64 *cookie)
{
	struct bpf_sock *sk = skb->sk;

	if (!sk)
		return 0;
	sk = bpf_sk_fullsock(sk);
	if (!sk || sk->protocol != IPPROTO_TCP)
		return 0;
	__u8 flags = cb_flags(sk);
	if (!(flags & TRACKED))
		return 0;
	*cookie = cookie_of(sk);
	return find_state(sk, *cookie, flags);
}

SEC("cgroup_skb/egress")
int egressd_egress(struct __sk_buff *skb)
{
	__u64 cookie;
	struct sock_state *ss = skb_state(skb, &cookie);

	if (!ss || !(ss->rule_flags & RULE_F_REQUESTS))
		return 1;
	__u64 held = cookie << 2 | SS_HELD;
	if (ss->word != held || !tcp_payload_len(skb))
		return 1;
	/* Read while the socket holds the entry (the swap below says it
	 * still did): once released, the entry may pass to another socket. */
	__u32 slot = ss->rule, gen = ss->gen;
	struct rule *r = bpf_map_lookup_elem(&rules, &slot);
	/* A socket whose rule has gone counts no requests: its slot may be
	 * another rule's now, whose in-flight count it would move. */
	if (!r || r->gen != gen)
		return 1;
	/* Arms only a held socket: a release in between wins. */
	if (__sync_val_compare_and_swap(&ss->word, held, held | SS_AWAITING) != held)
		return 1;
	/* TCP stamps each packet with when it leaves, on bpf_ktime_get_ns's
	 * clock (tcp_clock_ns): the send time without a helper call, whose
	 * clock read waits for every load before it. */
	__u64 sent = skb->tstamp;
	ss->sent_ns = sent ? sent : bpf_ktime_get_ns();
	struct rule_state *st = bpf_map_lookup_elem(&rule_states, &slot);
	if (st)
		count(st, COUNTER_REQUESTS, 1);
	return 1;
}

SEC("cgroup_skb/ingress")
int egressd_ingress(struct __sk_buff *skb)
{
	__u64 cookie;
	struct sock_state *ss = skb_state(skb, &cookie);

	if (!ss)
		return 1;
	__u64 awaiting = cookie << 2 | SS_HELD | SS_AWAITING;
	if (ss->word != awaiting || !tcp_payload_len(skb))
		return 1;
	__u32 slot = ss->rule, gen = ss->gen;
	__u64 sent = ss->sent_ns;
	if (__sync_val_compare_and_swap(&ss->word, awaiting, awaiting & ~SS_AWAITING) != awaiting)
		return 1; /* released meanwhile, which counted the abort */
	/* The request's rule has gone: as release() does, count nothing on
	 * a slot that may be another rule's now. */
	struct rule *r = bpf_map_lookup_elem(&rules, &slot);
	if (!r || r->gen != gen)
		return 1;
	__u64 now = bpf_ktime_get_ns();
	struct response_count *rc = bpf_map_lookup_elem(&rule_responses, &slot);
	if (rc)
		__sync_fetch_and_add(&rc->n, 1);
	/* A response comes after its request left: a later send time is not
	 * one, and no sample. */
	if (now > sent)
		record_latency(slot, gen, r->flags, SAMPLE_REQUEST, now, now - sent);
	return 1;
}

/* The recount looks at the states themselves, not the sockets: every
 * state is in sock_table or sock_overflow, whatever network namespace its
 * socket is in, and a state whose socket was freed without giving its slot
 * back (a close that ran no sock_release) is found only there. */

/* sock_alive reports whether addr is the live socket with this cookie. A
 * socket's memory is reused only for another socket of its kind (the
 * slabs of TCP and UDP sockets are SLAB_TYPESAFE_BY_RCU), whose cookie and
 * reference count start at zero: a freed socket shows a count of zero or
 * another cookie, a live one its own cookie and a positive count. Memory
 * that went back to the system reads as freed, unless it holds the cookie
 * and a positive count by chance, which errs towards keeping the slot. */
static __always_inline int sock_alive(__u64 addr, __u64 cookie)
{
	struct sock_common *skc = (struct sock_common *)addr;
	__s64 c = 0;
	int refs = 0;

	if (bpf_core_read(&c, sizeof(c), &skc->skc_cookie.counter) || (__u64)c != cookie)
		return 0;
	if (bpf_core_read(&refs, sizeof(refs), &skc->skc_refcnt.refs.counter))
		return 0;
	return refs > 0;
}

/* sweep_flow looks at flow i of the socket with cookie, or with i
 * UDP_FLOWS at its state: a flow of a socket freed is given back (and the
 * state freed), one idle longer than idle_ns ends; otherwise it counts.
 * idx is the item's: the socket's entry of udp_table (SWEEP_UDP_TABLE) or
 * of udp_socks, and i. */
static __always_inline void sweep_flow(struct sweep_item *it, __u64 cookie, __u32 idx)
{
	__u32 i = idx & 0xf, k = (idx & ~(SWEEP_UDP | SWEEP_UDP_TABLE)) >> 4;
	struct udp_entry *e = 0;
	struct udp_sock *us;

	if (idx & SWEEP_UDP_TABLE) {
		e = bpf_map_lookup_elem(&udp_table, &k);
		/* The cookie first: an address read after it is its socket's,
		 * or 0 while the socket has not written it yet (see
		 * udp_end). */
		if (!e || *(volatile __u64 *)&e->cookie != cookie)
			return;
		us = &e->us;
	} else if (!(us = bpf_map_lookup_elem(&udp_socks, &cookie))) {
		return;
	}
	__u64 addr = *(volatile __u64 *)&us->sk;
	int freed = addr && !sock_alive(addr, cookie);
	if (i >= UDP_FLOWS) {
		if (freed)
			udp_end(us, e, cookie);
		return;
	}
	struct udp_flow *f = &us->flows[i];
	__u64 w = *(volatile __u64 *)&f->word;
	if (w != (cookie << 2 | SS_HELD))
		return;
	it->rule = f->rule;
	it->gen = f->gen;
	if (freed) {
		if (give_back(f, cookie))
			it->what = REC_FREED;
		return;
	}
	__u64 idle = it->idle_ns;
	/* The flows' coarse clock is CLOCK_MONOTONIC's, a tick behind. */
	if (idle && !(f->flags & FLOW_CONNECTED) && bpf_ktime_get_ns() - f->active_ns > idle) {
		if (give_back(f, cookie))
			it->what = REC_EXPIRED;
		return;
	}
	it->what = REC_HELD;
}

static long sweep_one(__u64 i, void *unused)
{
	__u32 k = i;
	struct sweep_item *it = bpf_map_lookup_elem(&sweep, &k);

	if (!it)
		return 1;
	__u64 cookie = it->cookie;
	__u32 idx = it->idx;
	it->what = 0;
	if (idx != SWEEP_OVERFLOW && (idx & SWEEP_UDP)) {
		sweep_flow(it, cookie, idx);
		return 0;
	}
	int overflow = idx == SWEEP_OVERFLOW;
	struct sock_state *ss = overflow ? bpf_map_lookup_elem(&sock_overflow, &cookie)
					 : bpf_map_lookup_elem(&sock_table, &idx);
	if (!ss)
		return 0;
	/* The word first: an address read after a word held is its holder's,
	 * or 0 while the holder has not written it yet (see release). */
	__u64 w = *(volatile __u64 *)&ss->word;
	__u64 addr = *(volatile __u64 *)&ss->sk;
	__u32 rule = ss->rule, gen = ss->gen;
	if (w >> 2 != cookie)
		return 0;
	/* No address: a state a build before took, or one whose holder has
	 * not written it yet. Its socket is taken to be alive. */
	int freed = addr && !sock_alive(addr, cookie);
	if (!(w & SS_HELD)) {
		/* An overflow entry of a socket freed without its
		 * sock_release, which takes it away. */
		if (overflow && freed)
			bpf_map_delete_elem(&sock_overflow, &cookie);
		return 0;
	}
	it->rule = rule;
	it->gen = gen;
	if (freed) {
		if (release(ss, cookie, addr))
			it->what = REC_FREED;
		if (overflow)
			bpf_map_delete_elem(&sock_overflow, &cookie);
		return 0;
	}
	/* What was read is the holder's only if the word still says so. */
	if (*(volatile __u64 *)&ss->word == w)
		it->what = REC_HELD | (w & SS_AWAITING ? REC_AWAITING : 0);
	return 0;
}

/* Run by the loader (BPF_PROG_TEST_RUN) at each recount, over the states
 * it put in sweep: says which hold a slot for a live socket, and gives back
 * the slots of those whose socket was freed. */
SEC("syscall")
int egressd_sweep(struct sweep_args *a)
{
	__u32 n = a->n;

	bpf_loop(n < SWEEP_LEN ? n : SWEEP_LEN, sweep_one, 0, 0);
	return 0;
}

static long counts_one(__u64 i, void *ctx)
{
	const struct counts_args *a = ctx;
	__u32 slot = a->first + (__u32)i, at = (__u32)i;
	struct rule_state *st = bpf_map_lookup_elem(&rule_states, &slot);
	struct rule_counts *c = bpf_map_lookup_elem(&counts, &at);

	if (!st || !c)
		return 1; /* past the table's end */
	c->live = st->live;
	c->spent = st->spent;
	for (int k = 0; k < COUNTER_LEN; k++)
		c->counters[k] = st->counters[k];
	return 0;
}

/* Run by the loader (BPF_PROG_TEST_RUN) to read every rule's counts: copies
 * those of n slots from first on into counts, which user space reads from
 * mapped memory. One call and a copy in the kernel per 4,096 rules instead
 * of a copy out of each rule's whole state. */
SEC("syscall")
int egressd_counts(struct counts_args *a)
{
	struct counts_args args = *a;

	bpf_loop(args.n < COUNTS_LEN ? args.n : COUNTS_LEN, counts_one, &args, 0);
	return 0;
}

struct seq_file;
struct bpf_iter_meta {
	struct seq_file *seq;
} __attribute__((preserve_access_index));
struct bpf_iter__tcp {
	struct bpf_iter_meta *meta;
	struct sock_common *sk_common;
} __attribute__((preserve_access_index));

/* Puts back the marks another program took off a socket holding a slot
 * (TRACKED, and STATE_CB once established), so that its requests, samples
 * and reset are seen again; the TCP sockets of the walking process's
 * network namespace only. */
SEC("iter/tcp")
int egressd_remark(struct bpf_iter__tcp *ctx)
{
	struct sock_common *skc = ctx->sk_common;

	if (!skc)
		return 0;
	struct tcp_sock *tp = bpf_skc_to_tcp_sock(skc);
	if (!tp)
		return 0; /* TIME_WAIT and request sockets hold no slot */
	__u64 cookie = skc->skc_cookie.counter;
	if (!cookie)
		return 0;
	__u8 flags = tp->bpf_sock_ops_cb_flags;
	struct sock_state *ss = find_state(tp, cookie, flags);
	if (!ss || ss->word >> 2 != cookie || !(ss->word & SS_HELD))
		return 0;
	/* Past SYN_SENT, STATE_CB too: the established callback that would
	 * have set it has been. */
	int connected = skc->skc_state != BPF_TCP_SYN_SENT;
	__u8 want = TRACKED | (connected ? BPF_SOCK_OPS_STATE_CB_FLAG : 0);
	if ((flags & want) == want)
		return 0;
	int set = flags | want;
	if (bpf_setsockopt(tp, SOL_TCP, TCP_BPF_SOCK_OPS_CB_FLAGS, &set, sizeof(set)))
		return 0;
	ss->added |= want & ~flags;
	if (connected && !ss->established) {
		struct rule *r = bpf_map_lookup_elem(&rules, &ss->rule);
		struct rule_state *st = bpf_map_lookup_elem(&rule_states, &ss->rule);

		ss->established = 1;
		if (r && st && r->gen == ss->gen)
			count(st, COUNTER_ESTABLISHED, 1);
	}
	struct iter_rec rec = {.rule = ss->rule, .gen = ss->gen, .what = REC_REMARKED};
	bpf_seq_write(ctx->meta->seq, &rec, sizeof(rec));
	return 0;
}

/* Run by the loader (BPF_PROG_TEST_RUN) when it moves the rule tables
 * (the loops unrolled: the context is read at fixed offsets only):
 * adds what a rule's state gained in the maps the programs left to the
 * maps they now use. Counts add; the bucket loses the tokens taken; a
 * window segment's count adds where the segment is the same, starts
 * where the new state has not reached it yet, and is dropped where the
 * new state has moved past it. */
SEC("syscall")
int egressd_merge(struct merge_args *a)
{
	__u32 slot = a->slot;
	struct rule_state *st = bpf_map_lookup_elem(&rule_states, &slot);

	if (!st)
		return 1;
	__sync_fetch_and_add(&st->live, a->live);
	__sync_fetch_and_add(&st->spent, a->spent);
#pragma unroll
	for (int i = 0; i < COUNTER_LEN; i++)
		__sync_fetch_and_add(&st->counters[i], a->counters[i]);
	struct rule *r = bpf_map_lookup_elem(&rules, &slot);
	bpf_spin_lock(&st->lock);
	if (r && a->epoch == r->epoch && st->epoch != r->epoch) {
		/* The copy was of a state not yet started, which the old
		 * programs then started, and no program has touched this
		 * one since: the old state is the whole truth (the loader
		 * sent its segments whole). Left as it was, this state's
		 * first use would start it afresh and forget them. */
		st->epoch = a->epoch;
		st->tokens = a->bucket_tokens;
		st->refilled_ns = a->refilled_ns;
#pragma unroll
		for (int i = 0; i < MAX_SEGMENTS; i++) {
			st->segment_id[i] = 0;
			st->segment_count[i] = 0;
		}
	} else {
		st->tokens = st->tokens > a->tokens ? st->tokens - a->tokens : 0;
	}
#pragma unroll
	for (int i = 0; i < MAX_SEGMENTS; i++) {
		__u64 id = a->segment_id[i];

		if (!a->segment_count[i] || st->segment_id[i] > id)
			continue;
		if (st->segment_id[i] < id) {
			st->segment_id[i] = id;
			st->segment_count[i] = 0;
		}
		st->segment_count[i] += a->segment_count[i];
	}
	bpf_spin_unlock(&st->lock);
#pragma unroll
	for (int k = 0; k < SAMPLE_LEN; k++) {
		__u32 idx = slot * SAMPLE_LEN + k;
		struct hist *h = bpf_map_lookup_elem(&latency, &idx);

		if (!h)
			continue;
		__sync_fetch_and_add(&h->sum_ns, a->hist_sum[k]);
#pragma unroll
		for (int b = 0; b < HIST_BUCKETS; b++)
			__sync_fetch_and_add(&h->buckets[b], a->hist_buckets[k][b]);
	}
	return 0;
}
