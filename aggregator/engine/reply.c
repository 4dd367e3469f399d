/* Reply: the datagrams the engine sends (docs/protocol.md): a completed slot's stored result
 * (one per member: the emulated multicast; or one back to a member that lost it), the notices,
 * and, written by handshake.c, the job handshake's answer; each counted as it is decided. Every
 * result and notice carries the engine's generation, a keyed job's its tag. As
 * ncina.aggregator.backends.python.reply. */
#include <string.h>

#include "state.h"

uint32_t nce_result_len(const struct nce_job *job, const struct nce_slot *s)
{
    return NCE_HDR_LEN + (uint32_t)s->count * job->elem_size + (job->tagged ? NCE_TAG_LEN : 0);
}

uint32_t nce_notice_len(const struct nce_job *job, int has_bitmap)
{
    return (has_bitmap ? NCE_NOTICE_LEN : NCE_HDR_LEN) + (job->tagged ? NCE_TAG_LEN : 0);
}

void nce_count_results(struct nce_job *job, const struct nce_slot *s, uint32_t copies)
{
    struct nce_counters *c = nce_counters_of(job);
    c->packets_out += copies;
    c->bytes_out += (uint64_t)copies * nce_result_len(job, s);
}

enum nce_verdict nce_notice(struct nce_job *job, const struct nce_pkt *p, uint64_t bitmap,
                            int has_bitmap, struct nce_action *act)
{
    act->slot = NULL;
    act->slot_index = p->slot;
    act->offset = p->offset;
    act->bitmap = bitmap;
    act->has_bitmap = (uint8_t)(has_bitmap != 0);
    struct nce_counters *c = nce_counters_of(job);
    c->notices_sent++;
    c->packets_out++;
    c->bytes_out += nce_notice_len(job, has_bitmap);
    return NCE_V_NOTICE;
}

/* The ncina header of a result or notice for pool version `version`. */
static void put_header(uint8_t *h, const struct nce_job *job, unsigned version, uint16_t rank,
                       uint16_t slot, uint16_t count, uint32_t offset)
{
    h[0] = NCE_VERSION;
    h[1] = (uint8_t)(NCE_FLAG_RESULT | (version ? NCE_FLAG_POOL : 0) |
                     nce_generation << NCE_GEN_SHIFT | (job->tagged ? NCE_FLAG_TAG : 0));
    h[2] = job->result_format;
    h[3] = (uint8_t)job->e_min;
    h[4] = (uint8_t)(job->id >> 8);
    h[5] = (uint8_t)job->id;
    h[6] = (uint8_t)(rank >> 8);
    h[7] = (uint8_t)rank;
    h[8] = (uint8_t)(slot >> 8);
    h[9] = (uint8_t)slot;
    h[10] = (uint8_t)(count >> 8);
    h[11] = (uint8_t)count;
    h[12] = (uint8_t)(offset >> 24);
    h[13] = (uint8_t)(offset >> 16);
    h[14] = (uint8_t)(offset >> 8);
    h[15] = (uint8_t)offset;
}

uint32_t nce_reply_len(const struct nce_action *a)
{
    if (a->descriptor)
        return nce_descriptor_len(a);
    return a->slot != NULL ? nce_result_len(a->job, a->slot)
                           : nce_notice_len(a->job, a->has_bitmap);
}

uint32_t nce_build_reply(uint8_t *buf, uint32_t cap, const struct nce_action *a, uint16_t rank)
{
    if (a->descriptor)
        return nce_build_descriptor(buf, cap, a);
    const struct nce_job *job = a->job;
    const uint32_t len = nce_reply_len(a);
    if (len > cap)
        return 0;
    uint32_t body;
    if (a->slot != NULL) {                      /* a result */
        const struct nce_slot *s = a->slot;
        body = (uint32_t)s->count * job->elem_size;
        put_header(buf, job, a->version, rank, (uint16_t)((s - job->slots) >> 1), s->count,
                   s->offset);
        memcpy(buf + NCE_HDR_LEN, s->result, body);
    } else {                                    /* a notice: the contributors' bitmap */
        body = a->has_bitmap ? 8 : 0;           /* (a restart notice: none) */
        put_header(buf, job, a->version, rank, a->slot_index, 0, a->offset);
        if (a->has_bitmap)
            nce_put_be64(buf + NCE_HDR_LEN, a->bitmap);
    }
    if (job->tagged)                            /* one tag per destination: rank differs */
        nce_tag(job, buf, NCE_HDR_LEN + body, buf + NCE_HDR_LEN + body);
    return len;
}
