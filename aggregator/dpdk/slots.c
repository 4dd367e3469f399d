/* Jobs, members and the slot state machine of docs/protocol.md ("Slots, pool versions and loss
 * recovery"): the per-packet decision, independent of how frames are received and sent. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nc8.h"
#include "ncd_priv.h"

struct ncd_job *ncd_jobs[65536];
struct ncd_counters ncd_global;
struct ncd_io ncd_iostats;
struct rte_ether_addr ncd_mac;
uint32_t ncd_ip;
uint16_t ncd_port_be;
uint8_t ncd_generation;

char ncd_errbuf[256];

const char *ncd_error(void)
{
    return ncd_errbuf;
}

void ncd_get_mac(uint8_t *mac)
{
    memcpy(mac, ncd_mac.addr_bytes, RTE_ETHER_ADDR_LEN);
}

void ncd_set_mac(const uint8_t *mac)
{
    memcpy(ncd_mac.addr_bytes, mac, RTE_ETHER_ADDR_LEN);
}

void ncd_set_address(const uint8_t *ip, uint16_t udp_port)
{
    memcpy(&ncd_ip, ip, 4);
    ncd_port_be = rte_cpu_to_be_16(udp_port);
}

uint32_t ncd_frame_room(void)
{
    return NCD_FRAME_ROOM;
}

/* Whether a result frame of k elements of the format (and a tag) fits an mbuf; if not, the
 * reason, with the largest k that fits, goes to ncd_errbuf. Result frames are the largest the
 * data plane sends: an uplink frame has 1-byte elements, a notice none. */
static int fits_frame_room(uint16_t id, uint32_t k, int result_format, int tagged)
{
    const uint32_t size = result_format == NCD_FMT_INT ? 8 : 1;
    const uint32_t around = NCD_FRAME_OVERHEAD + (tagged ? NCD_TAG_LEN : 0);
    if (around + k * size <= NCD_FRAME_ROOM)
        return 1;
    const char *name = result_format == NCD_FMT_INT ? "int" : "nc8";
    snprintf(ncd_errbuf, sizeof ncd_errbuf,
             "job %u: a result frame of k=%u %s elements is %u bytes, more than the %u-byte mbuf "
             "data room of the DPDK data plane; the largest k for %s results is %u",
             id, k, name, around + k * size, NCD_FRAME_ROOM, name,
             (NCD_FRAME_ROOM - around) / size);
    return 0;
}

static void job_free(struct ncd_job *job)
{
    free(job->slots[0].acc);
    free(job->slots[0].result);
    free(job->slots);
    free(job->members);
    free(job->keys);
    free(job);
}

int ncd_job_add(uint16_t id, uint16_t workers, uint16_t k, uint16_t nslots, int e_min, int span,
                int result_format, uint64_t seed)
{
    if (ncd_jobs[id] != NULL) {
        snprintf(ncd_errbuf, sizeof ncd_errbuf, "job %u is already installed", id);
        return -1;
    }
    if (workers < 1 || workers > NCD_MAX_WORKERS || k < 1 || k > NCD_MAX_K || nslots < 1 ||
        span < 0 || span > 62 || (result_format != NCD_FMT_NC8 && result_format != NCD_FMT_INT)) {
        snprintf(ncd_errbuf, sizeof ncd_errbuf,
                 "job %u: bad parameters (workers %u of at most %d, k %u of at most %d, "
                 "slots %u, span %d, result format %d)",
                 id, workers, NCD_MAX_WORKERS, k, NCD_MAX_K, nslots, span, result_format);
        return -1;
    }
    if (!fits_frame_room(id, k, result_format, 0))
        return -1;
    struct ncd_job *job = calloc(1, sizeof *job);
    if (job == NULL)
        goto nomem;
    job->id = id;
    job->n = workers;
    job->k = k;
    job->nslots = nslots;
    job->e_min = (int8_t)e_min;
    job->span = (uint8_t)span;
    job->result_format = (uint8_t)result_format;
    job->elem_size = result_format == NCD_FMT_INT ? 8 : 1;
    job->seed = seed;
    job->members = calloc(workers, sizeof *job->members);
    job->slots = calloc(2 * (size_t)nslots, sizeof *job->slots);
    /* One arena each for the accumulators and the stored results of every slot version. */
    int64_t *acc = calloc(2 * (size_t)nslots * k, sizeof *acc);
    uint8_t *res = calloc(2 * (size_t)nslots * k, job->elem_size);
    if (job->members == NULL || job->slots == NULL || acc == NULL || res == NULL) {
        free(acc);
        free(res);
        free(job->slots);
        free(job->members);
        free(job);
        goto nomem;
    }
    for (size_t i = 0; i < 2 * (size_t)nslots; i++) {
        job->slots[i].acc = acc + i * k;
        job->slots[i].result = res + i * k * job->elem_size;
    }
    ncd_jobs[id] = job;
    return 0;
nomem:
    snprintf(ncd_errbuf, sizeof ncd_errbuf, "job %u: out of memory", id);
    return -1;
}

void ncd_set_generation(uint8_t generation)
{
    ncd_generation = generation & (NCD_GEN_MASK >> NCD_GEN_SHIFT);
}

int ncd_job_set_key(uint16_t id, const uint8_t *key, uint32_t keylen)
{
    struct ncd_job *job = ncd_jobs[id];
    if (job == NULL || keylen < 16 || keylen > 64) {
        snprintf(ncd_errbuf, sizeof ncd_errbuf, "job %u: a key has 16 to 64 bytes, not %u", id,
                 keylen);
        return -1;
    }
    if (!fits_frame_room(id, job->k, job->result_format, 1)) {
        job_free(job);
        ncd_jobs[id] = NULL;
        return -1;
    }
    ncd_b2b_init(&job->mac, NCD_TAG_LEN, key, keylen);
    job->tagged = 1;
    return 0;
}

void ncd_blake2b(uint8_t *out, uint32_t outlen, const uint8_t *key, uint32_t keylen,
                 const uint8_t *msg, uint32_t len)
{
    struct ncd_b2b s;
    ncd_b2b_init(&s, outlen, key, keylen);
    ncd_b2b_update(&s, msg, len);
    ncd_b2b_final(&s, out);
}

/* The tag of msg[0..len) with the job's key. */
void ncd_tag(const struct ncd_job *job, const uint8_t *msg, uint32_t len, uint8_t *tag)
{
    struct ncd_b2b s = job->mac;
    ncd_b2b_update(&s, msg, len);
    ncd_b2b_final(&s, tag);
}

/* Whether the datagram's authentication is what its job asks for: no TAG flag on an untagged
 * job; the TAG flag and a matching tag (compared in constant time) on a keyed one. */
static int authentic(const struct ncd_job *job, const struct ncd_pkt *p)
{
    const int flagged = (p->flags & NCD_FLAG_TAG) != 0;
    if (!job->tagged || !flagged)
        return !job->tagged && !flagged;
    uint8_t tag[NCD_TAG_LEN];
    const uint32_t body = p->dgram_len - NCD_TAG_LEN;
    ncd_tag(job, p->dgram, body, tag);
    uint8_t diff = 0;
    for (int i = 0; i < NCD_TAG_LEN; i++)
        diff |= tag[i] ^ p->dgram[body + i];
    return diff == 0;
}

int ncd_member_set(uint16_t id, uint16_t rank, const uint8_t *ip, uint16_t port)
{
    struct ncd_job *job = ncd_jobs[id];
    if (job == NULL || rank >= job->n) {
        snprintf(ncd_errbuf, sizeof ncd_errbuf, "job %u has no rank %u", id, rank);
        return -1;
    }
    struct ncd_member *m = &job->members[rank];
    memcpy(&m->ip, ip, 4);
    m->port = rte_cpu_to_be_16(port);
    m->known = 1;
    return 0;
}

void ncd_reset(void)
{
    for (size_t id = 0; id < 65536; id++) {
        struct ncd_job *job = ncd_jobs[id];
        if (job == NULL)
            continue;
        job_free(job);
        ncd_jobs[id] = NULL;
    }
    memset(&ncd_global, 0, sizeof ncd_global);
    memset(&ncd_iostats, 0, sizeof ncd_iostats);
}

/* Counters are written by the data-plane thread only; readers copy them word by word (64-bit
 * aligned loads are atomic on the targets DPDK supports, so no value is torn). */
static void copy_counters(struct ncd_counters *out, const struct ncd_counters *in)
{
    const volatile uint64_t *src = (const volatile uint64_t *)in;
    uint64_t *dst = (uint64_t *)out;
    for (size_t i = 0; i < sizeof *in / sizeof(uint64_t); i++)
        dst[i] = src[i];
}

int ncd_job_stats(uint16_t id, struct ncd_counters *out)
{
    if (ncd_jobs[id] == NULL)
        return -1;
    copy_counters(out, &ncd_jobs[id]->c);
    return 0;
}

void ncd_global_stats(struct ncd_counters *out, struct ncd_io *io)
{
    copy_counters(out, &ncd_global);
    const volatile uint64_t *src = (const volatile uint64_t *)&ncd_iostats;
    uint64_t *dst = (uint64_t *)io;
    for (size_t i = 0; i < sizeof *io / sizeof(uint64_t); i++)
        dst[i] = src[i];
}

/* ---- the nc8 result key ring (control plane side) ---- */

int ncd_job_key_ring(uint16_t id, uint32_t size_pow2)
{
    struct ncd_job *job = ncd_jobs[id];
    if (job == NULL || size_pow2 == 0 || (size_pow2 & (size_pow2 - 1)) != 0 || job->keys) {
        snprintf(ncd_errbuf, sizeof ncd_errbuf, "job %u: bad key ring (size %u)", id, size_pow2);
        return -1;
    }
    job->keys = calloc(size_pow2, sizeof *job->keys);
    if (job->keys == NULL) {
        snprintf(ncd_errbuf, sizeof ncd_errbuf, "job %u: out of memory", id);
        return -1;
    }
    job->key_mask = size_pow2 - 1;
    return 0;
}

uint32_t ncd_job_key_space(uint16_t id, uint64_t *next)
{
    struct ncd_job *job = ncd_jobs[id];
    if (job == NULL || job->keys == NULL)
        return 0;
    const uint64_t used = __atomic_load_n(&job->completions, __ATOMIC_ACQUIRE);
    const uint64_t written = job->keys_written;
    /* After an underrun the data plane is ahead of the producer: skip the keys it did not use. */
    const uint64_t start = written > used ? written : used;
    *next = start;
    return (uint32_t)(job->key_mask + 1 - (start - used));
}

void ncd_job_key_push(uint16_t id, const uint64_t *keys, uint32_t n)
{
    struct ncd_job *job = ncd_jobs[id];
    uint64_t start = 0;
    if (job == NULL || n > ncd_job_key_space(id, &start))
        return;
    for (uint32_t i = 0; i < n; i++)
        job->keys[(start + i) & job->key_mask] = keys[i];
    __atomic_store_n(&job->keys_written, start + n, __ATOMIC_RELEASE);
}

/* ---- the per-packet decision ---- */

/* Largest exponent code in the payload (sign bits masked). */
static inline unsigned max_code(const uint8_t *codes, unsigned n)
{
    uint8_t top = 0;
    for (unsigned i = 0; i < n; i++) {
        const uint8_t c = codes[i] & 0x7F;
        top = c > top ? c : top;
    }
    return top;
}

/* Job-level validation, in the order of ncina.aggregator.slots; -1 when the packet may enter
 * the state machine, else the drop reason (NCD_STALE_GENERATION: answered with a notice). */
static int check_job(const struct ncd_job *job, const struct ncd_pkt *p)
{
    if (p->flags & NCD_FLAG_RESULT)
        return NCD_BAD_FLAGS;
    if (p->format != NCD_FMT_NC8)
        return NCD_BAD_FORMAT;
    if (p->rank >= job->n)
        return NCD_NON_MEMBER;
    const struct ncd_member *m = &job->members[p->rank];
    if (m->known && (m->ip != p->src_ip || m->port != p->src_port))
        return NCD_NON_MEMBER;
    const unsigned stamp = p->flags & NCD_GEN_MASK;
    if (stamp && stamp != (unsigned)ncd_generation << NCD_GEN_SHIFT)
        return ncd_generation ? NCD_STALE_GENERATION : NCD_BAD_FLAGS;
    if (p->emin != job->e_min)
        return NCD_WINDOW_MISMATCH;
    if (p->slot >= job->nslots)
        return NCD_BAD_SLOT;
    if (p->count > job->k)
        return NCD_BAD_COUNT;
    if (max_code(p->payload, p->count) > (unsigned)job->span + 1)
        return NCD_BAD_CODE;
    return -1;
}

/* A valid packet's rank gets (or keeps) its address; its MAC is where results go. */
static inline void learn_member(struct ncd_member *m, const struct ncd_pkt *p)
{
    if (!m->known) {
        m->ip = p->src_ip;
        m->port = p->src_port;
        m->known = 1;
    }
    if (!m->has_mac) {
        rte_ether_addr_copy(&p->eth->src_addr, &m->mac);
        m->has_mac = 1;
    }
    m->agg_ip = p->dst_ip;
}

/* A datagram that parse rejected: under its job when the header is readable and names one. */
static void count_malformed(const struct ncd_pkt *p, int reason)
{
    struct ncd_job *job = NULL;
    if (reason != NCD_TRUNCATED && reason != NCD_BAD_VERSION)
        job = ncd_jobs[p->job];
    struct ncd_counters *c = job != NULL ? &job->c : &ncd_global;
    c->packets_in++;
    c->bytes_in += p->dgram_len;
    c->drops[reason]++;
}

/* Bytes of one result datagram of the slot version (header, payload, tag). */
static inline uint32_t result_dgram_len(const struct ncd_job *job, const struct ncd_slot *s)
{
    return NCD_HDR_LEN + (uint32_t)s->count * job->elem_size + (job->tagged ? NCD_TAG_LEN : 0);
}

/* A notice to the packet's sender about (slot, version) at the packet's offset. */
static enum ncd_verdict notice(struct ncd_job *job, const struct ncd_pkt *p, unsigned ver,
                               uint64_t bitmap, struct ncd_action *act)
{
    act->job = job;
    act->rank = p->rank;
    act->version = (uint8_t)ver;
    act->slot_index = p->slot;
    act->offset = p->offset;
    act->bitmap = bitmap;
    job->c.notices_sent++;
    job->c.packets_out++;
    job->c.bytes_out += NCD_NOTICE_LEN + (job->tagged ? NCD_TAG_LEN : 0);
    return NCD_V_NOTICE;
}

enum ncd_verdict ncd_engine_input(const uint8_t *frame, uint32_t len, struct ncd_action *act)
{
    struct ncd_pkt p;
    enum ncd_verdict v = ncd_classify(frame, len, &p);
    if (v != NCD_V_NONE)
        return v;

    int reason = ncd_parse_dgram(&p);
    if (reason >= 0) {
        count_malformed(&p, reason);
        return NCD_V_NONE;
    }
    struct ncd_job *job = ncd_jobs[p.job];
    if (job == NULL) {
        count_malformed(&p, NCD_UNKNOWN_JOB);
        return NCD_V_NONE;
    }
    struct ncd_counters *c = &job->c;
    c->packets_in++;
    c->bytes_in += p.dgram_len;
    if (!authentic(job, &p)) {
        c->drops[NCD_BAD_TAG]++;
        return NCD_V_NONE;
    }
    const unsigned ver = (p.flags & NCD_FLAG_POOL) != 0;
    reason = check_job(job, &p);
    if (reason >= 0) {
        c->drops[reason]++;
        return reason == NCD_STALE_GENERATION ? notice(job, &p, ver, 0, act) : NCD_V_NONE;
    }
    learn_member(&job->members[p.rank], &p);
    c->retx_seen += (p.flags & NCD_FLAG_RETX) != 0;

    const uint64_t bit = 1ULL << p.rank;
    struct ncd_slot *s = &job->slots[2 * p.slot + ver];
    const int first = s->bitmap == 0;
    if (!first && (p.offset != s->offset || p.count != s->count)) {
        c->drops[NCD_CHUNK_MISMATCH]++;
        return NCD_V_NONE;
    }
    act->job = job;
    act->slot = s;
    act->rank = p.rank;
    act->version = (uint8_t)ver;

    if (s->bitmap & bit) {
        if (s->complete) {                      /* rule 2: the worker lost the result */
            c->results_resent++;
            c->packets_out++;
            c->bytes_out += result_dgram_len(job, s);
            return NCD_V_SEND_ONE;
        }
        c->duplicates++;                        /* rule 3: ignored duplicate, and a notice */
        return ncd_generation ? notice(job, &p, ver, s->bitmap, act) : NCD_V_NONE;
    }

    /* Rule 1: a new contribution. */
    if (first) {
        s->offset = p.offset;
        s->count = p.count;
        s->contributors = 0;
        s->complete = 0;
        nc8_codes_to_int(p.payload, s->acc, p.count);
    } else {
        nc8_accumulate(s->acc, p.payload, p.count);
    }
    s->bitmap |= bit;
    job->slots[2 * p.slot + (ver ^ 1)].bitmap &= ~bit;
    c->contributions++;
    /* Exactly the Nth: a contribution beyond it (a worker re-contributing after it moved on,
     * which the protocol rules out) is added but completes nothing, as in the reference. */
    if (++s->contributors != job->n)
        return NCD_V_NONE;

    s->complete = 1;
    ncd_encode_result(job, s);
    c->slots_completed++;
    c->results_sent += job->n;
    c->packets_out += job->n;
    c->bytes_out += (uint64_t)job->n * result_dgram_len(job, s);
    return NCD_V_SEND_ALL;
}
