/* Upstream: a leaf aggregator's side towards its spine (docs/protocol.md "Hierarchical
 * aggregation"), as ncina.aggregator.hierarchy (Upstream.forward, LeafAggregator.from_spine).
 * A leaf job's complete slot version is not encoded: its exact sum goes to the spine as an int
 * uplink datagram (same job, slot, pool version, offset and count; the leaf's rank there) and
 * waits; the spine's result for that chunk is stored as the slot's result and sent to the
 * leaf's workers as a one-level completion. Every datagram from the spine's address is
 * counted here (the upstream counters), never in the job's. One leaf job per engine. */
#include <string.h>

#include "state.h"

static struct {
    uint8_t active;
    uint16_t job;
    uint32_t ip;                /* the spine's address and port, network order */
    uint16_t port;
    uint16_t rank;              /* the leaf's rank in the spine's job */
    uint8_t generation;         /* the spine's (its results and notices carry it) */
    uint8_t hello[NCE_JOB_LEN + NCE_TAG_LEN];
    uint32_t hello_len;
    struct nce_upstream_counters c;
} up;

int nce_upstream_set(uint16_t job, uint32_t ip_be, uint16_t port, uint16_t rank,
                     uint8_t generation, const uint8_t *hello, uint32_t hello_len)
{
    if (hello_len < NCE_JOB_LEN || hello_len > sizeof up.hello ||
        (up.active && up.job != job))
        return -1;
    up.job = job;
    up.ip = ip_be;
    up.port = nce_port_be(port);
    up.rank = rank;
    up.generation = generation & (NCE_GEN_MASK >> NCE_GEN_SHIFT);
    memcpy(up.hello, hello, hello_len);
    up.hello_len = hello_len;
    up.active = 1;
    return 0;
}

void nce_upstream_reset(void)
{
    memset(&up, 0, sizeof up);
}

void nce_upstream_stats(struct nce_upstream_counters *out)
{
    const volatile uint64_t *src = (const volatile uint64_t *)&up.c;
    uint64_t *dst = (uint64_t *)out;
    for (size_t i = 0; i < sizeof *out / sizeof(uint64_t); i++)
        dst[i] = src[i];
}

int nce_upstream_from(const struct nce_from *from)
{
    return up.active && from->src_ip == up.ip && from->src_port == up.port;
}

static uint32_t sum_len(const struct nce_job *job, const struct nce_slot *s)
{
    return NCE_HDR_LEN + 8 * (uint32_t)s->count + (job->tagged ? NCE_TAG_LEN : 0);
}

static void count_out(uint32_t len, struct nce_action *act)
{
    up.c.packets_out++;
    up.c.bytes_out += len;
    act->up_ip = up.ip;
    act->up_port = up.port;
}

void nce_upstream_forward(const struct nce_job *job, const struct nce_slot *s, int retx,
                          struct nce_action *act)
{
    if (retx)
        up.c.resent++;
    else
        up.c.sent++;
    act->up = NCE_UP_SUM;
    act->up_retx = (uint8_t)(retx != 0);
    count_out(sum_len(job, s), act);
}

void nce_upstream_hello(struct nce_action *act)
{
    up.c.hellos++;
    act->up = NCE_UP_HELLO;
    count_out(up.hello_len, act);
}

uint32_t nce_build_uplink(uint8_t *buf, uint32_t cap, const struct nce_action *a)
{
    if (a->up == NCE_UP_HELLO) {
        if (up.hello_len > cap)
            return 0;
        memcpy(buf, up.hello, up.hello_len);
        return up.hello_len;
    }
    const struct nce_job *job = a->job;
    const struct nce_slot *s = a->slot;
    const uint32_t len = sum_len(job, s);
    if (len > cap)
        return 0;
    const uint16_t slot = (uint16_t)((s - job->slots) >> 1);
    uint8_t *h = buf;
    h[0] = NCE_VERSION;
    h[1] = (uint8_t)((a->version ? NCE_FLAG_POOL : 0) | (a->up_retx ? NCE_FLAG_RETX : 0) |
                     up.generation << NCE_GEN_SHIFT | (job->tagged ? NCE_FLAG_TAG : 0));
    h[2] = NCE_FMT_INT;
    h[3] = (uint8_t)job->e_min;
    h[4] = (uint8_t)(job->id >> 8);
    h[5] = (uint8_t)job->id;
    h[6] = (uint8_t)(up.rank >> 8);
    h[7] = (uint8_t)up.rank;
    h[8] = (uint8_t)(slot >> 8);
    h[9] = (uint8_t)slot;
    h[10] = (uint8_t)(s->count >> 8);
    h[11] = (uint8_t)s->count;
    h[12] = (uint8_t)(s->offset >> 24);
    h[13] = (uint8_t)(s->offset >> 16);
    h[14] = (uint8_t)(s->offset >> 8);
    h[15] = (uint8_t)s->offset;
    const uint32_t body = NCE_HDR_LEN + 8 * (uint32_t)s->count;
    for (unsigned i = 0; i < s->count; i++)
        nce_put_be64(buf + NCE_HDR_LEN + 8 * (size_t)i, (uint64_t)s->acc[i]);
    if (job->tagged)
        nce_tag(job, buf, body, buf + body);
    return len;
}

static enum nce_verdict drop(int reason)
{
    up.c.drops[reason]++;
    return NCE_V_NONE;
}

enum nce_verdict nce_upstream_input(const uint8_t *dgram, uint32_t len, struct nce_action *act)
{
    up.c.packets_in++;
    up.c.bytes_in += len;
    if (nce_is_job_datagram(dgram, len)) {      /* a late answer to a hello: only counted */
        up.c.handshakes++;
        return NCE_V_NONE;
    }
    struct nce_job *job = nce_job_at(up.job);
    if (len < NCE_HDR_LEN)
        return drop(NCE_TRUNCATED);
    struct nce_pkt p;
    const int malformed = nce_parse(dgram, len, &p);   /* the header is read in any case */
    if (p.version != NCE_VERSION)
        return drop(NCE_BAD_VERSION);
    if (job == NULL || !job->leaf || p.job != job->id)
        return drop(NCE_UNKNOWN_JOB);
    const int flagged = (p.flags & NCE_FLAG_TAG) != 0;
    if ((job->tagged || flagged) && !(flagged && job->tagged && nce_authentic(job, &p)))
        return drop(NCE_BAD_TAG);
    if (!(p.flags & NCE_FLAG_RESULT))
        return drop(NCE_BAD_FLAGS);
    const unsigned generation = (p.flags & NCE_GEN_MASK) >> NCE_GEN_SHIFT;
    if (p.count == 0) {                         /* a notice: the spine waits for another leaf */
        const uint32_t body = len - NCE_HDR_LEN - (flagged ? NCE_TAG_LEN : 0);
        if (len < NCE_HDR_LEN + (flagged ? NCE_TAG_LEN : 0) || (body != 0 && body != 8))
            return drop(NCE_BAD_LENGTH);
        if (generation != up.generation)
            return drop(NCE_STALE_GENERATION);
        up.c.notices++;
        return NCE_V_NONE;
    }
    if (malformed >= 0)
        return drop(malformed);
    if (p.format != job->result_format)
        return drop(NCE_BAD_FORMAT);
    if (p.emin != job->e_min)
        return drop(NCE_WINDOW_MISMATCH);
    if (p.rank != up.rank)
        return drop(NCE_NON_MEMBER);
    if (p.slot >= job->nslots)
        return drop(NCE_BAD_SLOT);
    if (p.count > job->k)
        return drop(NCE_BAD_COUNT);
    if (generation != up.generation)            /* the spine restarted: its slots are lost */
        return drop(NCE_STALE_GENERATION);
    const unsigned version = (p.flags & NCE_FLAG_POOL) != 0;
    struct nce_slot *s = &job->slots[2 * p.slot + version];
    if (!s->waiting || s->offset != p.offset || s->count != p.count) {
        up.c.late++;                            /* late or duplicate: changes nothing */
        return NCE_V_NONE;
    }
    /* parse checked payload_len == count * element size of the format, the job's */
    memcpy(s->result, p.payload, p.payload_len);
    s->waiting = 0;
    up.c.results++;
    nce_counters_of(job)->results_sent += job->n;
    nce_count_results(job, s, job->n);          /* to every worker: the emulated multicast */
    act->job = job;
    act->slot = s;
    act->rank = up.rank;
    act->members = job->n;
    act->version = (uint8_t)version;
    return NCE_V_SEND_ALL;
}
