/* EAL and port setup, and the burst loop (after DPDK's l2fwd): receive a burst, classify each
 * frame, hand its datagram to the slot engine, build the replies into mbufs (the input's own
 * for a reply to the sender, fresh ones from the pool for a result to every member), buffer
 * them for TX, flush. */
#include <stdio.h>
#include <string.h>
#include <time.h>

#include <rte_eal.h>
#include <rte_errno.h>
#include <rte_ethdev.h>
#include <rte_lcore.h>
#include <rte_malloc.h>
#include <rte_mbuf.h>
#include <rte_cycles.h>
#include <rte_ip.h>
#include <rte_ip_frag.h>
#include <rte_udp.h>

#include "ncd_priv.h"

#define BURST 32
#define NB_MBUF 8191
#define MBUF_CACHE 256
#define NB_RXD 1024
#define NB_TXD 1024
#define IDLE_POLLS 256
/* IPv4 reassembly: at most FRAG_BUCKETS * FRAG_WAYS packets in progress (each of at most
 * RTE_LIBRTE_IP_FRAG_MAX_FRAG fragments, so a few hundred mbufs at most are held), each for up
 * to FRAG_TTL_S seconds, Linux's ipfrag_time. */
#define FRAG_BUCKETS 16
#define FRAG_WAYS 4
#define FRAG_TTL_S 30

static uint16_t port_id;
static struct rte_mempool *pool;
static struct rte_eth_dev_tx_buffer *txb;
static struct rte_ip_frag_tbl *frags;
static struct rte_ip_frag_death_row death_row;
/* A reassembled frame, copied out of its mbuf chain for classification and the engine. */
static uint8_t whole[RTE_ETHER_HDR_LEN + RTE_IPV4_MAX_PKT_LEN];
static int eal_up, port_up;
static volatile int stopping;

#define FAIL(...)                                                   \
    do {                                                            \
        snprintf(nce_errbuf, sizeof nce_errbuf, __VA_ARGS__);       \
        return -1;                                                  \
    } while (0)

static void count_tx_drops(struct rte_mbuf **pkts, uint16_t unsent, void *userdata)
{
    (void)userdata;
    ncd_iostats.tx_dropped += unsent;
    ncd_iostats.tx_frames -= unsent;
    rte_pktmbuf_free_bulk(pkts, unsent);
}

int ncd_init(int argc, char **argv)
{
    if (eal_up)
        FAIL("EAL is already running in this process");
    if (rte_eal_init(argc, argv) < 0)
        FAIL("rte_eal_init failed: %s", rte_strerror(rte_errno));
    eal_up = 1;
    if (rte_eth_dev_count_avail() < 1)
        FAIL("no ethdev port (is the --vdev interface up? is the --pci NIC bound to vfio-pci?)");
    RTE_ETH_FOREACH_DEV(port_id) break;

    pool = rte_pktmbuf_pool_create("ncd_mbufs", NB_MBUF, MBUF_CACHE, 0,
                                   NCD_FRAME_ROOM + RTE_PKTMBUF_HEADROOM, rte_socket_id());
    if (pool == NULL)
        FAIL("cannot create the mbuf pool: %s", rte_strerror(rte_errno));

    struct rte_eth_conf conf;
    memset(&conf, 0, sizeof conf);
    int rc = rte_eth_dev_configure(port_id, 1, 1, &conf);
    if (rc < 0)
        FAIL("rte_eth_dev_configure: %s", rte_strerror(-rc));
    uint16_t nrxd = NB_RXD, ntxd = NB_TXD;
    rc = rte_eth_dev_adjust_nb_rx_tx_desc(port_id, &nrxd, &ntxd);
    if (rc < 0)
        FAIL("rte_eth_dev_adjust_nb_rx_tx_desc: %s", rte_strerror(-rc));
    const int socket = rte_eth_dev_socket_id(port_id);
    rc = rte_eth_rx_queue_setup(port_id, 0, nrxd, socket, NULL, pool);
    if (rc < 0)
        FAIL("rte_eth_rx_queue_setup: %s", rte_strerror(-rc));
    rc = rte_eth_tx_queue_setup(port_id, 0, ntxd, socket, NULL);
    if (rc < 0)
        FAIL("rte_eth_tx_queue_setup: %s", rte_strerror(-rc));

    frags = rte_ip_frag_table_create(FRAG_BUCKETS, FRAG_WAYS, FRAG_BUCKETS * FRAG_WAYS,
                                     rte_get_tsc_hz() * FRAG_TTL_S, socket);
    if (frags == NULL)
        FAIL("cannot create the IPv4 reassembly table");

    txb = rte_zmalloc_socket("ncd_txb", RTE_ETH_TX_BUFFER_SIZE(BURST), 0, socket);
    if (txb == NULL)
        FAIL("cannot allocate the TX buffer");
    rte_eth_tx_buffer_init(txb, BURST);
    rte_eth_tx_buffer_set_err_callback(txb, count_tx_drops, NULL);

    rc = rte_eth_dev_start(port_id);
    if (rc < 0)
        FAIL("rte_eth_dev_start: %s", rte_strerror(-rc));
    port_up = 1;
    rte_eth_promiscuous_enable(port_id); /* best effort: the veth peer sends to our MAC anyway */
    rte_eth_macaddr_get(port_id, &ncd_mac);
    return 0;
}

static inline void send_frame(struct rte_mbuf *m, uint32_t len)
{
    m->data_len = (uint16_t)len;
    m->pkt_len = len;
    ncd_iostats.tx_frames++;
    rte_eth_tx_buffer(port_id, 0, txb, m);
}

/* The bytes an mbuf's buffer holds from its data offset on. */
static inline uint32_t room(const struct rte_mbuf *m)
{
    return (uint32_t)(m->buf_len - m->data_off);
}

/* A completed slot: one result per member, each in a fresh mbuf of NCD_FRAME_ROOM bytes, which
 * every job's result frames fit (nce_set_reply_room); a larger frame is counted, never written. */
static void send_all(const struct nce_action *a)
{
    struct rte_mbuf *out[NCE_MAX_WORKERS];
    const unsigned n = a->members;
    if (rte_pktmbuf_alloc_bulk(pool, out, n) != 0) {
        ncd_iostats.no_mbuf += n;
        return;
    }
    for (uint16_t r = 0; r < n; r++) {
        const uint32_t len =
            ncd_frame_to_member(rte_pktmbuf_mtod(out[r], uint8_t *), room(out[r]), a, r);
        if (len == 0) {                         /* larger than an mbuf: not sent, counted */
            ncd_iostats.oversize++;
            rte_pktmbuf_free(out[r]);
            continue;
        }
        send_frame(out[r], len);
    }
}

/* A leaf's datagram to its spine (act->up, besides the verdict's replies; or dgram when a is
 * NULL) in a fresh mbuf, or the ARP request for the spine's MAC that route asks for instead;
 * NULL, counted, when there is no mbuf or it does not fit. Before the spine's MAC is known a
 * datagram is dropped and counted and an ARP request goes out at a bounded rate
 * (ncd_uplink_route): a worker's retransmission makes the engine send it again (upstream.c). */
static struct rte_mbuf *spine_frame(enum ncd_route route, const struct nce_action *a,
                                    const uint8_t *dgram, uint32_t dgram_len, uint32_t *len)
{
    struct rte_mbuf *m = rte_pktmbuf_alloc(pool);
    if (m == NULL) {
        ncd_iostats.no_mbuf++;
        return NULL;
    }
    *len = ncd_frame_spine(rte_pktmbuf_mtod(m, uint8_t *), room(m), route, a, dgram, dgram_len);
    if (*len == 0) {                            /* larger than an mbuf: not sent, counted */
        ncd_iostats.oversize++;
        rte_pktmbuf_free(m);
        return NULL;
    }
    ncd_iostats.uplink_frames += route == NCD_R_SEND;
    return m;
}

static void send_uplink(const struct nce_action *a)
{
    const enum ncd_route route = ncd_uplink_route();
    uint32_t len;
    struct rte_mbuf *m = route == NCD_R_WAIT ? NULL : spine_frame(route, a, NULL, 0, &len);
    if (m != NULL)
        send_frame(m, len);
}

/* A fragment (classified, p) into the reassembly table: the whole packet's mbuf chain once its
 * last fragment is in, else NULL (the table keeps the fragment, or drops it on its death row:
 * a table full of packets in progress, a packet of more than RTE_LIBRTE_IP_FRAG_MAX_FRAG
 * fragments, overlaps). */
static struct rte_mbuf *reassemble(struct rte_mbuf *m, const struct ncd_pkt *p)
{
    const uint32_t end = RTE_ETHER_HDR_LEN + p->ip_len;
    if (rte_pktmbuf_pkt_len(m) > end)               /* Ethernet padding is no payload */
        rte_pktmbuf_trim(m, (uint16_t)(rte_pktmbuf_pkt_len(m) - end));
    m->l2_len = RTE_ETHER_HDR_LEN;
    m->l3_len = p->l3_len;
    struct rte_ipv4_hdr *ip = rte_pktmbuf_mtod_offset(m, struct rte_ipv4_hdr *, RTE_ETHER_HDR_LEN);
    struct rte_mbuf *done = rte_ipv4_frag_reassemble_packet(frags, &death_row, m, rte_rdtsc(), ip);
    rte_ip_frag_free_death_row(&death_row, 0);
    return done;
}

/* The reassembled packet m as one frame in `whole` (its IPv4 header checksum made valid again:
 * the fragments' were checked), classified into p; its tail segments are freed, so that m can
 * carry a reply. */
static enum ncd_class classify_whole(struct rte_mbuf *m, struct ncd_pkt *p)
{
    const uint32_t len = rte_pktmbuf_pkt_len(m);
    enum ncd_class c = NCD_C_IGNORE;
    if (len <= sizeof whole && len >= RTE_ETHER_HDR_LEN + sizeof(struct rte_ipv4_hdr)) {
        const uint8_t *data = rte_pktmbuf_read(m, 0, len, whole);
        if (data != whole)
            memcpy(whole, data, len);
        struct rte_ipv4_hdr *ip = (struct rte_ipv4_hdr *)(whole + RTE_ETHER_HDR_LEN);
        ip->hdr_checksum = 0;
        ip->hdr_checksum = rte_ipv4_cksum(ip);
        c = ncd_classify(whole, len, p);
    }
    if (m->next != NULL) {
        rte_pktmbuf_free(m->next);
        m->next = NULL;
        m->nb_segs = 1;
        m->pkt_len = m->data_len;
    }
    return c == NCD_C_FRAGMENT ? NCD_C_IGNORE : c;
}

static void handle(struct rte_mbuf *m)
{
    struct ncd_pkt p;
    struct nce_action a;
    uint8_t *frame = rte_pktmbuf_mtod(m, uint8_t *);
    enum ncd_class c = ncd_classify(frame, rte_pktmbuf_data_len(m), &p);
    if (c == NCD_C_FRAGMENT) {
        ncd_iostats.fragments++;
        m = reassemble(m, &p);
        if (m == NULL)
            return;
        ncd_iostats.reassembled++;
        c = classify_whole(m, &p);
    }
    switch (c) {
    case NCD_C_ARP:
        ncd_build_arp_reply(frame);
        ncd_iostats.arp_replies++;
        send_frame(m, m->data_len);
        return;
    case NCD_C_IGNORE:
    case NCD_C_FRAGMENT:
        ncd_iostats.ignored++;
        break;
    case NCD_C_BAD_CHECKSUM:
        ncd_iostats.bad_checksum++;
        break;
    case NCD_C_DATAGRAM: {
        const enum nce_verdict v = nce_input(p.dgram, p.dgram_len, &p.from, &a);
        if (a.up != NCE_UP_NONE)                /* a leaf's partial sums or hello */
            send_uplink(&a);
        switch (v) {
        case NCE_V_SEND_ONE:
        case NCE_V_NOTICE:
        case NCE_V_DESCRIPTOR: {
            /* The input mbuf becomes the reply: every mbuf holds NCD_FRAME_ROOM bytes, which
             * every job's result frames fit (nce_set_reply_room); a larger one is counted. */
            const uint32_t len =
                ncd_frame_to_sender(rte_pktmbuf_mtod(m, uint8_t *), room(m), &a, &p.from);
            if (len != 0) {
                send_frame(m, len);
                return;
            }
            ncd_iostats.oversize++;
            break;
        }
        case NCE_V_SEND_ALL:
            send_all(&a);
            break;
        case NCE_V_NONE:
            break;
        }
        break;
    }
    }
    rte_pktmbuf_free(m);
}

/* The no-op forwarder: every frame goes back where it came from. IPv4/UDP frames become the
 * echo of their datagram (addresses and ports swapped; the checksums stay valid), so a UDP
 * sender gets its own datagram back, one reply per packet like the aggregator. */
static inline void forward(struct rte_mbuf *m)
{
    struct rte_ether_hdr *eth = rte_pktmbuf_mtod(m, struct rte_ether_hdr *);
    struct rte_ether_addr tmp = eth->dst_addr;
    eth->dst_addr = eth->src_addr;
    eth->src_addr = tmp;
    if (eth->ether_type == rte_cpu_to_be_16(RTE_ETHER_TYPE_IPV4) &&
        m->data_len >= RTE_ETHER_HDR_LEN + 28) {
        struct rte_ipv4_hdr *ip = (struct rte_ipv4_hdr *)(eth + 1);
        if (ip->version_ihl == RTE_IPV4_VHL_DEF && ip->next_proto_id == IPPROTO_UDP) {
            const uint32_t a = ip->src_addr;
            ip->src_addr = ip->dst_addr;
            ip->dst_addr = a;
            struct rte_udp_hdr *udp = (struct rte_udp_hdr *)(ip + 1);
            const uint16_t p = udp->src_port;
            udp->src_port = udp->dst_port;
            udp->dst_port = p;
        }
    } else if (eth->ether_type == rte_cpu_to_be_16(RTE_ETHER_TYPE_ARP)) {
        struct ncd_pkt unused;
        if (ncd_classify((const uint8_t *)eth, m->data_len, &unused) == NCD_C_ARP) {
            eth->src_addr = eth->dst_addr; /* undo the swap: the reply builder sets both */
            ncd_build_arp_reply((uint8_t *)eth);
            ncd_iostats.arp_replies++;
        }
    }
    send_frame(m, m->data_len);
}

int ncd_run(int mode, unsigned idle_sleep_us)
{
    if (!port_up)
        FAIL("the port is not started (ncd_init)");
    const int registered = rte_lcore_id() == LCORE_ID_ANY && rte_thread_register() == 0;
    const struct timespec nap = {0, (long)idle_sleep_us * 1000};
    struct rte_mbuf *rx[BURST];
    unsigned idle = 0;

    while (!stopping) {
        const uint16_t n = rte_eth_rx_burst(port_id, 0, rx, BURST);
        ncd_iostats.loops++;
        if (n == 0) {
            if (idle_sleep_us && ++idle >= IDLE_POLLS)
                nanosleep(&nap, NULL);
            continue;
        }
        idle = 0;
        ncd_iostats.rx_frames += n;
        if (mode == 1) {
            for (uint16_t i = 0; i < n; i++)
                forward(rx[i]);
        } else {
            nce_dp_enter();
            for (uint16_t i = 0; i < n; i++) {
                if (i + 1 < n)
                    rte_prefetch0(rte_pktmbuf_mtod(rx[i + 1], void *));
                handle(rx[i]);
            }
            nce_dp_leave();
        }
        rte_eth_tx_buffer_flush(port_id, 0, txb);
    }
    rte_eth_tx_buffer_flush(port_id, 0, txb);
    if (registered)
        rte_thread_unregister();
    return 0;
}

/* ---- a leaf's job handshake, before ncd_run (on the thread of ncd_init) ---- */

static uint64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

/* One frame out on queue 0 now (no TX buffer: nothing else sends yet). */
static void send_now(struct rte_mbuf *m, uint32_t len)
{
    m->data_len = (uint16_t)len;
    m->pkt_len = len;
    if (rte_eth_tx_burst(port_id, 0, &m, 1) == 1) {
        ncd_iostats.tx_frames++;
    } else {
        ncd_iostats.tx_dropped++;
        rte_pktmbuf_free(m);
    }
}

int ncd_spine_send(const uint8_t *dgram, uint32_t len)
{
    if (!port_up || ncd_spine.ip == 0)
        FAIL("no port, or no spine (ncd_set_spine)");
    const enum ncd_route route = ncd_uplink_route();
    if (route == NCD_R_WAIT)
        return 0;
    uint32_t n;
    struct rte_mbuf *m = spine_frame(route, NULL, dgram, len, &n);
    if (m == NULL)
        FAIL("no mbuf for a %u-byte datagram to the spine (pool empty, or larger than one)", len);
    send_now(m, n);
    return route == NCD_R_SEND;
}

/* A frame received before ncd_run: ARP answered (and learned, in ncd_classify), an IPv4/UDP
 * datagram to us copied out; anything else dropped. Returns the datagram's length (-1: larger
 * than cap), or 0. */
static int take_before_run(struct rte_mbuf *m, uint8_t *buf, uint32_t cap, uint32_t *src_ip,
                           uint16_t *src_port)
{
    struct ncd_pkt p;
    int got = 0;
    ncd_iostats.rx_frames++;
    switch (ncd_classify(rte_pktmbuf_mtod(m, uint8_t *), rte_pktmbuf_data_len(m), &p)) {
    case NCD_C_ARP:
        ncd_build_arp_reply(rte_pktmbuf_mtod(m, uint8_t *));
        ncd_iostats.arp_replies++;
        send_now(m, m->data_len);
        return 0;
    case NCD_C_DATAGRAM:
        got = -1;
        if (p.dgram_len <= cap) {
            memcpy(buf, p.dgram, p.dgram_len);
            *src_ip = p.from.src_ip;
            *src_port = rte_be_to_cpu_16(p.from.src_port);
            got = (int)p.dgram_len;
        }
        break;
    case NCD_C_BAD_CHECKSUM:
        ncd_iostats.bad_checksum++;
        break;
    case NCD_C_IGNORE:
    case NCD_C_FRAGMENT:    /* a handshake's answer is one small datagram */
        ncd_iostats.ignored++;
        break;
    }
    rte_pktmbuf_free(m);
    return got;
}

int ncd_spine_receive(uint8_t *buf, uint32_t cap, uint32_t *src_ip, uint16_t *src_port,
                      unsigned wait_us)
{
    if (!port_up)
        FAIL("the port is not started (ncd_init)");
    struct rte_eth_dev_info info;
    if (rte_eth_dev_info_get(port_id, &info) != 0 || info.nb_rx_queues == 0)
        info.nb_rx_queues = 1;
    const struct timespec nap = {0, 50 * 1000};
    const uint64_t end = now_ns() + (uint64_t)wait_us * 1000;
    do {
        int polled = 0;
        for (uint16_t q = 0; q < info.nb_rx_queues; q++) {
            struct rte_mbuf *m;
            if (rte_eth_rx_burst(port_id, q, &m, 1) == 0)   /* one: the rest stays queued */
                continue;
            polled = 1;
            const int got = take_before_run(m, buf, cap, src_ip, src_port);
            if (got != 0)
                return got;
        }
        if (!polled)
            nanosleep(&nap, NULL);
    } while (now_ns() < end);
    return 0;
}

void ncd_stop(void)
{
    stopping = 1;
}

void ncd_close(void)
{
    if (frags != NULL) {
        rte_ip_frag_table_destroy(frags);
        frags = NULL;
    }
    if (port_up) {
        rte_eth_dev_stop(port_id);
        rte_eth_dev_close(port_id);
        port_up = 0;
    }
    if (eal_up) {
        rte_eal_cleanup();
        eal_up = 0;
    }
}

/* Offline: a leaf's frame to its spine (or the ARP request sent instead, or nothing) into
 * out; 1, 0 or -1 (does not fit). */
static int uplink_offline(const struct nce_action *a, uint8_t *out, uint32_t stride)
{
    const enum ncd_route route = ncd_uplink_route();
    if (route == NCD_R_WAIT)
        return 0;
    const uint32_t len = ncd_frame_spine(out, stride, route, a, NULL, 0);
    if (len == 0)
        return -1;
    ncd_iostats.uplink_frames += route == NCD_R_SEND;
    return (int)len;
}

/* Offline: the same classification, engine and frame builders on caller-provided buffers. */
int ncd_process_frame(const uint8_t *frame, uint32_t len, uint8_t *out, uint32_t stride,
                      uint32_t max_out, uint32_t *out_lens)
{
    struct ncd_pkt p;
    struct nce_action a;
    switch (ncd_classify(frame, len, &p)) {
    case NCD_C_ARP:
        if (max_out < 1 || len > stride)
            return -1;
        memcpy(out, frame, len);
        ncd_build_arp_reply(out);
        out_lens[0] = len;
        return 1;
    case NCD_C_IGNORE:
    case NCD_C_FRAGMENT:    /* no reassembly offline (the table needs EAL) */
    case NCD_C_BAD_CHECKSUM:
        return 0;
    case NCD_C_DATAGRAM:
        break;
    }
    uint32_t n = 0;
    switch (nce_input(p.dgram, p.dgram_len, &p.from, &a)) {
    case NCE_V_SEND_ONE:
    case NCE_V_NOTICE:
    case NCE_V_DESCRIPTOR:
        if (max_out < 1 || len > stride)
            return -1;
        memcpy(out, frame, len);
        out_lens[0] = ncd_frame_to_sender(out, stride, &a, &p.from);
        if (out_lens[0] == 0)
            return -1;
        n = 1;
        break;
    case NCE_V_SEND_ALL:
        if (max_out < a.members)
            return -1;
        for (uint16_t r = 0; r < a.members; r++) {
            out_lens[r] = ncd_frame_to_member(out + (size_t)r * stride, stride, &a, r);
            if (out_lens[r] == 0)
                return -1;
        }
        n = a.members;
        break;
    case NCE_V_NONE:
        break;
    }
    if (a.up != NCE_UP_NONE) {                  /* a leaf's datagram to its spine, last */
        if (n >= max_out)
            return -1;
        const int up = uplink_offline(&a, out + (size_t)n * stride, stride);
        if (up < 0)
            return -1;
        if (up > 0)
            out_lens[n++] = (uint32_t)up;
    }
    return (int)n;
}
