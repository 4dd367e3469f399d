/* ncina slot engine: the types and module state its files share, and each file's functions.
 * One file per concept, named as in ncina.aggregator and p4/ (docs/architecture.md). Calls go
 * one way, with no cycle: pipeline.c -> every other file; admission.c -> members.c, slots.c,
 * upstream.c; handshake.c -> members.c, slots.c; reply.c -> handshake.c, members.c;
 * upstream.c -> parse.c, members.c, reply.c, handshake.c; parse.c, members.c and slots.c call no other
 * engine file. */
#ifndef NCE_STATE_H
#define NCE_STATE_H

#include <stdint.h>
#include <string.h>
#include <time.h>

#include "blake2b.h"
#include "datapath.h"

#define NCE_VERSION 1
#define NCE_FLAG_RESULT 0x01
#define NCE_FLAG_RETX 0x02
#define NCE_FLAG_POOL 0x04
#define NCE_FLAG_PROBE NCE_FLAG_RETX    /* on a job datagram (ncina.proto.descriptor.FLAG_PROBE) */
#define NCE_GEN_SHIFT 3
#define NCE_GEN_MASK 0x78
#define NCE_FLAG_TAG 0x80
#define NCE_NOTICE_LEN (NCE_HDR_LEN + 8)   /* header and the 64-bit bitmap, before any tag */
#define NCE_FMT_NC8 0
#define NCE_FMT_INT 1
#define NCE_FMT_BLOB 2                 /* server mode; no job of the engine takes it */
#define NCE_FMT_JOB 3           /* the job handshake's descriptor */
#define NCE_FMT_INT32 4         /* exact sums, signed 32-bit: results only */
/* An int32 job's window keeps its sums within +-2^NCE_INT32_SUM_BITS (ncina.proto.nc8.
 * INT32_SUM_BITS): N workers' codes up to 2^span need N * 2^span <= 2^30 (admission.c). */
#define NCE_INT32_SUM_BITS 30
#define NCE_JOB_LEN (NCE_HDR_LEN + 17)      /* a job datagram: header and descriptor */
#define NCE_ROUNDING 1  /* the nc8 results' rounding word (ncina.proto.nc8.ROUNDING): CRC-32 */

/* A port number between host order and network order (byte by byte: any host). */
static inline uint16_t nce_port_be(uint16_t port)
{
    uint16_t be;
    const uint8_t bytes[2] = {(uint8_t)(port >> 8), (uint8_t)port};
    memcpy(&be, bytes, 2);
    return be;
}

static inline uint16_t nce_port_host(uint16_t be)
{
    uint8_t bytes[2];
    memcpy(bytes, &be, 2);
    return (uint16_t)(bytes[0] << 8 | bytes[1]);
}

/* A 64-bit word in network order at p. */
static inline void nce_put_be64(uint8_t *p, uint64_t v)
{
    for (int i = 7; i >= 0; i--, v >>= 8)
        p[i] = (uint8_t)v;
}

/* The 64-bit word in network order at p (any alignment). */
static inline uint64_t nce_get_be64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = v << 8 | p[i];
    return v;
}

/* One uplink datagram's header (host order) and where its payload is. */
struct nce_pkt {
    const uint8_t *dgram;       /* the ncina header and its payload (and tag) */
    uint32_t dgram_len;
    uint8_t version, flags, format;
    int8_t emin;
    uint16_t job, rank, slot, count;
    uint32_t offset;
    const uint8_t *payload;
    uint32_t payload_len;       /* without the tag */
};

/* One version of one slot. */
struct nce_slot {
    uint64_t bitmap;
    uint16_t contributors;
    uint16_t count;             /* elements of the chunk */
    uint32_t offset;            /* element offset of the chunk */
    uint8_t complete;
    uint8_t waiting;            /* a leaf's: complete, its sum sent up, the spine's result due */
    uint32_t uses;              /* completions so far: the nc8 result key's `use` */
    int64_t *acc;               /* k accumulators */
    uint8_t *result;            /* stored result payload, count * element size bytes */
    uint8_t *resends;           /* per rank: results sent again this round (n bytes) */
    uint64_t *resent_ns;        /* per rank: when the last of them went (nce_now_ns) */
};

/* How often one member may be sent one round's stored result again at once, per slot version
 * (the Python reference's slots.RESEND_BURST); past it, once per nce_set_resend_interval's
 * time (slots.RESEND_INTERVAL), and otherwise rule 2 is a resend_limit drop. */
#define NCE_RESEND_BURST 4

/* One strand's counters, on cache lines of their own (strands never share a written line), and
 * when (CLOCK_MONOTONIC ns, 0: never) the strand last completed a slot of the job or sent one of
 * its results again: a hello restarts a job only after it was quiet (handshake.c). */
struct nce_strand_counters {
    struct nce_counters c;
    uint64_t active_ns;
} __attribute__((aligned(64)));

struct nce_job {
    uint16_t id, n, k, nslots;
    int8_t e_min;
    uint8_t span;
    uint8_t result_format;
    uint8_t elem_size;          /* of the result format */
    /* What the members send (docs/protocol.md "Hierarchical aggregation"): NC8 codes (workers),
     * or INT, the exact partial sums of leaf aggregators of total / n workers each (a spine),
     * each element at most bound in magnitude, (total / n) * 2^span, so that the n of them
     * sum to at most total * 2^span (nce_job_set_uplink checks that it fits an int64). */
    uint8_t uplink_format;
    uint16_t total;             /* workers of the whole tree (n for a one-level job) */
    int64_t bound;
    /* A leaf of a spine (nce_job_set_upstream, upstream.c): a complete slot's sum goes up as
     * int partial sums and waits; the spine's result becomes the slot's result. */
    uint8_t leaf;
    uint64_t seed;              /* of the nc8 results' rounding bits (nc8_result_key) */
    uint8_t tagged;             /* the job has an authentication key */
    struct ncd_b2b mac;         /* BLAKE2b state with the key block absorbed (copied per tag) */
    /* Bit r: rank r said an authentic hello to this start (handshake.c; set with an atomic or,
     * read by every strand): a packet that carries the generation from a rank that did not is
     * stale, sent to an earlier start that may have drawn the same generation (admission.c).
     * Only a new start clears it. */
    uint64_t joined;
    /* 1: a rank's new incarnation started the current set of workers (handshake.c), so only a
     * rank that said its hello in it (a member's nonce) is a member (members.c). Written with
     * the other strands parked (a restart), read by every strand. */
    uint8_t gated;
    struct nce_strand_counters c[NCE_MAX_STRANDS];    /* each strand's (summed by nce_job_stats) */
    struct nce_member *members; /* n */
    struct nce_slot *slots;     /* 2 * nslots: slot s version v at [2 * s + v] */
};

/* Module state (pipeline.c). */
extern struct nce_job *nce_jobs[65536];
extern struct nce_strand_counters nce_global[NCE_MAX_STRANDS];
extern unsigned nce_strands;     /* strands the I/O layer runs (nce_set_strands) */

/* CLOCK_MONOTONIC in ns. */
static inline uint64_t nce_now_ns(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (uint64_t)now.tv_sec * 1000000000u + (uint64_t)now.tv_nsec;
}
/* The job was active now, on the calling strand (a completion, or a result sent again). */
static inline void nce_mark_active(struct nce_job *job)
{
    __atomic_store_n(&job->c[nce_strand].active_ns, nce_now_ns(), __ATOMIC_RELAXED);
}

/* The calling strand's counters of a job, or the global ones (job NULL). */
static inline struct nce_counters *nce_counters_of(struct nce_job *job)
{
    return job != NULL ? &job->c[nce_strand].c : &nce_global[nce_strand].c;
}
extern uint8_t nce_generation;

/* parse.c: the job-independent checks; -1 when well formed, else the drop reason. */
int nce_parse(const uint8_t *dgram, uint32_t len, struct nce_pkt *p);

/* members.c */
int nce_members_alloc(struct nce_job *job);
void nce_members_free(struct nce_job *job);
int nce_members_set(struct nce_job *job, uint16_t rank, uint32_t ip_be, uint16_t port);
void nce_members_forget_learned(struct nce_job *job);     /* configured ones stay */
/* A new set of workers: learned addresses and every rank's nonce forgotten; gated (a rank's
 * new incarnation started it), only the ranks that say hello in the set are members. */
void nce_members_new_set(struct nce_job *job, int gated);
/* An authentic hello (no probe) of rank with a nonce (not 0): the rank's first in the set is
 * its incarnation; in a gated set it also learns the rank's address (strand 0 only). */
void nce_member_said_hello(struct nce_job *job, uint16_t rank, uint32_t nonce,
                           const struct nce_from *from);
/* Whether an authentic hello of rank with nonce (0: none) says a new set of workers has come:
 * NCE_NEW_INCARNATION for a rank of the set with another nonce (no probe) from its known IPv4
 * address, if it has one (from NULL: from any address); NCE_QUIET, the job quiet, for a hello
 * without a nonce or a first hello while no rank has said one with a nonce; else 0
 * (ncina.aggregator.backends.python.members.Members.new_set_comes). */
#define NCE_QUIET 1
#define NCE_NEW_INCARNATION 2
int nce_members_new_set_comes(const struct nce_job *job, uint16_t rank, uint32_t nonce,
                              const struct nce_from *from, int probe, int quiet);
int nce_member_accepts(const struct nce_job *job, uint16_t rank, const struct nce_from *from);
/* 1: the rank has (or now has) this sender's address; 0: another strand just learned another. */
int nce_member_learn(struct nce_job *job, uint16_t rank, const struct nce_from *from);
void nce_tag_key(struct nce_job *job, const uint8_t *key, uint32_t keylen);
void nce_tag(const struct nce_job *job, const uint8_t *msg, uint32_t len, uint8_t *tag);
int nce_authentic(const struct nce_job *job, const struct nce_pkt *p);

/* slots.c */
int nce_pool_alloc(struct nce_job *job);
void nce_pool_free(struct nce_job *job);
/* What the slot rules (docs/protocol.md "Late and duplicate packets") make of an admitted
 * packet; the drops are counted by the caller. */
enum nce_rule {
    NCE_R_CONTRIBUTE,   /* rule 1: a new contribution */
    NCE_R_RESEND,       /* rule 2: the stored result, to the sender */
    NCE_R_DUPLICATE,    /* rule 3: an ignored duplicate, answered by a notice */
    NCE_R_LATE,         /* dropped as late */
    NCE_R_MISMATCH,     /* dropped as chunk_mismatch */
};
enum nce_rule nce_slot_rule(const struct nce_job *job, const struct nce_pkt *p, unsigned version);
/* Rule 1 of the state machine: add the contribution; 1 when it completes the slot, whose
 * result is then encoded and stored (s->result, s->complete). */
int nce_contribute(struct nce_job *job, struct nce_slot *s, const struct nce_pkt *p,
                   unsigned version);
/* Rule 2's budget: whether rank may be sent the slot version's stored result again (counted
 * when it may). */
int nce_may_resend(struct nce_slot *s, uint16_t rank, uint64_t now_ns);
/* Start the slots afresh (their `uses` go on) if no round is partly filled; whether it did.
 * An authentic hello calls it (handshake.c), see there. */
int nce_pool_restart_if_idle(struct nce_job *job);

/* reply.c */
uint32_t nce_result_len(const struct nce_job *job, const struct nce_slot *s);
uint32_t nce_notice_len(const struct nce_job *job, int has_bitmap);
/* Count copies of the slot's stored result going out (packets_out, bytes_out). */
void nce_count_results(struct nce_job *job, const struct nce_slot *s, uint32_t copies);
/* A notice to the datagram's sender about (slot, version) at its offset, holding bitmap, or
 * with has_bitmap 0 none (a restart notice: the header alone, no longer than any packet that
 * reaches the generation check): counted, and act filled for nce_build_reply. */
enum nce_verdict nce_notice(struct nce_job *job, const struct nce_pkt *p, uint64_t bitmap,
                            int has_bitmap, struct nce_action *act);

/* handshake.c: the job handshake (answered by nce_build_reply); nce_is_job_datagram is
 * datapath.h's. */
enum nce_verdict nce_handshake(const uint8_t *dgram, uint32_t len, const struct nce_from *from,
                               struct nce_action *act);
uint32_t nce_descriptor_len(const struct nce_action *a);
uint32_t nce_build_descriptor(uint8_t *buf, uint32_t cap, const struct nce_action *a);

/* The installed job of an id, or NULL (the control plane may add and remove jobs while a data
 * plane runs: the pointer is published with release order, read with acquire). */
static inline struct nce_job *nce_job_at(uint16_t id)
{
    return __atomic_load_n(&nce_jobs[id], __ATOMIC_ACQUIRE);
}

/* upstream.c: a leaf's side towards its spine (one leaf job per engine), as
 * ncina.aggregator.hierarchy (Upstream, LeafAggregator.from_spine). */
int nce_upstream_set(uint16_t job, uint32_t ip_be, uint16_t port, uint16_t rank,
                     uint8_t generation, const uint8_t *hello, uint32_t hello_len);
int nce_upstream_from(const struct nce_from *from);     /* whether from the spine's address */
/* A datagram from the spine: a result for a waiting slot is stored (NCE_V_SEND_ALL to the
 * leaf's workers); anything else is counted in the upstream counters (NCE_V_NONE). */
enum nce_verdict nce_upstream_input(const uint8_t *dgram, uint32_t len, struct nce_action *act);
/* The slot version's exact sum goes to the spine (retx: again, for a worker's retransmission
 * while it waits): counted, and act->up set for nce_build_uplink. */
void nce_upstream_forward(const struct nce_job *job, const struct nce_slot *s, int retx,
                          struct nce_action *act);
/* A worker's hello restarted the leaf's job: the leaf's hello goes to the spine too. */
void nce_upstream_hello(struct nce_action *act);
void nce_upstream_reset(void);

/* admission.c: job-level validation; -1 when the datagram may enter the state machine. */
int nce_admit(const struct nce_job *job, const struct nce_pkt *p, const struct nce_from *from);

#endif
