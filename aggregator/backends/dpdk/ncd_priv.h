/* ncina DPDK data plane: what classify.c, frames.c and loop.c share. The protocol itself is
 * the slot engine's (aggregator/engine/datapath.h); this layer only wraps its datagrams in
 * Ethernet, IPv4 and UDP headers and answers ARP. */
#ifndef NCD_PRIV_H
#define NCD_PRIV_H

#include <stdint.h>

#include <rte_byteorder.h>
#include <rte_ether.h>

#include "datapath.h"
#include "ncd.h"

/* Ethernet + IPv4 (no options) + UDP in front of a datagram. */
#define NCD_L2L4_LEN (RTE_ETHER_HDR_LEN + 20 + 8)
/* The data room of every mbuf of the pool: each frame the data plane sends is built in one
 * mbuf, so no job may have a result frame larger than this (checked when the job is added and
 * the key set, and again before every write). */
#define NCD_FRAME_ROOM 2048u

/* Module state (classify.c; the per-strand counters are loop.c's). */
/* Strand 0's port counters (loop.c): a leaf's link to its spine is strand 0's (a leaf serves on
 * one strand), as is everything the port does before ncd_run. */
extern struct ncd_io *const ncd_leaf_io;
extern struct rte_ether_addr ncd_mac;
extern uint32_t ncd_ip;        /* network order; 0 = any */
extern uint16_t ncd_port_be;   /* network order */

/* A leaf's spine (ncd_set_spine) and the MAC its frames go to. */
struct ncd_spine {
    uint32_t ip;                /* network order; 0: not a leaf */
    uint16_t port;              /* network order */
    uint8_t known;              /* mac learned */
    struct rte_ether_addr mac;
    uint64_t next_request_ns;   /* no ARP request for it before (CLOCK_MONOTONIC) */
    uint64_t interval_ns;       /* between two requests */
};
extern struct ncd_spine ncd_spine;

/* What to do with a datagram to the spine (ncd_uplink_route). */
enum ncd_route {
    NCD_R_SEND = 0,     /* the spine's MAC is known: build the frame (ncd_frame_spine) */
    NCD_R_ARP,          /* unknown: dropped, counted; send an ARP request instead */
    NCD_R_WAIT,         /* unknown: dropped, counted; a request went out lately */
};

enum ncd_class {
    NCD_C_IGNORE = 0,   /* not ncina traffic */
    NCD_C_ARP,          /* ARP request for our address */
    NCD_C_DATAGRAM,     /* IPv4/UDP to our address and port: the datagram is in the pkt */
    NCD_C_FRAGMENT,     /* a fragment of an IPv4/UDP packet to us (l3_len, ip_len are set) */
    NCD_C_BAD_CHECKSUM, /* IPv4 header or UDP checksum wrong: what a host's stack drops */
};

/* A frame classified as NCD_C_DATAGRAM: the UDP payload and where it came from. */
struct ncd_pkt {
    struct nce_from from;
    const uint8_t *dgram;
    uint32_t dgram_len;
    uint16_t l3_len;            /* the IPv4 header's length, options included */
    uint16_t ip_len;            /* the IPv4 packet's total length */
};

/* classify.c (it also learns the spine's MAC from ARP and from the spine's frames) */
enum ncd_class ncd_classify(const uint8_t *frame, uint32_t len, struct ncd_pkt *p);
enum ncd_route ncd_uplink_route(void);

/* frames.c: build into frames of cap bytes; 0 (nothing written) when the frame does not fit. */
uint32_t ncd_frame_to_member(uint8_t *frame, uint32_t cap, const struct nce_action *a,
                             uint16_t rank);
uint32_t ncd_frame_to_sender(uint8_t *frame, uint32_t cap, const struct nce_action *a,
                             const struct nce_from *from);
void ncd_build_arp_reply(uint8_t *frame);
/* What goes out for a leaf's datagram to its spine by ncd_uplink_route's route: NCD_R_SEND,
 * its frame to the learned MAC (the engine's datagram act->up, or dgram of len bytes when a is
 * NULL); NCD_R_ARP, the ARP request (broadcast) for the spine's address instead. */
uint32_t ncd_frame_spine(uint8_t *frame, uint32_t cap, enum ncd_route route,
                         const struct nce_action *a, const uint8_t *dgram, uint32_t len);

#endif
