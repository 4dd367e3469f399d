/* Frames: the engine's reply datagrams behind Ethernet, IPv4 and UDP headers with their
 * checksums (a result to each member: the emulated multicast; a reply to the sender in place of
 * its frame), a leaf's datagrams to its spine, the ARP reply for our address and the ARP
 * request for the spine's. Every size is checked before a write. */
#include <string.h>

#include <rte_arp.h>
#include <rte_ip.h>
#include <rte_udp.h>

#include "ncd_priv.h"

/* IPv4 total length and header checksum, UDP length and checksum over the whole datagram. */
static void finish(struct rte_ipv4_hdr *ip, struct rte_udp_hdr *udp, uint32_t dgram_len)
{
    ip->total_length = rte_cpu_to_be_16((uint16_t)(sizeof *ip + sizeof *udp + dgram_len));
    ip->hdr_checksum = 0;
    ip->hdr_checksum = rte_ipv4_cksum(ip);
    udp->dgram_len = rte_cpu_to_be_16((uint16_t)(sizeof *udp + dgram_len));
    udp->dgram_cksum = 0;
    uint32_t sum = rte_ipv4_phdr_cksum(ip, 0);
    sum = __rte_raw_cksum(udp, sizeof *udp + dgram_len, sum);
    const uint16_t ck = (uint16_t)~__rte_raw_cksum_reduce(sum);
    udp->dgram_cksum = ck == 0 ? 0xFFFF : ck;
}

static void ipv4_defaults(struct rte_ipv4_hdr *ip)
{
    ip->version_ihl = RTE_IPV4_VHL_DEF;
    ip->type_of_service = 0;
    ip->packet_id = 0;
    ip->fragment_offset = rte_cpu_to_be_16(RTE_IPV4_HDR_DF_FLAG);
    ip->time_to_live = 64;
    ip->next_proto_id = IPPROTO_UDP;
}

uint32_t ncd_frame_to_member(uint8_t *frame, uint32_t cap, const struct nce_action *a,
                             uint16_t rank)
{
    if (cap < NCD_L2L4_LEN)
        return 0;
    const uint32_t dgram_len = nce_build_reply(frame + NCD_L2L4_LEN, cap - NCD_L2L4_LEN, a, rank);
    if (dgram_len == 0)
        return 0;
    const struct nce_member *m = nce_member_of(a, rank);
    struct rte_ether_hdr *eth = (struct rte_ether_hdr *)frame;
    memcpy(eth->dst_addr.addr_bytes, m->link, RTE_ETHER_ADDR_LEN);
    rte_ether_addr_copy(&ncd_mac, &eth->src_addr);
    eth->ether_type = rte_cpu_to_be_16(RTE_ETHER_TYPE_IPV4);
    struct rte_ipv4_hdr *ip = (struct rte_ipv4_hdr *)(eth + 1);
    ipv4_defaults(ip);
    ip->src_addr = ncd_ip != 0 ? ncd_ip : m->agg_ip;
    ip->dst_addr = m->ip;
    struct rte_udp_hdr *udp = (struct rte_udp_hdr *)(ip + 1);
    udp->src_port = ncd_port_be;
    udp->dst_port = m->port;
    finish(ip, udp, dgram_len);
    return NCD_L2L4_LEN + dgram_len;
}

/* The reply to the sender of the datagram the action answers (from: its addresses, taken
 * from the frame it came in; from->link may point into frame, which is overwritten), built in
 * frame: a fresh Ethernet, IPv4 (no options) and UDP header, the engine's datagram after them. */
uint32_t ncd_frame_to_sender(uint8_t *frame, uint32_t cap, const struct nce_action *a,
                             const struct nce_from *from)
{
    if (cap < NCD_L2L4_LEN)
        return 0;
    struct rte_ether_addr sender;
    memcpy(sender.addr_bytes, from->link, RTE_ETHER_ADDR_LEN);
    const uint32_t dgram_len =
        nce_build_reply(frame + NCD_L2L4_LEN, cap - NCD_L2L4_LEN, a, a->rank);
    if (dgram_len == 0)
        return 0;
    struct rte_ether_hdr *eth = (struct rte_ether_hdr *)frame;
    rte_ether_addr_copy(&sender, &eth->dst_addr);
    rte_ether_addr_copy(&ncd_mac, &eth->src_addr);
    eth->ether_type = rte_cpu_to_be_16(RTE_ETHER_TYPE_IPV4);
    struct rte_ipv4_hdr *ip = (struct rte_ipv4_hdr *)(eth + 1);
    ipv4_defaults(ip);
    ip->src_addr = ncd_ip != 0 ? ncd_ip : from->dst_ip;
    ip->dst_addr = from->src_ip;
    struct rte_udp_hdr *udp = (struct rte_udp_hdr *)(ip + 1);
    udp->src_port = ncd_port_be;
    udp->dst_port = from->src_port;
    finish(ip, udp, dgram_len);
    return NCD_L2L4_LEN + dgram_len;
}

/* Turn an ARP request for our address (already checked) into the reply, in place. */
void ncd_build_arp_reply(uint8_t *frame)
{
    struct rte_ether_hdr *eth = (struct rte_ether_hdr *)frame;
    struct rte_arp_hdr *arp = (struct rte_arp_hdr *)(eth + 1);
    rte_ether_addr_copy(&eth->src_addr, &eth->dst_addr);
    rte_ether_addr_copy(&ncd_mac, &eth->src_addr);
    arp->arp_opcode = rte_cpu_to_be_16(RTE_ARP_OP_REPLY);
    arp->arp_data.arp_tha = arp->arp_data.arp_sha;
    arp->arp_data.arp_tip = arp->arp_data.arp_sip;
    rte_ether_addr_copy(&ncd_mac, &arp->arp_data.arp_sha);
    arp->arp_data.arp_sip = ncd_ip;
}

/* The headers of a datagram of dgram_len bytes (already at frame + NCD_L2L4_LEN) to the spine,
 * from our address and port. */
static uint32_t to_spine(uint8_t *frame, uint32_t dgram_len)
{
    struct rte_ether_hdr *eth = (struct rte_ether_hdr *)frame;
    rte_ether_addr_copy(&ncd_spine.mac, &eth->dst_addr);
    rte_ether_addr_copy(&ncd_mac, &eth->src_addr);
    eth->ether_type = rte_cpu_to_be_16(RTE_ETHER_TYPE_IPV4);
    struct rte_ipv4_hdr *ip = (struct rte_ipv4_hdr *)(eth + 1);
    ipv4_defaults(ip);
    ip->src_addr = ncd_ip;
    ip->dst_addr = ncd_spine.ip;
    struct rte_udp_hdr *udp = (struct rte_udp_hdr *)(ip + 1);
    udp->src_port = ncd_port_be;
    udp->dst_port = ncd_spine.port;
    finish(ip, udp, dgram_len);
    return NCD_L2L4_LEN + dgram_len;
}

/* The ARP request (broadcast) for the spine's address. */
static uint32_t arp_request(uint8_t *frame, uint32_t cap)
{
    const uint32_t len = RTE_ETHER_HDR_LEN + sizeof(struct rte_arp_hdr);
    if (cap < len)
        return 0;
    struct rte_ether_hdr *eth = (struct rte_ether_hdr *)frame;
    memset(&eth->dst_addr, 0xFF, sizeof eth->dst_addr);
    rte_ether_addr_copy(&ncd_mac, &eth->src_addr);
    eth->ether_type = rte_cpu_to_be_16(RTE_ETHER_TYPE_ARP);
    struct rte_arp_hdr *arp = (struct rte_arp_hdr *)(eth + 1);
    arp->arp_hardware = rte_cpu_to_be_16(RTE_ARP_HRD_ETHER);
    arp->arp_protocol = rte_cpu_to_be_16(RTE_ETHER_TYPE_IPV4);
    arp->arp_hlen = RTE_ETHER_ADDR_LEN;
    arp->arp_plen = 4;
    arp->arp_opcode = rte_cpu_to_be_16(RTE_ARP_OP_REQUEST);
    rte_ether_addr_copy(&ncd_mac, &arp->arp_data.arp_sha);
    arp->arp_data.arp_sip = ncd_ip;
    memset(&arp->arp_data.arp_tha, 0, sizeof arp->arp_data.arp_tha);
    arp->arp_data.arp_tip = ncd_spine.ip;
    return len;
}

uint32_t ncd_frame_spine(uint8_t *frame, uint32_t cap, enum ncd_route route,
                         const struct nce_action *a, const uint8_t *dgram, uint32_t len)
{
    if (route == NCD_R_ARP)
        return arp_request(frame, cap);
    if (route != NCD_R_SEND || cap < NCD_L2L4_LEN)
        return 0;
    if (a != NULL) {    /* its up_ip and up_port are ncd_spine's: both from --upstream */
        len = nce_build_uplink(frame + NCD_L2L4_LEN, cap - NCD_L2L4_LEN, a);
    } else if (len <= cap - NCD_L2L4_LEN) {
        memcpy(frame + NCD_L2L4_LEN, dgram, len);
    } else {
        len = 0;
    }
    return len == 0 ? 0 : to_spine(frame, len);
}
