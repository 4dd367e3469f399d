/* The pipeline: one datagram through the concepts in the order of docs/protocol.md "Order of
 * checks" (nce_input: parse, the job, the tag, admission, the member learned, the slot rules,
 * which replies go out), as ncina.aggregator.backends.python.pipeline does; plus the engine's
 * module state and the offline entry point for tests. */
#include <string.h>

#include "state.h"

struct nce_job *nce_jobs[65536];
struct nce_strand_counters nce_global[NCE_MAX_STRANDS];
uint8_t nce_generation;
struct nce_epoch nce_dp_epoch[NCE_MAX_STRANDS];
__thread unsigned nce_strand;
char nce_errbuf[256];

const char *nce_error(void)
{
    return nce_errbuf;
}

/* A datagram that parse rejected: under its job when the header is readable and names one. */
static void count_malformed(const struct nce_pkt *p, int reason)
{
    struct nce_job *job = NULL;
    if (reason != NCE_TRUNCATED && reason != NCE_BAD_VERSION)
        job = nce_job_at(p->job);
    struct nce_counters *c = nce_counters_of(job);
    c->packets_in++;
    c->bytes_in += p->dgram_len;
    c->drops[reason]++;
}

unsigned nce_strand_of(const uint8_t *dgram, uint32_t len, unsigned strands, unsigned here)
{
    if (strands <= 1)
        return 0;
    if (len < NCE_HDR_LEN || dgram[0] != NCE_VERSION)
        return here;
    if (dgram[2] == NCE_FMT_JOB)
        return 0;
    return ((unsigned)dgram[8] << 8 | dgram[9]) % strands;
}

enum nce_verdict nce_input(const uint8_t *dgram, uint32_t len, const struct nce_from *from,
                           struct nce_action *act)
{
    act->descriptor = 0;
    act->restarted = 0;
    act->up = NCE_UP_NONE;
    if (nce_upstream_from(from))                /* a leaf's spine (upstream.c) */
        return nce_upstream_input(dgram, len, act);
    if (nce_is_job_datagram(dgram, len)) {
        const enum nce_verdict v = nce_handshake(dgram, len, from, act);
        if (act->restarted && act->job->leaf)   /* the spine starts afresh too, if idle */
            nce_upstream_hello(act);
        return v;
    }
    struct nce_pkt p;
    int reason = nce_parse(dgram, len, &p);    /* 1-5 */
    if (reason >= 0) {
        count_malformed(&p, reason);
        return NCE_V_NONE;
    }
    struct nce_job *job = nce_job_at(p.job);   /* 6 */
    if (job == NULL) {
        count_malformed(&p, NCE_UNKNOWN_JOB);
        return NCE_V_NONE;
    }
    struct nce_counters *c = nce_counters_of(job);
    c->packets_in++;
    c->bytes_in += len;
    if (!nce_authentic(job, &p)) {             /* 7 */
        c->drops[NCE_BAD_TAG]++;
        return NCE_V_NONE;
    }
    const unsigned ver = (p.flags & NCE_FLAG_POOL) != 0;
    act->job = job;
    act->rank = p.rank;
    act->members = job->n;
    act->version = (uint8_t)ver;
    reason = nce_admit(job, &p, from);         /* 8-15 */
    if (reason >= 0) {
        c->drops[reason]++;
        /* A stale packet is answered by a restart notice, the header alone: shorter than any
         * packet that gets here, so a forged source gets no amplified reflection. */
        if (reason == NCE_STALE_GENERATION)
            return nce_notice(job, &p, 0, 0, act);
        return NCE_V_NONE;
    }
    if (!nce_member_learn(job, p.rank, from)) { /* 16: a valid packet */
        c->drops[NCE_NON_MEMBER]++;             /* another strand learned another sender */
        return NCE_V_NONE;
    }
    c->retx_seen += (p.flags & NCE_FLAG_RETX) != 0;

    struct nce_slot *s = &job->slots[2 * p.slot + ver];
    act->slot = s;
    switch (nce_slot_rule(job, &p, ver)) {
    case NCE_R_LATE:
        c->drops[NCE_LATE]++;
        return NCE_V_NONE;
    case NCE_R_MISMATCH:
        c->drops[NCE_CHUNK_MISMATCH]++;
        return NCE_V_NONE;
    case NCE_R_RESEND:                          /* rule 2: the worker lost the result */
        nce_mark_active(job);                   /* a worker waits: the job is in use */
        if (s->waiting) {                       /* a leaf's, still without it: ask again */
            nce_upstream_forward(job, s, 1, act);   /* (to the spine: no budget, or a leaf
                                                     * whose uplinks were lost would stall) */
            return NCE_V_NONE;
        }
        if (!nce_may_resend(s, p.rank, nce_now_ns())) { /* its budget is spent for now */
            c->drops[NCE_RESEND_LIMIT]++;
            return NCE_V_NONE;
        }
        c->results_resent++;
        nce_count_results(job, s, 1);
        return NCE_V_SEND_ONE;
    case NCE_R_DUPLICATE:                       /* rule 3: ignored duplicate, and a notice */
        c->duplicates++;
        return nce_generation ? nce_notice(job, &p, s->bitmap, 1, act) : NCE_V_NONE;
    case NCE_R_CONTRIBUTE:
        break;
    }
    if (!nce_contribute(job, s, &p, ver))       /* rule 1: a new contribution */
        return NCE_V_NONE;
    c->slots_completed++;
    nce_mark_active(job);
    if (job->leaf) {                            /* its exact sum goes to the spine */
        nce_upstream_forward(job, s, 0, act);
        return NCE_V_NONE;
    }
    c->results_sent += job->n;
    nce_count_results(job, s, job->n);          /* to every member: the emulated multicast */
    return NCE_V_SEND_ALL;
}

int nce_process_datagram(const uint8_t *dgram, uint32_t len, const uint8_t *src_ip,
                         uint16_t src_port, const uint8_t *dst_ip, uint8_t *out, uint32_t stride,
                         uint32_t max_out, uint32_t *out_lens, uint32_t *out_ips,
                         uint16_t *out_ports)
{
    struct nce_from from = {.src_port = nce_port_be(src_port)};
    memcpy(&from.src_ip, src_ip, 4);
    memcpy(&from.dst_ip, dst_ip, 4);
    struct nce_action a;
    const enum nce_verdict v = nce_input(dgram, len, &from, &a);
    uint32_t first = 0, end = 0;                /* the replies' ranks: none for NCE_V_NONE */
    if (v == NCE_V_SEND_ALL) {
        end = a.members;
    } else if (v != NCE_V_NONE) {
        first = a.rank;
        end = first + 1;                        /* 32 bits: rank 65535 has one reply too */
    }
    const uint32_t replies = end - first, total = replies + (a.up != NCE_UP_NONE);
    if (total > max_out)
        return -1;
    for (uint32_t r = first; r < end; r++) {
        const uint32_t i = r - first;
        out_lens[i] = nce_build_reply(out + (size_t)i * stride, stride, &a, (uint16_t)r);
        if (out_lens[i] == 0)
            return -1;
        if (v != NCE_V_SEND_ALL) {              /* back to the sender */
            out_ips[i] = from.src_ip;
            out_ports[i] = nce_port_host(from.src_port);
            continue;
        }
        const struct nce_member *m = nce_member_of(&a, (uint16_t)r);
        out_ips[i] = m->ip;
        out_ports[i] = nce_port_host(m->port);
    }
    if (a.up != NCE_UP_NONE) {                  /* a leaf's datagram to its spine, last */
        out_lens[replies] = nce_build_uplink(out + (size_t)replies * stride, stride, &a);
        if (out_lens[replies] == 0)
            return -1;
        out_ips[replies] = a.up_ip;
        out_ports[replies] = nce_port_host(a.up_port);
    }
    return (int)total;
}
