/* ncina DPDK data plane: internal types shared by parse.c, slots.c, result.c and loop.c. */
#ifndef NCD_PRIV_H
#define NCD_PRIV_H

#include <stdint.h>

#include <rte_byteorder.h>
#include <rte_ether.h>

#include "blake2b.h"
#include "ncd.h"

#define NCD_HDR_LEN 16          /* the ncina header, docs/protocol.md */
#define NCD_VERSION 1
#define NCD_FLAG_RESULT 0x01
#define NCD_FLAG_RETX 0x02
#define NCD_FLAG_POOL 0x04
#define NCD_GEN_SHIFT 3
#define NCD_GEN_MASK 0x78
#define NCD_FLAG_TAG 0x80
#define NCD_TAG_LEN 8
#define NCD_NOTICE_LEN (NCD_HDR_LEN + 8)   /* header and the 64-bit bitmap, before any tag */
#define NCD_FMT_NC8 0
#define NCD_FMT_INT 1
#define NCD_MAX_WORKERS 64      /* the bitmap is one 64-bit word, as in every backend */
#define NCD_MAX_K 1024
/* Ethernet + IPv4 (no options) + UDP + ncina header in front of a payload. */
#define NCD_FRAME_OVERHEAD (RTE_ETHER_HDR_LEN + 20 + 8 + NCD_HDR_LEN)
/* The data room of every mbuf of the pool: each frame the data plane sends is built in one
 * mbuf, so no job may have a result frame larger than this (checked when the job is added and
 * the key set, and again before every write of a fresh mbuf). */
#define NCD_FRAME_ROOM 2048u

/* One uplink datagram as parsed from a frame; addresses and the UDP port in network order. */
struct ncd_pkt {
    const struct rte_ether_hdr *eth;
    uint32_t src_ip, dst_ip;
    uint16_t src_port;
    const uint8_t *dgram;       /* UDP payload: the ncina header and its payload */
    uint32_t dgram_len;
    /* header fields, host order */
    uint8_t version, flags, format;
    int8_t emin;
    uint16_t job, rank, slot, count;
    uint32_t offset;
    const uint8_t *payload;
    uint32_t payload_len;       /* without the tag */
};

/* A member of a job: where its results go. ip/port network order. */
struct ncd_member {
    uint32_t ip;
    uint16_t port;
    uint8_t known;              /* address configured or learned */
    uint8_t has_mac;
    struct rte_ether_addr mac;
    uint32_t agg_ip;            /* the aggregator address this member sends to (source of results) */
};

/* One version of one slot. */
struct ncd_slot {
    uint64_t bitmap;
    uint16_t contributors;
    uint16_t count;             /* elements of the chunk */
    uint32_t offset;            /* element offset of the chunk */
    uint8_t complete;
    uint32_t payload_sum;       /* unreduced one's-complement sum of the stored result payload */
    int64_t *acc;               /* k accumulators */
    uint8_t *result;            /* stored result payload, count * element size bytes */
};

struct ncd_job {
    uint16_t id, n, k, nslots;
    int8_t e_min;
    uint8_t span;
    uint8_t result_format;
    uint8_t elem_size;          /* of the result format */
    uint64_t seed;
    uint64_t completions;       /* slot completions so far: the key ring's consumer index */
    uint64_t keys_written;      /* the key ring's producer index (control plane) */
    uint64_t *keys;             /* key ring, key_mask + 1 entries, or NULL */
    uint32_t key_mask;
    uint8_t tagged;             /* the job has an authentication key */
    struct ncd_b2b mac;         /* BLAKE2b state with the key block absorbed (copied per tag) */
    struct ncd_counters c;
    struct ncd_member *members; /* n */
    struct ncd_slot *slots;     /* 2 * nslots: slot s version v at [2 * s + v] */
};

/* What the engine asks the I/O side to do with an input frame. */
enum ncd_verdict {
    NCD_V_NONE = 0,     /* consumed (dropped or absorbed), nothing to send */
    NCD_V_ARP,          /* ARP request for us: reply */
    NCD_V_SEND_ALL,     /* slot completed: a result to every member */
    NCD_V_SEND_ONE,     /* stored result to the sender */
    NCD_V_IGNORE,       /* not ncina traffic */
    NCD_V_NOTICE,       /* a notice back to the sender */
};

struct ncd_action {
    struct ncd_job *job;
    const struct ncd_slot *slot;
    uint16_t rank;
    uint8_t version;
    /* NCD_V_NOTICE: the slot and offset of the packet answered, and the contributors' bitmap */
    uint16_t slot_index;
    uint32_t offset;
    uint64_t bitmap;
};

/* Module state (slots.c). */
extern struct ncd_job *ncd_jobs[65536];
extern struct ncd_counters ncd_global;
extern struct ncd_io ncd_iostats;
extern struct rte_ether_addr ncd_mac;
extern uint32_t ncd_ip;        /* network order; 0 = any */
extern uint16_t ncd_port_be;   /* network order */
extern uint8_t ncd_generation;

/* parse.c */
enum ncd_verdict ncd_classify(const uint8_t *frame, uint32_t len, struct ncd_pkt *p);
int ncd_parse_dgram(struct ncd_pkt *p);

/* slots.c: the state machine; fills act for SEND_ALL / SEND_ONE. */
enum ncd_verdict ncd_engine_input(const uint8_t *frame, uint32_t len, struct ncd_action *act);

/* result.c */
uint32_t ncd_result_frame_len(const struct ncd_job *job, const struct ncd_slot *slot);
uint32_t ncd_build_result(uint8_t *buf, const struct ncd_job *job, const struct ncd_slot *slot,
                          unsigned version, uint16_t rank);
void ncd_encode_result(struct ncd_job *job, struct ncd_slot *slot);
void ncd_build_arp_reply(uint8_t *frame);
uint32_t ncd_notice_frame_len(const struct ncd_job *job);
uint32_t ncd_build_notice(uint8_t *frame, const struct ncd_action *a);
void ncd_tag(const struct ncd_job *job, const uint8_t *msg, uint32_t len, uint8_t *tag);
uint64_t ncd_next_key(struct ncd_job *job);

#endif
