/* Slots: each job's pool of slots, two versions each (the SwitchML shadow copy), the slot rules
 * of docs/protocol.md ("Late and duplicate packets") and rule 1: a new contribution is added
 * into the slot version's 64-bit integer accumulators (NC8 codes, or a spine's int partial
 * sums); the last of N completes the slot, whose result is encoded once (re-compression) and
 * stored. As ncina.aggregator.backends.python.slots (and hierarchy.SpineSlots). */
#include <stdlib.h>
#include <string.h>

#include "nc8.h"
#include "state.h"

int nce_pool_alloc(struct nce_job *job)
{
    const size_t versions = 2 * (size_t)job->nslots;
    job->slots = calloc(versions, sizeof *job->slots);
    /* One arena each for the accumulators and the stored results of every slot version. */
    int64_t *acc = calloc(versions * job->k, sizeof *acc);
    uint8_t *res = calloc(versions * job->k, job->elem_size);
    uint8_t *resends = calloc(versions, job->n);
    uint64_t *resent_ns = calloc(versions * job->n, sizeof *resent_ns);
    if (job->slots == NULL || acc == NULL || res == NULL || resends == NULL ||
        resent_ns == NULL) {
        free(acc);
        free(res);
        free(resends);
        free(resent_ns);
        free(job->slots);
        job->slots = NULL;
        return -1;
    }
    for (size_t i = 0; i < versions; i++) {
        job->slots[i].acc = acc + i * job->k;
        job->slots[i].result = res + i * job->k * job->elem_size;
        job->slots[i].resends = resends + i * job->n;
        job->slots[i].resent_ns = resent_ns + i * job->n;
    }
    return 0;
}

void nce_pool_free(struct nce_job *job)
{
    if (job->slots == NULL)
        return;
    free(job->slots[0].acc);
    free(job->slots[0].result);
    free(job->slots[0].resends);
    free(job->slots[0].resent_ns);
    free(job->slots);
    job->slots = NULL;
}

/* Whether offset is the offset of the slot version's last round or before it, in serial-number
 * arithmetic mod 2^32 (RFC 1982): offsets are each slot's running element counter. */
static inline int not_after(const struct nce_slot *s, uint32_t offset)
{
    return (uint32_t)(s->offset - offset) < 0x80000000u;
}

/* The held round's chunk is different: older (late) or not the job's (chunk_mismatch). */
static inline enum nce_rule other_chunk(const struct nce_slot *s, uint32_t offset)
{
    return offset != s->offset && not_after(s, offset) ? NCE_R_LATE : NCE_R_MISMATCH;
}

enum nce_rule nce_slot_rule(const struct nce_job *job, const struct nce_pkt *p, unsigned version)
{
    const uint64_t bit = 1ULL << p->rank;
    const struct nce_slot *s = &job->slots[2 * p->slot + version];
    const struct nce_slot *o = &job->slots[2 * p->slot + (version ^ 1)];
    if ((o->bitmap & bit) && !o->complete)
        return NCE_R_LATE;                      /* L1: the rank waits for the other version */
    const int held = s->contributors != 0 && s->offset == p->offset && s->count == p->count;
    if (s->bitmap & bit) {                      /* L2: its latest contribution is to this one */
        if (!held)
            return other_chunk(s, p->offset);
        return s->complete ? NCE_R_RESEND : NCE_R_DUPLICATE;
    }
    if (s->bitmap != 0) {                       /* L3: a round the others contribute to */
        if (!held)
            return other_chunk(s, p->offset);
        return s->complete ? NCE_R_LATE : NCE_R_CONTRIBUTE;
    }
    if (s->contributors != 0 && not_after(s, p->offset))
        return NCE_R_LATE;                      /* L4: the last round's chunk, or older */
    return NCE_R_CONTRIBUTE;
}

/* The result payload of a complete slot version, once: nc8 keyed by the job's seed and the
 * chunk's job, slot, version, offset and the slot version's use, or the exact int (64-bit) or
 * int32 sums. */
static void encode_result(const struct nce_job *job, struct nce_slot *s)
{
    const unsigned n = s->count;
    if (job->result_format == NCE_FMT_NC8) {
        const size_t at = (size_t)(s - job->slots);     /* slot at / 2, version at % 2 */
        const uint32_t key = nc8_result_key(job->seed, job->id, (uint16_t)(at >> 1),
                                            (unsigned)(at & 1), s->offset, s->uses);
        nc8_int_to_codes(s->acc, s->result, n, key);
    } else if (job->result_format == NCE_FMT_INT) {
        for (unsigned i = 0; i < n; i++)
            nce_put_be64(s->result + 8 * (size_t)i, (uint64_t)s->acc[i]);
    } else {    /* int32: admission made the window keep every sum within +-2^30 */
        for (unsigned i = 0; i < n; i++) {
            const uint32_t v = (uint32_t)(int32_t)s->acc[i];
            uint8_t *at = s->result + 4 * (size_t)i; /* result holds k elements of 4 bytes */
            at[0] = (uint8_t)(v >> 24);
            at[1] = (uint8_t)(v >> 16);
            at[2] = (uint8_t)(v >> 8);
            at[3] = (uint8_t)v;
        }
    }
    s->uses++;
}

/* A spine's contribution: a leaf's exact partial sums, big-endian int64 lanes, stored by the
 * first contribution and added by the others (within the bound: no sum overflows). */
static void add_partial_sums(int64_t *acc, const uint8_t *lanes, unsigned n, int first)
{
    for (unsigned i = 0; i < n; i++) {
        const int64_t v = (int64_t)nce_get_be64(lanes + 8 * (size_t)i);
        acc[i] = first ? v : acc[i] + v;
    }
}

int nce_contribute(struct nce_job *job, struct nce_slot *s, const struct nce_pkt *p,
                   unsigned version)
{
    const uint64_t bit = 1ULL << p->rank;
    const int first = s->bitmap == 0;
    if (first) {                                /* the first contribution starts the chunk */
        s->offset = p->offset;
        s->count = p->count;
        s->contributors = 0;
        s->complete = 0;
        s->waiting = 0;
        memset(s->resends, 0, job->n);
    }
    /* count <= k lanes (admission); int lanes were checked against the job's bound. */
    if (job->uplink_format == NCE_FMT_INT)
        add_partial_sums(s->acc, p->payload, p->count, first);
    else if (first)
        nc8_codes_to_int(p->payload, s->acc, p->count);
    else
        nc8_accumulate(s->acc, p->payload, p->count);
    s->bitmap |= bit;
    job->slots[2 * p->slot + (version ^ 1)].bitmap &= ~bit;    /* the shadow copy's bit */
    nce_counters_of(job)->contributions++;
    /* The slot rules admit a contribution to an incomplete round only: at most the Nth. */
    if (++s->contributors != job->n)
        return 0;
    s->complete = 1;
    if (job->leaf)                              /* the sum goes up; the spine's result due */
        s->waiting = 1;
    else
        encode_result(job, s);
    return 1;
}

static uint64_t resend_interval_ns = 1000000000u;  /* slots.RESEND_INTERVAL */

void nce_set_resend_interval(uint64_t ns)
{
    resend_interval_ns = ns;
}

int nce_may_resend(struct nce_slot *s, uint16_t rank, uint64_t now_ns)
{
    /* rank < n: admission checked it */
    if (s->resends[rank] >= NCE_RESEND_BURST && now_ns - s->resent_ns[rank] < resend_interval_ns)
        return 0;
    if (s->resends[rank] < NCE_RESEND_BURST)
        s->resends[rank]++;
    s->resent_ns[rank] = now_ns;
    return 1;
}

int nce_pool_restart_if_idle(struct nce_job *job)
{
    const size_t versions = 2 * (size_t)job->nslots;
    for (size_t i = 0; i < versions; i++)
        if ((job->slots[i].contributors != 0 && !job->slots[i].complete) ||
            job->slots[i].waiting)
            return 0;               /* a round is being filled, or waits for a spine: not idle */
    for (size_t i = 0; i < versions; i++) {
        struct nce_slot *s = &job->slots[i];
        s->bitmap = 0;
        s->contributors = 0;
        s->complete = 0;
        s->waiting = 0;
        s->offset = 0;
        s->count = 0;
        memset(s->resends, 0, job->n);
    }
    return 1;
}
