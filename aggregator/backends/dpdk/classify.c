/* Classify: Ethernet / IPv4 / UDP to our address and port (the datagram for the engine), a
 * fragment of an IPv4 packet to us (for reassembly), a frame with a wrong IPv4 or UDP checksum
 * (dropped and counted), an ARP request for our address, or anything else (ignored); and this
 * layer's module state. A leaf learns its spine's MAC here, from ARP only (a reply or request
 * to it, as a host's stack does), never from the source of a datagram claiming the spine's
 * address, which any host on the link can send and which would redirect the partial sums; until then its uplinks wait (ncd_uplink_route) and ARP
 * requests for it go out at a bounded rate. Frames from a group or zero MAC are ignored:
 * replies go to the source MAC. */
#include <string.h>
#include <time.h>

#include <rte_arp.h>
#include <rte_ip.h>
#include <rte_ip_frag.h>
#include <rte_udp.h>

#include "ncd_priv.h"

struct rte_ether_addr ncd_mac;
uint32_t ncd_ip;
uint16_t ncd_port_be;
struct ncd_spine ncd_spine = {.interval_ns = 100 * 1000 * 1000};

void ncd_get_mac(uint8_t *mac)
{
    memcpy(mac, ncd_mac.addr_bytes, RTE_ETHER_ADDR_LEN);
}

void ncd_set_mac(const uint8_t *mac)
{
    memcpy(ncd_mac.addr_bytes, mac, RTE_ETHER_ADDR_LEN);
}

void ncd_set_address(const uint8_t *ip, uint16_t udp_port)
{
    memcpy(&ncd_ip, ip, 4);
    ncd_port_be = rte_cpu_to_be_16(udp_port);
}

void ncd_set_spine(const uint8_t *ip, uint16_t udp_port)
{
    const uint64_t interval = ncd_spine.interval_ns;
    memset(&ncd_spine, 0, sizeof ncd_spine);
    ncd_spine.interval_ns = interval;
    memcpy(&ncd_spine.ip, ip, 4);
    ncd_spine.port = rte_cpu_to_be_16(udp_port);
}

int ncd_spine_mac(uint8_t *mac)
{
    if (!ncd_spine.known)
        return 0;
    memcpy(mac, ncd_spine.mac.addr_bytes, RTE_ETHER_ADDR_LEN);
    return 1;
}

void ncd_set_arp_interval(uint32_t us)
{
    ncd_spine.interval_ns = (uint64_t)us * 1000;
}

/* ip (network order) is at mac: learned when ip is the spine's (only a change is written). */
static inline void learn(uint32_t ip, const struct rte_ether_addr *mac)
{
    if (ip != ncd_spine.ip || ip == 0 ||
        (ncd_spine.known && rte_is_same_ether_addr(mac, &ncd_spine.mac)) ||
        !rte_is_unicast_ether_addr(mac))
        return;
    rte_ether_addr_copy(mac, &ncd_spine.mac);
    ncd_spine.known = 1;
    ncd_leaf_io->spine_mac_learned++;
}

enum ncd_route ncd_uplink_route(void)
{
    if (ncd_spine.known)
        return NCD_R_SEND;
    ncd_leaf_io->uplink_no_mac++;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    const uint64_t ns = (uint64_t)now.tv_sec * 1000000000u + (uint64_t)now.tv_nsec;
    if (ns < ncd_spine.next_request_ns)
        return NCD_R_WAIT;
    ncd_spine.next_request_ns = ns + ncd_spine.interval_ns;
    ncd_leaf_io->arp_requests++;
    return NCD_R_ARP;
}

static inline int is_for_us(const struct rte_ether_addr *dst)
{
    return rte_is_same_ether_addr(dst, &ncd_mac) || rte_is_zero_ether_addr(&ncd_mac);
}

/* An ARP request asking for the aggregator's address (to answer); a request or reply to us
 * from the spine's address teaches us its MAC. */
static enum ncd_class classify_arp(const uint8_t *frame, uint32_t len)
{
    if (len < RTE_ETHER_HDR_LEN + sizeof(struct rte_arp_hdr) || ncd_ip == 0)
        return NCD_C_IGNORE;
    const struct rte_arp_hdr *arp = (const struct rte_arp_hdr *)(frame + RTE_ETHER_HDR_LEN);
    if (arp->arp_hardware != rte_cpu_to_be_16(RTE_ARP_HRD_ETHER) ||
        arp->arp_protocol != rte_cpu_to_be_16(RTE_ETHER_TYPE_IPV4) ||
        arp->arp_data.arp_tip != ncd_ip)
        return NCD_C_IGNORE;
    const struct rte_ether_hdr *eth = (const struct rte_ether_hdr *)frame;
    if (!rte_is_unicast_ether_addr(&eth->src_addr) || rte_is_zero_ether_addr(&eth->src_addr))
        return NCD_C_IGNORE;   /* the answer goes to the source: never to a group */
    const uint16_t op = arp->arp_opcode;
    if (op == rte_cpu_to_be_16(RTE_ARP_OP_REQUEST) || op == rte_cpu_to_be_16(RTE_ARP_OP_REPLY))
        learn(arp->arp_data.arp_sip, &arp->arp_data.arp_sha);   /* ARP, as a host learns */
    return op == rte_cpu_to_be_16(RTE_ARP_OP_REQUEST) ? NCD_C_ARP : NCD_C_IGNORE;
}

/* The Internet checksum (RFC 1071) of an IPv4/UDP datagram of udp_len bytes with its
 * pseudo-header, before complementing: 0xFFFF when the datagram is intact. */
static inline uint16_t udp_sum(const struct rte_ipv4_hdr *ip, const struct rte_udp_hdr *udp,
                               uint32_t udp_len)
{
    const struct {
        uint32_t src, dst;
        uint8_t zero, proto;
        uint16_t len;
    } __attribute__((packed)) pseudo = {ip->src_addr, ip->dst_addr, 0, IPPROTO_UDP,
                                        rte_cpu_to_be_16((uint16_t)udp_len)};
    uint32_t sum = __rte_raw_cksum(&pseudo, sizeof pseudo, 0);
    sum = __rte_raw_cksum(udp, udp_len, sum);
    return __rte_raw_cksum_reduce(sum);
}

/* What a host's IPv4/UDP stack delivers is what the engine gets (docs/protocol.md,
 * "Transport"): IPv4 with or without options, header checksum verified; fragments go to
 * reassembly (loop.c); UDP with its checksum verified (0: none), the datagram cut to the UDP
 * length. */
enum ncd_class ncd_classify(const uint8_t *frame, uint32_t len, struct ncd_pkt *p)
{
    if (len < RTE_ETHER_HDR_LEN)
        return NCD_C_IGNORE;
    const struct rte_ether_hdr *eth = (const struct rte_ether_hdr *)frame;
    if (eth->ether_type == rte_cpu_to_be_16(RTE_ETHER_TYPE_ARP))
        return classify_arp(frame, len);
    /* Replies go to the source MAC: a group (broadcast, multicast) or zero source, which no
     * host sends from, would make them go to the whole segment. */
    if (eth->ether_type != rte_cpu_to_be_16(RTE_ETHER_TYPE_IPV4) || !is_for_us(&eth->dst_addr) ||
        rte_is_same_ether_addr(&eth->src_addr, &ncd_mac) ||
        !rte_is_unicast_ether_addr(&eth->src_addr) || rte_is_zero_ether_addr(&eth->src_addr))
        return NCD_C_IGNORE;

    if (len < RTE_ETHER_HDR_LEN + sizeof(struct rte_ipv4_hdr))
        return NCD_C_IGNORE;
    const struct rte_ipv4_hdr *ip = (const struct rte_ipv4_hdr *)(eth + 1);
    const uint32_t ihl = rte_ipv4_hdr_len(ip);
    const uint32_t ip_len = rte_be_to_cpu_16(ip->total_length);
    if ((ip->version_ihl >> 4) != 4 || ihl < sizeof(*ip) || ip->next_proto_id != IPPROTO_UDP ||
        (ncd_ip != 0 && ip->dst_addr != ncd_ip) || ip_len < ihl ||
        ip_len > len - RTE_ETHER_HDR_LEN)
        return NCD_C_IGNORE;
    if (rte_raw_cksum(ip, ihl) != 0xFFFF)
        return NCD_C_BAD_CHECKSUM;
    p->l3_len = (uint16_t)ihl;
    p->ip_len = (uint16_t)ip_len;
    if (rte_ipv4_frag_pkt_is_fragmented(ip))
        return NCD_C_FRAGMENT;

    const struct rte_udp_hdr *udp = (const struct rte_udp_hdr *)((const uint8_t *)ip + ihl);
    if (ip_len < ihl + sizeof(*udp))
        return NCD_C_IGNORE;
    const uint32_t udp_len = rte_be_to_cpu_16(udp->dgram_len);
    if (udp->dst_port != ncd_port_be || udp_len < sizeof(*udp) || udp_len > ip_len - ihl)
        return NCD_C_IGNORE;
    if (udp->dgram_cksum != 0 && udp_sum(ip, udp, udp_len) != 0xFFFF)
        return NCD_C_BAD_CHECKSUM;

    p->from.src_ip = ip->src_addr;
    p->from.dst_ip = ip->dst_addr;
    p->from.src_port = udp->src_port;
    p->from.link = eth->src_addr.addr_bytes;
    p->dgram = (const uint8_t *)(udp + 1);
    p->dgram_len = udp_len - sizeof(*udp);
    return NCD_C_DATAGRAM;
}

uint32_t ncd_frame_room(void)
{
    return NCD_FRAME_ROOM;
}

uint32_t ncd_dgram_room(void)
{
    return NCD_FRAME_ROOM - NCD_L2L4_LEN;
}
