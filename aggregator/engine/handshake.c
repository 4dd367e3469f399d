/* The job handshake (docs/protocol.md "Job handshake"): a worker's `job` datagram (format 3,
 * its job descriptor) is answered with the descriptor of the job of that id as the engine holds
 * it, "no such job", or "not authentic" when the hello's authentication is not what the job
 * asks for. An authentic hello that says a new set of workers has come (a rank of the current
 * set with a new incarnation nonce, or any hello to a job quiet for nce_set_restart_idle's
 * time) and finds the job idle starts it afresh (its slots and learned members, and a new set:
 * members.c); a retransmitted hello, a recovery's or a probe carries its client's nonce and
 * changes nothing. The answer is written by nce_build_reply. */
#include "state.h"

#define STATUS_OK 0
#define STATUS_NO_SUCH_JOB 1
#define STATUS_NOT_AUTHENTIC 2

static uint64_t restart_idle_ns = 10ull * 1000000000u;  /* handshake.RESTART_IDLE */

void nce_set_restart_idle(uint64_t ns)
{
    restart_idle_ns = ns;
}

/* Whether the job has been quiet long enough for a hello to restart it: no strand completed a
 * slot or sent a result again in the last restart_idle_ns (a worker of a job in use, between
 * two training steps or waiting for a lost result, keeps its results and its address). */
static int quiet_long_enough(const struct nce_job *job)
{
    const uint64_t now = nce_now_ns();
    for (unsigned strand = 0; strand < NCE_MAX_STRANDS; strand++) {
        const uint64_t at = __atomic_load_n(&job->c[strand].active_ns, __ATOMIC_RELAXED);
        if (at != 0 && now - at < restart_idle_ns)
            return 0;
    }
    return 1;
}

int nce_is_job_datagram(const uint8_t *dgram, uint32_t len)
{
    return len >= NCE_HDR_LEN && dgram[0] == NCE_VERSION && dgram[2] == NCE_FMT_JOB;
}

__thread int nce_no_restart;

/* A hello's incarnation nonce: the header's offset field (0: none). */
static uint32_t hello_nonce(const uint8_t *dgram)
{
    return (uint32_t)dgram[12] << 24 | (uint32_t)dgram[13] << 16 | (uint32_t)dgram[14] << 8 |
           dgram[15];
}

/* A job datagram's length and count checks: -1 when they pass, else the drop reason. */
static int malformed(const uint8_t *dgram, uint32_t len)
{
    const uint16_t count = (uint16_t)(dgram[10] << 8 | dgram[11]);
    const uint32_t want = NCE_JOB_LEN + (dgram[1] & NCE_FLAG_TAG ? NCE_TAG_LEN : 0);
    return len != want ? NCE_BAD_LENGTH : count != 1 ? NCE_BAD_COUNT : -1;
}

int nce_hello_may_restart(const uint8_t *dgram, uint32_t len)
{
    if (!nce_is_job_datagram(dgram, len) || malformed(dgram, len) >= 0 ||
        (dgram[1] & NCE_FLAG_RESULT))
        return 0;
    const struct nce_job *job = nce_job_at((uint16_t)(dgram[4] << 8 | dgram[5]));
    const struct nce_pkt p = {.dgram = dgram, .dgram_len = len, .flags = dgram[1]};
    /* Any address: a superset of the hellos that restart (nce_handshake checks it). */
    return job != NULL && nce_authentic(job, &p) &&
           nce_members_new_set_comes(job, (uint16_t)(dgram[6] << 8 | dgram[7]), hello_nonce(dgram),
                                     NULL, (dgram[1] & NCE_FLAG_PROBE) != 0,
                                     quiet_long_enough(job));
}

enum nce_verdict nce_handshake(const uint8_t *dgram, uint32_t len, const struct nce_from *from,
                               struct nce_action *act)
{
    struct nce_pkt p = {.dgram = dgram, .dgram_len = len, .flags = dgram[1]};
    const uint16_t id = (uint16_t)(dgram[4] << 8 | dgram[5]);
    int reason = malformed(dgram, len);
    struct nce_job *job = nce_job_at(id);
    struct nce_counters *c = nce_counters_of(job);
    c->packets_in++;
    c->bytes_in += len;
    if (reason < 0 && job != NULL && (p.flags & NCE_FLAG_RESULT))
        reason = NCE_BAD_FLAGS;
    if (reason < 0 && job == NULL)
        reason = NCE_UNKNOWN_JOB;               /* counted, and answered below */
    if (reason >= 0)
        c->drops[reason]++;
    if (reason >= 0 && reason != NCE_UNKNOWN_JOB)
        return NCE_V_NONE;
    act->job = job;
    act->slot = NULL;
    act->descriptor = 1;
    act->job_id = id;
    act->rank = (uint16_t)(dgram[6] << 8 | dgram[7]);
    act->members = 0;
    act->version = 0;
    act->unjoined = 0;
    if (job == NULL) {
        act->status = STATUS_NO_SUCH_JOB;
        return NCE_V_DESCRIPTOR;
    }
    act->status = nce_authentic(job, &p) ? STATUS_OK : STATUS_NOT_AUTHENTIC;
    /* A hello that says a new set of workers has come (a rank of the set with a new nonce, or
     * the job quiet for restart_idle_ns) and finds the job idle (no round partly filled)
     * starts it afresh: a new set of workers comes from new ports and counts its offsets from
     * 0 again, which the member check and the slot rules would take for strangers and late
     * packets. */
    const uint32_t nonce = hello_nonce(dgram);
    const int probe = (p.flags & NCE_FLAG_PROBE) != 0;
    const int comes = act->status == STATUS_OK && !nce_no_restart
                          ? nce_members_new_set_comes(job, act->rank, nonce, from, probe,
                                                      quiet_long_enough(job))
                          : 0;
    act->restarted = comes != 0 && nce_pool_restart_if_idle(job);
    if (act->restarted)
        nce_members_new_set(job, comes == NCE_NEW_INCARNATION);
    /* An authentic hello joins its rank to this start; a probe (FLAG_PROBE, the RETX bit)
     * asks whether it did, and does not join. */
    act->unjoined = 0;
    if (act->status == STATUS_OK && act->rank < job->n) {
        const uint64_t bit = (uint64_t)1 << act->rank;
        if (p.flags & NCE_FLAG_PROBE)
            act->unjoined = !(__atomic_load_n(&job->joined, __ATOMIC_RELAXED) & bit);
        else
            __atomic_fetch_or(&job->joined, bit, __ATOMIC_RELAXED);
        if (!probe && nonce != 0)
            nce_member_said_hello(job, act->rank, nonce, from);
    }
    c->handshakes++;
    c->packets_out++;
    c->bytes_out += nce_descriptor_len(act);
    return NCE_V_DESCRIPTOR;
}

static inline void put_be16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)(v >> 8);
    p[1] = (uint8_t)v;
}

uint32_t nce_descriptor_len(const struct nce_action *a)
{
    const int tagged = a->job != NULL && a->job->tagged && a->status == STATUS_OK;
    return NCE_JOB_LEN + (tagged ? NCE_TAG_LEN : 0);
}

uint32_t nce_build_descriptor(uint8_t *buf, uint32_t cap, const struct nce_action *a)
{
    const struct nce_job *job = a->job;
    const uint32_t len = nce_descriptor_len(a);
    const int tagged = len > NCE_JOB_LEN;
    if (len > cap)
        return 0;
    memset(buf, 0, NCE_JOB_LEN);
    buf[0] = NCE_VERSION;
    buf[1] = (uint8_t)(NCE_FLAG_RESULT | nce_generation << NCE_GEN_SHIFT |
                       (tagged ? NCE_FLAG_TAG : 0) | (a->unjoined ? NCE_FLAG_PROBE : 0));
    buf[2] = NCE_FMT_JOB;
    put_be16(buf + 4, a->job_id);
    put_be16(buf + 6, a->rank);
    put_be16(buf + 10, 1);
    uint8_t *d = buf + NCE_HDR_LEN;            /* the descriptor, ncina.proto.descriptor */
    d[0] = a->status;
    if (job != NULL) {
        buf[3] = (uint8_t)job->e_min;
        d[1] = job->result_format;
        d[2] = (uint8_t)(job->e_min + job->span);       /* e_max */
        d[3] = (uint8_t)job->e_min;
        put_be16(d + 4, job->n);
        put_be16(d + 6, job->nslots);
        put_be16(d + 8, job->k);
        d[10] = job->tagged;
        d[11] = job->uplink_format;             /* UPLINK_MODE 0 (nc8), UPLINK_INT 1 (a spine) */
        /* d[12..15]: no compressor */
    }
    d[16] = NCE_ROUNDING;                       /* the descriptor's last byte */
    if (tagged)
        nce_tag(job, buf, NCE_JOB_LEN, buf + NCE_JOB_LEN);
    return len;
}
