/* Members: each job's ranks and their addresses (configured, or learned from a first valid
 * datagram), and the authentication tag every datagram of a keyed job carries (docs/protocol.md
 * "Members" and "Authentication tag"): steps 7, 10 and 16 of "Order of checks", as
 * ncina.aggregator.members. The contributors' bitmaps are the slots' (slots.c). */
#include <stdlib.h>
#include <string.h>

#include "state.h"

int nce_members_alloc(struct nce_job *job)
{
    job->members = calloc(job->n, sizeof *job->members);
    return job->members != NULL ? 0 : -1;
}

void nce_members_free(struct nce_job *job)
{
    free(job->members);
    job->members = NULL;
}

int nce_members_set(struct nce_job *job, uint16_t rank, uint32_t ip_be, uint16_t port)
{
    if (rank >= job->n)
        return -1;
    struct nce_member *m = &job->members[rank];
    m->ip = ip_be;
    m->port = nce_port_be(port);
    m->known = 1;
    m->configured = 1;
    return 0;
}

void nce_members_forget_learned(struct nce_job *job)
{
    for (uint16_t r = 0; r < job->n; r++)
        if (!job->members[r].configured)
            memset(&job->members[r], 0, sizeof job->members[r]);
}

/* Whether rank may send from this address: an unknown rank may (and is learned), a known one
 * only from its own address. */
int nce_member_accepts(const struct nce_job *job, uint16_t rank, const struct nce_from *from)
{
    const struct nce_member *m = &job->members[rank];
    return !m->known || (m->ip == from->src_ip && m->port == from->src_port);
}

/* A valid datagram's rank gets (or keeps) its address; its link address is where results go. */
void nce_member_learn(struct nce_job *job, uint16_t rank, const struct nce_from *from)
{
    struct nce_member *m = &job->members[rank];
    if (!m->known) {
        m->ip = from->src_ip;
        m->port = from->src_port;
        m->known = 1;
    }
    if (!m->has_link && from->link != NULL) {
        memcpy(m->link, from->link, sizeof m->link);
        m->has_link = 1;
    }
    m->agg_ip = from->dst_ip;
}

const struct nce_member *nce_member_of(const struct nce_action *act, uint16_t rank)
{
    return &act->job->members[rank];
}

void nce_blake2b(uint8_t *out, uint32_t outlen, const uint8_t *key, uint32_t keylen,
                 const uint8_t *msg, uint32_t len)
{
    struct ncd_b2b s;
    ncd_b2b_init(&s, outlen, key, keylen);
    ncd_b2b_update(&s, msg, len);
    ncd_b2b_final(&s, out);
}

void nce_tag_key(struct nce_job *job, const uint8_t *key, uint32_t keylen)
{
    ncd_b2b_init(&job->mac, NCE_TAG_LEN, key, keylen);
    job->tagged = 1;
}

/* The tag of msg[0..len) with the job's key. */
void nce_tag(const struct nce_job *job, const uint8_t *msg, uint32_t len, uint8_t *tag)
{
    struct ncd_b2b s = job->mac;
    ncd_b2b_update(&s, msg, len);
    ncd_b2b_final(&s, tag);
}

/* Whether the datagram's authentication is what its job asks for: no TAG flag on an untagged
 * job; the TAG flag and a matching tag (compared in constant time) on a keyed one. */
int nce_authentic(const struct nce_job *job, const struct nce_pkt *p)
{
    const int flagged = (p->flags & NCE_FLAG_TAG) != 0;
    if (!job->tagged || !flagged)
        return !job->tagged && !flagged;
    uint8_t tag[NCE_TAG_LEN];
    const uint32_t body = p->dgram_len - NCE_TAG_LEN;
    nce_tag(job, p->dgram, body, tag);
    uint8_t diff = 0;
    for (int i = 0; i < NCE_TAG_LEN; i++)
        diff |= tag[i] ^ p->dgram[body + i];
    return diff == 0;
}
