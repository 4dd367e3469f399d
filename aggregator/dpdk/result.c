/* Results: re-encode a completed slot once (nc8 or int), and build the frames that carry it
 * (one unicast per member, the emulated multicast); notices; the ARP reply for our address.
 * Every result and notice carries the aggregator's generation, and a keyed job's its tag. */
#include <string.h>

#include <rte_arp.h>
#include <rte_ip.h>
#include <rte_udp.h>

#include "nc8.h"
#include "ncd_priv.h"

/* The key of the nc8 result stream for the job's next slot completion: the control plane's
 * key (the Python reference's stream) when the ring has one, else a function of the seed, the
 * job and the completion index. */
uint64_t ncd_next_key(struct ncd_job *job)
{
    const uint64_t n = job->completions;
    if (job->keys != NULL && n < __atomic_load_n(&job->keys_written, __ATOMIC_ACQUIRE))
        return job->keys[n & job->key_mask];
    job->c.key_underruns++;
    return nc8_mix64(nc8_mix64(job->seed ^ ((uint64_t)job->id << 48)) + n);
}

void ncd_encode_result(struct ncd_job *job, struct ncd_slot *s)
{
    const unsigned n = s->count;
    if (job->result_format == NCD_FMT_NC8) {
        nc8_int_to_codes(s->acc, s->result, n, ncd_next_key(job));
    } else {
        uint64_t *out = (uint64_t *)s->result;
        for (unsigned i = 0; i < n; i++)
            out[i] = rte_cpu_to_be_64((uint64_t)s->acc[i]);
    }
    __atomic_store_n(&job->completions, job->completions + 1, __ATOMIC_RELEASE);
    /* The payload starts at an even offset of the UDP datagram, so its sum adds in directly. */
    s->payload_sum = __rte_raw_cksum(s->result, (size_t)n * job->elem_size, 0);
}

uint32_t ncd_result_frame_len(const struct ncd_job *job, const struct ncd_slot *s)
{
    return NCD_FRAME_OVERHEAD + (uint32_t)s->count * job->elem_size +
           (job->tagged ? NCD_TAG_LEN : 0);
}

/* The flags byte of a result or notice for pool version `version`. */
static inline uint8_t downlink_flags(const struct ncd_job *job, unsigned version)
{
    return (uint8_t)(NCD_FLAG_RESULT | (version ? NCD_FLAG_POOL : 0) |
                     ncd_generation << NCD_GEN_SHIFT | (job->tagged ? NCD_FLAG_TAG : 0));
}

/* The ncina header of a result or notice. */
static void put_header(uint8_t *h, const struct ncd_job *job, unsigned version, uint16_t rank,
                       uint16_t slot, uint16_t count, uint32_t offset)
{
    h[0] = NCD_VERSION;
    h[1] = downlink_flags(job, version);
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

/* IPv4 total length, header checksum and UDP length of a datagram of dgram_len bytes. */
static void set_lengths(struct rte_ipv4_hdr *ip, struct rte_udp_hdr *udp, uint32_t dgram_len)
{
    ip->total_length = rte_cpu_to_be_16((uint16_t)(sizeof *ip + sizeof *udp + dgram_len));
    ip->hdr_checksum = 0;
    ip->hdr_checksum = rte_ipv4_cksum(ip);
    udp->dgram_len = rte_cpu_to_be_16((uint16_t)(sizeof *udp + dgram_len));
}

/* The UDP checksum over the whole datagram (for tagged and notice datagrams). */
static void set_udp_checksum(const struct rte_ipv4_hdr *ip, struct rte_udp_hdr *udp,
                             uint32_t dgram_len)
{
    udp->dgram_cksum = 0;
    uint32_t sum = rte_ipv4_phdr_cksum(ip, 0);
    sum = __rte_raw_cksum(udp, sizeof *udp + dgram_len, sum);
    uint16_t ck = (uint16_t)~__rte_raw_cksum_reduce(sum);
    udp->dgram_cksum = ck == 0 ? 0xFFFF : ck;
}

uint32_t ncd_notice_frame_len(const struct ncd_job *job)
{
    return RTE_ETHER_HDR_LEN + 20 + 8 + NCD_NOTICE_LEN + (job->tagged ? NCD_TAG_LEN : 0);
}

/* Turn the uplink frame a notice answers (already parsed: IPv4 without options, UDP) into the
 * notice, in place: addresses and ports swapped, the header, the bitmap, the tag. The buffer
 * must hold ncd_notice_frame_len bytes. */
uint32_t ncd_build_notice(uint8_t *frame, const struct ncd_action *a)
{
    const struct ncd_job *job = a->job;
    struct rte_ether_hdr *eth = (struct rte_ether_hdr *)frame;
    rte_ether_addr_copy(&eth->src_addr, &eth->dst_addr);
    rte_ether_addr_copy(&ncd_mac, &eth->src_addr);
    struct rte_ipv4_hdr *ip = (struct rte_ipv4_hdr *)(eth + 1);
    const uint32_t worker = ip->src_addr;
    ip->src_addr = ip->dst_addr;
    ip->dst_addr = worker;
    ip->time_to_live = 64;
    ip->packet_id = 0;
    ip->type_of_service = 0;
    ip->fragment_offset = rte_cpu_to_be_16(RTE_IPV4_HDR_DF_FLAG);
    struct rte_udp_hdr *udp = (struct rte_udp_hdr *)(ip + 1);
    udp->dst_port = udp->src_port;
    udp->src_port = ncd_port_be;

    uint8_t *h = (uint8_t *)(udp + 1);
    put_header(h, job, a->version, a->rank, a->slot_index, 0, a->offset);
    const uint64_t bitmap_be = rte_cpu_to_be_64(a->bitmap);
    memcpy(h + NCD_HDR_LEN, &bitmap_be, sizeof bitmap_be);
    uint32_t dgram_len = NCD_NOTICE_LEN;
    if (job->tagged) {
        ncd_tag(job, h, dgram_len, h + dgram_len);
        dgram_len += NCD_TAG_LEN;
    }
    set_lengths(ip, udp, dgram_len);
    set_udp_checksum(ip, udp, dgram_len);
    return RTE_ETHER_HDR_LEN + sizeof *ip + sizeof *udp + dgram_len;
}

uint32_t ncd_build_result(uint8_t *buf, const struct ncd_job *job, const struct ncd_slot *s,
                          unsigned version, uint16_t rank)
{
    const struct ncd_member *m = &job->members[rank];
    const uint32_t payload_len = (uint32_t)s->count * job->elem_size;
    const uint16_t dgram_len = (uint16_t)(NCD_HDR_LEN + payload_len);

    struct rte_ether_hdr *eth = (struct rte_ether_hdr *)buf;
    rte_ether_addr_copy(&m->mac, &eth->dst_addr);
    rte_ether_addr_copy(&ncd_mac, &eth->src_addr);
    eth->ether_type = rte_cpu_to_be_16(RTE_ETHER_TYPE_IPV4);

    struct rte_ipv4_hdr *ip = (struct rte_ipv4_hdr *)(eth + 1);
    ip->version_ihl = RTE_IPV4_VHL_DEF;
    ip->type_of_service = 0;
    ip->packet_id = 0;
    ip->fragment_offset = rte_cpu_to_be_16(RTE_IPV4_HDR_DF_FLAG);
    ip->time_to_live = 64;
    ip->next_proto_id = IPPROTO_UDP;
    ip->src_addr = ncd_ip != 0 ? ncd_ip : m->agg_ip;
    ip->dst_addr = m->ip;

    struct rte_udp_hdr *udp = (struct rte_udp_hdr *)(ip + 1);
    udp->src_port = ncd_port_be;
    udp->dst_port = m->port;

    uint8_t *h = (uint8_t *)(udp + 1);
    put_header(h, job, version, rank, (uint16_t)((s - job->slots) >> 1), s->count, s->offset);
    memcpy(h + NCD_HDR_LEN, s->result, payload_len);
    if (job->tagged) {                          /* one tag per destination: rank differs */
        ncd_tag(job, h, dgram_len, h + dgram_len);
        set_lengths(ip, udp, dgram_len + NCD_TAG_LEN);
        set_udp_checksum(ip, udp, dgram_len + NCD_TAG_LEN);
        return NCD_FRAME_OVERHEAD + payload_len + NCD_TAG_LEN;
    }
    set_lengths(ip, udp, dgram_len);
    /* UDP checksum: pseudo header + UDP and ncina headers + the payload's stored sum. */
    udp->dgram_cksum = 0;
    uint32_t sum = rte_ipv4_phdr_cksum(ip, 0);
    sum = __rte_raw_cksum(udp, sizeof *udp + NCD_HDR_LEN, sum);
    sum += s->payload_sum;
    uint16_t ck = (uint16_t)~__rte_raw_cksum_reduce(sum);
    udp->dgram_cksum = ck == 0 ? 0xFFFF : ck;
    return NCD_FRAME_OVERHEAD + payload_len;
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
