/* ncina slot engine: what an I/O layer calls per datagram (not part of any cdef).
 *
 * An I/O layer hands each received UDP payload to nce_input with the sender's address and the
 * address it was sent to; the verdict says what to send back, and the builders write those
 * datagrams (UDP payloads) into the caller's buffers, each checking the buffer's size first.
 */
#ifndef NCE_DATAPATH_H
#define NCE_DATAPATH_H

#include <stdint.h>

#include "engine.h"

#define NCE_HDR_LEN 16          /* the ncina header, docs/protocol.md */
#define NCE_TAG_LEN 8
#define NCE_MAX_WORKERS 64      /* the bitmap is one 64-bit word, as in every backend */
#define NCE_MAX_MTU 9216        /* the largest link MTU, IPv4 bytes */
#define NCE_IPV4_UDP_LEN 28     /* IPv4 without options, then UDP */
/* The largest K: NC8 results (one byte an element) in one packet of the largest MTU, as
 * ncina.proto.wire.MAX_K = payload_room(MAX_MTU). tests/test_wire.py checks every name here. */
#define NCE_MAX_K (NCE_MAX_MTU - NCE_IPV4_UDP_LEN - NCE_HDR_LEN)
/* The most data-plane strands (threads, each with its own share of the slots) an engine serves. */
#define NCE_MAX_STRANDS 8

/* Where a datagram came from; addresses and the port in network order. */
struct nce_from {
    uint32_t src_ip;
    uint16_t src_port;
    uint32_t dst_ip;            /* the address it was sent to (the source of our replies) */
    const uint8_t *link;        /* the sender's 6-byte link-layer address, or NULL */
};

/* A member of a job: where its results go. ip/port network order. */
struct nce_member {
    uint32_t ip;
    uint16_t port;
    uint8_t known;              /* address configured or learned */
    uint8_t configured;         /* set by nce_members_set: kept when a job restarts */
    uint8_t has_link;
    uint8_t link[6];            /* learned from its first valid datagram (DPDK: the MAC) */
    uint32_t agg_ip;            /* the aggregator address this member sends to */
    /* ip, port and bit 48 (known) as one word: strands that learn a rank at the same moment
     * agree on one address (compare-and-swap, members.c); 0 while unknown. */
    uint64_t addr;
    /* The incarnation nonce of the rank's first hello in the job's current set of workers (0:
     * none yet; docs/protocol.md "A new set of workers"): written by strand 0's handshake only. */
    uint32_t nonce;
};

struct nce_job;
struct nce_slot;

/* What the engine asks the I/O layer to send for an input datagram. */
enum nce_verdict {
    NCE_V_NONE = 0,     /* consumed (dropped or absorbed), nothing to send */
    NCE_V_SEND_ALL,     /* slot completed: a result to every member, ranks 0..n-1 */
    NCE_V_SEND_ONE,     /* the stored result to the sender (rank) */
    NCE_V_NOTICE,       /* a notice back to the sender */
    NCE_V_DESCRIPTOR,   /* the job handshake's answer back to the sender (job may be NULL) */
};

struct nce_action {
    struct nce_job *job;
    const struct nce_slot *slot;
    uint16_t rank;              /* the sender */
    uint16_t members;           /* the job's N (SEND_ALL sends to ranks 0..members-1) */
    uint8_t version;
    /* NCE_V_NOTICE: the slot and offset of the datagram answered, and the bitmap (none in a
     * restart notice: the header alone) */
    uint16_t slot_index;
    uint32_t offset;
    uint64_t bitmap;
    uint8_t has_bitmap;
    /* NCE_V_DESCRIPTOR: the job id asked for and the answer's status */
    uint8_t descriptor;         /* 1: the reply is a job descriptor, not a result or notice */
    uint8_t status;
    uint16_t job_id;
    uint8_t restarted;          /* the hello started its job afresh (handshake.c) */
    uint8_t unjoined;           /* a probe's rank has not joined this start: FLAG_PROBE set */
    /* Besides the verdict's replies, a datagram to a leaf's spine (nce_build_uplink) to
     * up_ip:up_port (network order): NCE_UP_SUM, the slot version's partial sums (up_retx: a
     * retransmission), or NCE_UP_HELLO, the leaf's hello. */
    uint8_t up;
    uint8_t up_retx;
    uint32_t up_ip;
    uint16_t up_port;
};

#define NCE_UP_NONE 0
#define NCE_UP_SUM 1
#define NCE_UP_HELLO 2

/* Strands: an I/O layer may run up to NCE_MAX_STRANDS data-plane threads (strands) on one
 * engine, each owning a share of the slots (nce_strand_of) so that no slot is touched by two
 * strands and the hot path takes no lock. nce_strand is the calling thread's strand: which
 * per-strand counters and epoch it writes. A strand's thread sets it once at its start; it is 0
 * in every other thread, so a one-strand I/O layer (the socket backend) and the offline entry
 * points need nothing. */
extern __thread unsigned nce_strand;

/* The strand (0..strands-1) that owns a datagram when `strands` strands run: a chunk of (job, slot)
 * belongs to strand slot % strands; a job datagram (the handshake, which may restart every slot of
 * its job) to strand 0; one whose header cannot be read (too short, another version) touches
 * no slot and stays where it arrived, strand `here`. */
unsigned nce_strand_of(const uint8_t *dgram, uint32_t len, unsigned strands, unsigned here);
/* Whether a datagram is a job datagram (the handshake's). */
int nce_is_job_datagram(const uint8_t *dgram, uint32_t len);
/* Read-only and cheap: whether a job datagram may restart its job (a well-formed, authentic
 * hello to a job quiet for nce_set_restart_idle's time), so that strand 0 must park the others
 * before nce_input; every other job datagram is handled with them running. */
int nce_hello_may_restart(const uint8_t *dgram, uint32_t len);
/* Set by an I/O layer around nce_input when it did not park the other strands for a job
 * datagram: the handshake then restarts no job (the calling thread's; 0 by default). */
extern __thread int nce_no_restart;

/* Each strand's epoch: odd while it handles a batch (nce_dp_enter .. nce_dp_leave), so that
 * nce_job_remove knows when no batch of any strand holds a removed job's pointer any more. An I/O
 * layer brackets every batch it hands to nce_input with the two. One cache line per strand. */
struct nce_epoch {
    uint64_t v;
} __attribute__((aligned(64)));
extern struct nce_epoch nce_dp_epoch[NCE_MAX_STRANDS];

static inline void nce_dp_enter(void)
{
    __atomic_add_fetch(&nce_dp_epoch[nce_strand].v, 1, __ATOMIC_SEQ_CST);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

static inline void nce_dp_leave(void)
{
    __atomic_add_fetch(&nce_dp_epoch[nce_strand].v, 1, __ATOMIC_RELEASE);
}

/* The reason nce_error() reports; I/O layers write their setup errors here too. */
extern char nce_errbuf[256];

/* The per-datagram decision (docs/protocol.md): counts it, updates the slots, fills act. */
enum nce_verdict nce_input(const uint8_t *dgram, uint32_t len, const struct nce_from *from,
                           struct nce_action *act);
/* Bytes of the reply datagram the action asks for (a result, or a notice). */
uint32_t nce_reply_len(const struct nce_action *act);
/* Write the reply datagram for rank (a result or a notice) into buf of cap bytes; returns its
 * length, or 0 (nothing written) when cap is too small. */
uint32_t nce_build_reply(uint8_t *buf, uint32_t cap, const struct nce_action *act,
                         uint16_t rank);
/* Write the datagram to the spine that act->up asks for into buf of cap bytes; its length, or
 * 0 (nothing written) when cap is too small. */
uint32_t nce_build_uplink(uint8_t *buf, uint32_t cap, const struct nce_action *act);
/* SEND_ALL: where rank's result goes (address, port, link address, the address it sent to).
 * SEND_ONE, NOTICE and DESCRIPTOR go back to the sender of the input datagram (for SEND_ONE that is the
 * member's address: only a member's datagram gets there). */
const struct nce_member *nce_member_of(const struct nce_action *act, uint16_t rank);

#endif
