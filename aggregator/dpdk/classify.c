/* Classify: Ethernet / IPv4 / UDP to our address and port (the datagram for the engine), an
 * ARP request for our address, or anything else (ignored); and this layer's module state. */
#include <string.h>

#include <rte_arp.h>
#include <rte_ip.h>
#include <rte_udp.h>

#include "ncd_priv.h"

struct ncd_io ncd_iostats;
struct rte_ether_addr ncd_mac;
uint32_t ncd_ip;
uint16_t ncd_port_be;

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

void ncd_io_stats(struct ncd_io *io)
{
    const volatile uint64_t *src = (const volatile uint64_t *)&ncd_iostats;
    uint64_t *dst = (uint64_t *)io;
    for (size_t i = 0; i < sizeof *io / sizeof(uint64_t); i++)
        dst[i] = src[i];
}

void ncd_io_reset(void)
{
    memset(&ncd_iostats, 0, sizeof ncd_iostats);
}

static inline int is_for_us(const struct rte_ether_addr *dst)
{
    return rte_is_same_ether_addr(dst, &ncd_mac) || rte_is_zero_ether_addr(&ncd_mac);
}

/* An ARP request asking for the aggregator's address. */
static enum ncd_class classify_arp(const uint8_t *frame, uint32_t len)
{
    if (len < RTE_ETHER_HDR_LEN + sizeof(struct rte_arp_hdr) || ncd_ip == 0)
        return NCD_C_IGNORE;
    const struct rte_arp_hdr *arp = (const struct rte_arp_hdr *)(frame + RTE_ETHER_HDR_LEN);
    if (arp->arp_hardware != rte_cpu_to_be_16(RTE_ARP_HRD_ETHER) ||
        arp->arp_protocol != rte_cpu_to_be_16(RTE_ETHER_TYPE_IPV4) ||
        arp->arp_opcode != rte_cpu_to_be_16(RTE_ARP_OP_REQUEST) ||
        arp->arp_data.arp_tip != ncd_ip)
        return NCD_C_IGNORE;
    return NCD_C_ARP;
}

enum ncd_class ncd_classify(const uint8_t *frame, uint32_t len, struct ncd_pkt *p)
{
    if (len < RTE_ETHER_HDR_LEN)
        return NCD_C_IGNORE;
    const struct rte_ether_hdr *eth = (const struct rte_ether_hdr *)frame;
    if (eth->ether_type == rte_cpu_to_be_16(RTE_ETHER_TYPE_ARP))
        return classify_arp(frame, len);
    if (eth->ether_type != rte_cpu_to_be_16(RTE_ETHER_TYPE_IPV4) || !is_for_us(&eth->dst_addr) ||
        rte_is_same_ether_addr(&eth->src_addr, &ncd_mac))
        return NCD_C_IGNORE;

    /* IPv4 without options or fragments, UDP, our address (if set) and port. */
    if (len < NCD_L2L4_LEN)
        return NCD_C_IGNORE;
    const struct rte_ipv4_hdr *ip = (const struct rte_ipv4_hdr *)(eth + 1);
    const uint32_t ip_len = rte_be_to_cpu_16(ip->total_length);
    if (ip->version_ihl != RTE_IPV4_VHL_DEF || ip->next_proto_id != IPPROTO_UDP ||
        (ip->fragment_offset & rte_cpu_to_be_16(RTE_IPV4_HDR_MF_FLAG | RTE_IPV4_HDR_OFFSET_MASK)) ||
        (ncd_ip != 0 && ip->dst_addr != ncd_ip) ||
        ip_len < sizeof(*ip) + sizeof(struct rte_udp_hdr) || ip_len > len - RTE_ETHER_HDR_LEN)
        return NCD_C_IGNORE;
    const struct rte_udp_hdr *udp = (const struct rte_udp_hdr *)(ip + 1);
    const uint32_t udp_len = rte_be_to_cpu_16(udp->dgram_len);
    if (udp->dst_port != ncd_port_be || udp_len < sizeof(*udp) || udp_len > ip_len - sizeof(*ip))
        return NCD_C_IGNORE;

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
