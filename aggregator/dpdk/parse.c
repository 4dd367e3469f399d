/* Parse and validate: Ethernet / IPv4 / UDP to our port, then the job-independent checks of the
 * ncina header (docs/protocol.md). Job-level checks are in slots.c. */
#include <string.h>

#include <rte_arp.h>
#include <rte_ip.h>
#include <rte_udp.h>

#include "ncd_priv.h"

static inline int is_for_us(const struct rte_ether_addr *dst)
{
    return rte_is_same_ether_addr(dst, &ncd_mac) || rte_is_zero_ether_addr(&ncd_mac);
}

/* An ARP request asking for the aggregator's address. */
static enum ncd_verdict classify_arp(const uint8_t *frame, uint32_t len)
{
    if (len < RTE_ETHER_HDR_LEN + sizeof(struct rte_arp_hdr) || ncd_ip == 0)
        return NCD_V_IGNORE;
    const struct rte_arp_hdr *arp = (const struct rte_arp_hdr *)(frame + RTE_ETHER_HDR_LEN);
    if (arp->arp_hardware != rte_cpu_to_be_16(RTE_ARP_HRD_ETHER) ||
        arp->arp_protocol != rte_cpu_to_be_16(RTE_ETHER_TYPE_IPV4) ||
        arp->arp_opcode != rte_cpu_to_be_16(RTE_ARP_OP_REQUEST) ||
        arp->arp_data.arp_tip != ncd_ip)
        return NCD_V_IGNORE;
    return NCD_V_ARP;
}

enum ncd_verdict ncd_classify(const uint8_t *frame, uint32_t len, struct ncd_pkt *p)
{
    if (len < RTE_ETHER_HDR_LEN)
        return NCD_V_IGNORE;
    const struct rte_ether_hdr *eth = (const struct rte_ether_hdr *)frame;
    if (eth->ether_type == rte_cpu_to_be_16(RTE_ETHER_TYPE_ARP))
        return classify_arp(frame, len);
    if (eth->ether_type != rte_cpu_to_be_16(RTE_ETHER_TYPE_IPV4) || !is_for_us(&eth->dst_addr) ||
        rte_is_same_ether_addr(&eth->src_addr, &ncd_mac))
        return NCD_V_IGNORE;

    /* IPv4 without options or fragments, UDP, our address (if set) and port. */
    if (len < RTE_ETHER_HDR_LEN + sizeof(struct rte_ipv4_hdr) + sizeof(struct rte_udp_hdr))
        return NCD_V_IGNORE;
    const struct rte_ipv4_hdr *ip = (const struct rte_ipv4_hdr *)(eth + 1);
    const uint32_t ip_len = rte_be_to_cpu_16(ip->total_length);
    if (ip->version_ihl != RTE_IPV4_VHL_DEF || ip->next_proto_id != IPPROTO_UDP ||
        (ip->fragment_offset & rte_cpu_to_be_16(RTE_IPV4_HDR_MF_FLAG | RTE_IPV4_HDR_OFFSET_MASK)) ||
        (ncd_ip != 0 && ip->dst_addr != ncd_ip) ||
        ip_len < sizeof(*ip) + sizeof(struct rte_udp_hdr) || ip_len > len - RTE_ETHER_HDR_LEN)
        return NCD_V_IGNORE;
    const struct rte_udp_hdr *udp = (const struct rte_udp_hdr *)(ip + 1);
    const uint32_t udp_len = rte_be_to_cpu_16(udp->dgram_len);
    if (udp->dst_port != ncd_port_be || udp_len < sizeof(*udp) || udp_len > ip_len - sizeof(*ip))
        return NCD_V_IGNORE;

    p->eth = eth;
    p->src_ip = ip->src_addr;
    p->dst_ip = ip->dst_addr;
    p->src_port = udp->src_port;
    p->dgram = (const uint8_t *)(udp + 1);
    p->dgram_len = udp_len - sizeof(*udp);
    return NCD_V_NONE;
}

/* The job-independent checks, in the order of ncina.proto.header.parse. Returns -1 when the
 * datagram is well formed, else its drop reason. Fills the header fields of p; with the TAG
 * flag the last NCD_TAG_LEN bytes are the tag, not payload (checked against the job's key). */
int ncd_parse_dgram(struct ncd_pkt *p)
{
    if (p->dgram_len < NCD_HDR_LEN)
        return NCD_TRUNCATED;
    const uint8_t *h = p->dgram;
    p->version = h[0];
    p->flags = h[1];
    p->format = h[2];
    p->emin = (int8_t)h[3];
    p->job = (uint16_t)(h[4] << 8 | h[5]);
    p->rank = (uint16_t)(h[6] << 8 | h[7]);
    p->slot = (uint16_t)(h[8] << 8 | h[9]);
    p->count = (uint16_t)(h[10] << 8 | h[11]);
    p->offset = (uint32_t)h[12] << 24 | (uint32_t)h[13] << 16 | (uint32_t)h[14] << 8 | h[15];
    p->payload = h + NCD_HDR_LEN;
    if (p->version != NCD_VERSION)
        return NCD_BAD_VERSION;
    uint32_t size;
    if (p->format == NCD_FMT_NC8)
        size = 1;
    else if (p->format == NCD_FMT_INT)
        size = 8;
    else
        return NCD_BAD_FORMAT;
    if (p->count == 0)
        return NCD_BAD_COUNT;
    const uint32_t tag = p->flags & NCD_FLAG_TAG ? NCD_TAG_LEN : 0;
    p->payload_len = p->dgram_len >= NCD_HDR_LEN + tag ? p->dgram_len - NCD_HDR_LEN - tag : 0;
    if (p->payload_len != (uint32_t)p->count * size)
        return NCD_BAD_LENGTH;
    return -1;
}
