/* Members: each job's ranks and their addresses (configured, or learned from a first valid
 * datagram), and the authentication tag every datagram of a keyed job carries (docs/protocol.md
 * "Members" and "Authentication tag"): steps 7, 10 and 16 of "Order of checks", as
 * ncina.aggregator.backends.python.members. The contributors' bitmaps are the slots' (slots.c). */
#include <stdlib.h>
#include <string.h>

#include "state.h"

/* A member's address as the word nce_member.addr holds: the IPv4 address, the port and bit 48
 * (known), so that 0 is "unknown". */
static inline uint64_t addr_word(uint32_t ip_be, uint16_t port_be)
{
    return 1ULL << 48 | (uint64_t)port_be << 32 | ip_be;
}

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
    m->addr = addr_word(ip_be, m->port);
    return 0;
}

void nce_members_forget_learned(struct nce_job *job)
{
    for (uint16_t r = 0; r < job->n; r++)
        if (!job->members[r].configured)
            memset(&job->members[r], 0, sizeof job->members[r]);
}

void nce_members_new_set(struct nce_job *job, int gated)
{
    nce_members_forget_learned(job);
    for (uint16_t r = 0; r < job->n; r++)
        __atomic_store_n(&job->members[r].nonce, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&job->gated, (uint8_t)(gated != 0), __ATOMIC_RELEASE);
}

void nce_member_said_hello(struct nce_job *job, uint16_t rank, uint32_t nonce,
                           const struct nce_from *from)
{
    if (rank >= job->n || __atomic_load_n(&job->members[rank].nonce, __ATOMIC_RELAXED) != 0)
        return;
    /* The address first, then the nonce that admits the rank: a strand that sees the nonce sees
     * the address, so a late datagram of the last set's client is not learned in between. */
    if (__atomic_load_n(&job->gated, __ATOMIC_ACQUIRE))
        nce_member_learn(job, rank, from);
    __atomic_store_n(&job->members[rank].nonce, nonce, __ATOMIC_RELEASE);
}

int nce_members_new_set_comes(const struct nce_job *job, uint16_t rank, uint32_t nonce,
                              const struct nce_from *from, int probe, int quiet)
{
    const uint32_t held =
        rank < job->n ? __atomic_load_n(&job->members[rank].nonce, __ATOMIC_RELAXED) : 0;
    if (nonce != 0 && nonce == held)
        return 0;               /* the same client: its hello again */
    if (nonce != 0 && held != 0 && !probe) {
        const uint64_t addr = __atomic_load_n(&job->members[rank].addr, __ATOMIC_ACQUIRE);
        if (from == NULL || addr == 0 || (uint32_t)addr == from->src_ip)
            return NCE_NEW_INCARNATION;
    }
    if (!quiet)
        return 0;
    if (nonce != 0)
        for (uint16_t r = 0; r < job->n; r++)
            if (__atomic_load_n(&job->members[r].nonce, __ATOMIC_RELAXED) != 0)
                return 0;       /* a set with nonces: only a nonce starts another */
    return NCE_QUIET;
}

/* Whether rank may send from this address: an unknown rank may (and is learned), a known one
 * only from its own address; in a gated set, only a rank that said its hello in it. */
int nce_member_accepts(const struct nce_job *job, uint16_t rank, const struct nce_from *from)
{
    if (__atomic_load_n(&job->gated, __ATOMIC_ACQUIRE) &&
        __atomic_load_n(&job->members[rank].nonce, __ATOMIC_ACQUIRE) == 0)
        return 0;
    const uint64_t addr = __atomic_load_n(&job->members[rank].addr, __ATOMIC_ACQUIRE);
    return addr == 0 || addr == addr_word(from->src_ip, from->src_port);
}

/* A valid datagram's rank gets (or keeps) its address; its link address is where results go.
 *
 * Several strands (engine.h, nce_set_strands) may learn the same rank at once: its chunks of other
 * slots go to other strands. The address is claimed as one word by compare-and-swap, so the
 * first sender wins and a strand whose sender lost gets 0 (the datagram is a stranger's). A strand
 * whose sender matches then makes sure it sees the member's fields (it builds the results of
 * its slots from them) and writes those it does not see yet: every strand writes the same values
 * (one address; the link address and destination that one sender's frames carry), so two
 * strands writing at once leave no mixed state (atomic stores, no torn word). Once learned, the
 * fields are only read: the member's cache line stays shared between strands. */
int nce_member_learn(struct nce_job *job, uint16_t rank, const struct nce_from *from)
{
    struct nce_member *m = &job->members[rank];
    const uint64_t mine = addr_word(from->src_ip, from->src_port);
    if (__atomic_load_n(&m->addr, __ATOMIC_ACQUIRE) != mine) {
        uint64_t seen = 0;
        if (!__atomic_compare_exchange_n(&m->addr, &seen, mine, 0, __ATOMIC_ACQ_REL,
                                         __ATOMIC_ACQUIRE) &&
            seen != mine)
            return 0;           /* known under another address: another strand's sender won */
    }
    if (!__atomic_load_n(&m->known, __ATOMIC_RELAXED) ||
        __atomic_load_n(&m->ip, __ATOMIC_RELAXED) != from->src_ip ||
        __atomic_load_n(&m->port, __ATOMIC_RELAXED) != from->src_port) {
        __atomic_store_n(&m->ip, from->src_ip, __ATOMIC_RELAXED);
        __atomic_store_n(&m->port, from->src_port, __ATOMIC_RELAXED);
        __atomic_store_n(&m->known, 1, __ATOMIC_RELAXED);
    }
    if (from->link != NULL && !__atomic_load_n(&m->has_link, __ATOMIC_ACQUIRE)) {
        for (unsigned i = 0; i < sizeof m->link; i++)
            __atomic_store_n(&m->link[i], from->link[i], __ATOMIC_RELAXED);
        __atomic_store_n(&m->has_link, 1, __ATOMIC_RELEASE);
    }
    if (__atomic_load_n(&m->agg_ip, __ATOMIC_RELAXED) != from->dst_ip)
        __atomic_store_n(&m->agg_ip, from->dst_ip, __ATOMIC_RELAXED);
    return 1;
}

const struct nce_member *nce_member_of(const struct nce_action *act, uint16_t rank)
{
    return &act->job->members[rank];
}

int nce_blake2b(uint8_t *out, uint32_t outlen, const uint8_t *key, uint32_t keylen,
                const uint8_t *msg, uint32_t len)
{
    if (outlen < 1 || outlen > 64 || keylen > 64)   /* BLAKE2b's digest and key limits */
        return -1;
    struct ncd_b2b s;
    ncd_b2b_init(&s, outlen, key, keylen);
    ncd_b2b_update(&s, msg, len);
    ncd_b2b_final(&s, out);
    return 0;
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
