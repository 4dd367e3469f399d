/* EAL and port setup, and the burst loop (after DPDK's l2fwd): receive a burst, classify each
 * frame, hand its datagram to the slot engine, build the replies into mbufs (the input's own
 * for a reply to the sender, fresh ones from the pool for a result to every member), buffer
 * them for TX, flush.
 *
 * With --lcores N the port has N RX/TX queue pairs and N strands run that loop, strand i on
 * lcore i with queue pair i. A chunk of (job, slot) belongs to strand slot % N (nce_strand_of): a
 * strand that receives another strand's frame hands the mbuf to that strand's ring
 * (multi-producer, single-consumer; a full ring drops and counts, never waits), so each slot's
 * state is touched by one strand only and needs no lock. Job datagrams (the handshake) belong
 * to strand 0, which parks the other strands between their bursts while it handles a hello that
 * may restart every slot of its job
 * (an authentic hello to a job quiet long enough to restart, checked read-only first). IPv4 fragments are all handed to strand 0, which reassembles them in its table. */
#include <stdio.h>
#include <string.h>
#include <sched.h>
#include <time.h>

#include <rte_eal.h>
#include <rte_errno.h>
#include <rte_ethdev.h>
#include <rte_launch.h>
#include <rte_lcore.h>
#include <rte_malloc.h>
#include <rte_mbuf.h>
#include <rte_cycles.h>
#include <rte_ip.h>
#include <rte_ip_frag.h>
#include <rte_ring.h>
#include <rte_udp.h>

#include "ncd_priv.h"

#define BURST 32
#define NB_MBUF 8191
#define NB_MBUF_STRAND 2048        /* more per strand beyond the first: its RX ring and its inbox */
#define MBUF_CACHE 256
#define NB_RXD 1024
#define NB_TXD 1024
#define INBOX 1024                 /* frames other strands may hand a strand before it drops */
#define IDLE_POLLS 256
#define SPINS_PER_YIELD 256        /* a waiting strand gives its CPU away this often (2-core VMs) */
/* IPv4 reassembly (strand 0): at most FRAG_BUCKETS * FRAG_WAYS packets in progress (each of at
 * most RTE_LIBRTE_IP_FRAG_MAX_FRAG fragments, so a few hundred mbufs at most are held), each
 * for up to FRAG_TTL_S seconds, Linux's ipfrag_time. */
#define FRAG_BUCKETS 16
#define FRAG_WAYS 4
#define FRAG_TTL_S 30
#define PARK_GONE UINT64_MAX       /* a strand's park acknowledgement once it left its loop */

/* What a strand hands to another with a frame: its classification, in the mbuf's private area
 * (the datagram and the sender's MAC point into the mbuf's own data, which travels with it). */
struct handoff {
    struct ncd_pkt p;
    enum ncd_class c;
};

/* One strand: its queue pair's TX buffer, counters and this burst's hand-overs; written by its
 * own thread only (`acked` is read by strand 0). */
struct strand {
    struct ncd_io io;
    uint16_t id;
    unsigned lcore;
    struct rte_eth_dev_tx_buffer *txb;
    struct rte_mbuf *out[NCE_MAX_STRANDS][BURST];     /* this burst's frames for each strand */
    uint16_t nout[NCE_MAX_STRANDS];
    uint64_t acked;                /* the park request it parked for (strand 0 waits on it) */
} __rte_cache_aligned;

static struct strand strands[NCE_MAX_STRANDS];
/* Each strand's inbox (multi-producer, single-consumer): the frames of its slots that other
 * strands received. The pointers are only read after setup, on lines no strand writes. */
static struct rte_ring *inboxes[NCE_MAX_STRANDS];
struct ncd_io *const ncd_leaf_io = &strands[0].io;
static unsigned nstrands = 1;
static uint16_t port_id;
static struct rte_mempool *pool;
static struct rte_ip_frag_tbl *frags;
static struct rte_ip_frag_death_row death_row;
/* A reassembled frame (strand 0), copied out of its mbuf chain for classification and the
 * engine. */
static uint8_t whole[RTE_ETHER_HDR_LEN + RTE_IPV4_MAX_PKT_LEN];
static int eal_up, port_up, run_mode;
static unsigned run_idle_us;
static volatile int stopping;
static uint64_t park_seq;          /* odd while strand 0 asks the other strands to park */

#define FAIL(...)                                                   \
    do {                                                            \
        snprintf(nce_errbuf, sizeof nce_errbuf, __VA_ARGS__);       \
        return -1;                                                  \
    } while (0)

int ncd_set_strands(unsigned n)
{
    if (eal_up)
        FAIL("the strands are set before EAL starts");
    if (nce_set_strands(n) != 0)
        return -1;
    nstrands = n;
    return 0;
}

unsigned ncd_strands(void)
{
    return nstrands;
}

/* Each strand's counters, copied word by word (no value is torn), summed over the strands or
 * one. */
static void add_io(struct ncd_io *out, const struct ncd_io *in)
{
    const volatile uint64_t *src = (const volatile uint64_t *)in;
    uint64_t *dst = (uint64_t *)out;
    for (size_t i = 0; i < sizeof *out / sizeof(uint64_t); i++)
        dst[i] += src[i];
}

void ncd_io_stats(struct ncd_io *io)
{
    memset(io, 0, sizeof *io);
    for (unsigned i = 0; i < NCE_MAX_STRANDS; i++)
        add_io(io, &strands[i].io);
}

int ncd_strand_io_stats(unsigned strand, struct ncd_io *io)
{
    if (strand >= nstrands)
        return -1;
    memset(io, 0, sizeof *io);
    add_io(io, &strands[strand].io);
    return 0;
}

void ncd_io_reset(void)
{
    for (unsigned i = 0; i < NCE_MAX_STRANDS; i++)
        memset(&strands[i].io, 0, sizeof strands[i].io);
}

static void count_tx_drops(struct rte_mbuf **pkts, uint16_t unsent, void *userdata)
{
    struct ncd_io *io = userdata;
    io->tx_dropped += unsent;
    io->tx_frames -= unsent;
    rte_pktmbuf_free_bulk(pkts, unsent);
}

/* The port's configuration for nstrands queue pairs: RSS over IPv4/UDP where the device hashes
 * (a NIC); af_packet and af_xdp spread flows over their queues themselves (the kernel's
 * fanout, the interface's own RSS). */
static int configure_port(int socket)
{
    struct rte_eth_dev_info info;
    int rc = rte_eth_dev_info_get(port_id, &info);
    if (rc != 0)
        FAIL("rte_eth_dev_info_get: %s", rte_strerror(-rc));
    if (info.max_rx_queues < nstrands || info.max_tx_queues < nstrands)
        FAIL("--lcores %u needs %u RX/TX queue pairs, the port (%s) has %u RX and %u TX queues "
             "(af_xdp: the interface's channels, ethtool -l)",
             nstrands, nstrands, info.driver_name, info.max_rx_queues, info.max_tx_queues);
    struct rte_eth_conf conf;
    memset(&conf, 0, sizeof conf);
    const uint64_t hash = (RTE_ETH_RSS_IP | RTE_ETH_RSS_UDP) & info.flow_type_rss_offloads;
    if (nstrands > 1 && hash != 0) {
        conf.rxmode.mq_mode = RTE_ETH_MQ_RX_RSS;
        conf.rx_adv_conf.rss_conf.rss_hf = hash;
    }
    rc = rte_eth_dev_configure(port_id, (uint16_t)nstrands, (uint16_t)nstrands, &conf);
    if (rc < 0)
        FAIL("rte_eth_dev_configure: %s", rte_strerror(-rc));
    uint16_t nrxd = NB_RXD, ntxd = NB_TXD;
    rc = rte_eth_dev_adjust_nb_rx_tx_desc(port_id, &nrxd, &ntxd);
    if (rc < 0)
        FAIL("rte_eth_dev_adjust_nb_rx_tx_desc: %s", rte_strerror(-rc));
    for (uint16_t q = 0; q < nstrands; q++) {
        rc = rte_eth_rx_queue_setup(port_id, q, nrxd, socket, NULL, pool);
        if (rc < 0)
            FAIL("rte_eth_rx_queue_setup (queue %u): %s", q, rte_strerror(-rc));
        rc = rte_eth_tx_queue_setup(port_id, q, ntxd, socket, NULL);
        if (rc < 0)
            FAIL("rte_eth_tx_queue_setup (queue %u): %s", q, rte_strerror(-rc));
    }
    return 0;
}

/* Strand i's lcore (strand 0 runs on the thread that calls ncd_run), TX buffer and inbox. */
static int setup_strands(int socket)
{
    unsigned lcore = rte_get_main_lcore();
    for (unsigned i = 0; i < nstrands; i++) {
        struct strand *l = &strands[i];
        l->id = (uint16_t)i;
        l->acked = 0;
        if (i > 0) {
            lcore = rte_get_next_lcore(lcore, 1, 0);
            if (lcore >= RTE_MAX_LCORE)
                FAIL("--lcores %u: EAL has only %u lcores (its --lcores argument)", nstrands,
                     rte_lcore_count());
            l->lcore = lcore;
            char name[RTE_RING_NAMESIZE];
            snprintf(name, sizeof name, "ncd_inbox%u", i);
            inboxes[i] = rte_ring_create(name, INBOX, socket, RING_F_SC_DEQ);
            if (inboxes[i] == NULL)
                FAIL("cannot create strand %u's ring: %s", i, rte_strerror(rte_errno));
        }
        l->txb = rte_zmalloc_socket("ncd_txb", RTE_ETH_TX_BUFFER_SIZE(BURST), 0, socket);
        if (l->txb == NULL)
            FAIL("cannot allocate strand %u's TX buffer", i);
        rte_eth_tx_buffer_init(l->txb, BURST);
        rte_eth_tx_buffer_set_err_callback(l->txb, count_tx_drops, &l->io);
    }
    if (nstrands > 1) {              /* strand 0's inbox: job datagrams, fragments */
        inboxes[0] = rte_ring_create("ncd_inbox0", INBOX, socket, RING_F_SC_DEQ);
        if (inboxes[0] == NULL)
            FAIL("cannot create strand 0's ring: %s", rte_strerror(rte_errno));
    }
    return 0;
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

    pool = rte_pktmbuf_pool_create("ncd_mbufs", NB_MBUF + (nstrands - 1) * NB_MBUF_STRAND,
                                   MBUF_CACHE,
                                   RTE_ALIGN(sizeof(struct handoff), RTE_MBUF_PRIV_ALIGN),
                                   NCD_FRAME_ROOM + RTE_PKTMBUF_HEADROOM, rte_socket_id());
    if (pool == NULL)
        FAIL("cannot create the mbuf pool: %s", rte_strerror(rte_errno));
    const int socket = rte_eth_dev_socket_id(port_id);
    if (configure_port(socket) != 0 || setup_strands(socket) != 0)
        return -1;

    frags = rte_ip_frag_table_create(FRAG_BUCKETS, FRAG_WAYS, FRAG_BUCKETS * FRAG_WAYS,
                                     rte_get_tsc_hz() * FRAG_TTL_S, socket);
    if (frags == NULL)
        FAIL("cannot create the IPv4 reassembly table");

    int rc = rte_eth_dev_start(port_id);
    if (rc < 0)
        FAIL("rte_eth_dev_start: %s", rte_strerror(-rc));
    port_up = 1;
    rte_eth_promiscuous_enable(port_id); /* best effort: the veth peer sends to our MAC anyway */
    rte_eth_macaddr_get(port_id, &ncd_mac);
    return 0;
}

static inline void send_frame(struct strand *l, struct rte_mbuf *m, uint32_t len)
{
    m->data_len = (uint16_t)len;
    m->pkt_len = len;
    l->io.tx_frames++;
    rte_eth_tx_buffer(port_id, l->id, l->txb, m);
}

/* The bytes an mbuf's buffer holds from its data offset on. */
static inline uint32_t room(const struct rte_mbuf *m)
{
    return (uint32_t)(m->buf_len - m->data_off);
}

/* A completed slot: one result per member, each in a fresh mbuf of NCD_FRAME_ROOM bytes, which
 * every job's result frames fit (nce_set_reply_room); a larger frame is counted, never written. */
static void send_all(struct strand *l, const struct nce_action *a)
{
    struct rte_mbuf *out[NCE_MAX_WORKERS];
    const unsigned n = a->members;
    if (rte_pktmbuf_alloc_bulk(pool, out, n) != 0) {
        l->io.no_mbuf += n;
        return;
    }
    for (uint16_t r = 0; r < n; r++) {
        const uint32_t len =
            ncd_frame_to_member(rte_pktmbuf_mtod(out[r], uint8_t *), room(out[r]), a, r);
        if (len == 0) {                         /* larger than an mbuf: not sent, counted */
            l->io.oversize++;
            rte_pktmbuf_free(out[r]);
            continue;
        }
        send_frame(l, out[r], len);
    }
}

/* A leaf's datagram to its spine (act->up, besides the verdict's replies; or dgram when a is
 * NULL) in a fresh mbuf, or the ARP request for the spine's MAC that route asks for instead;
 * NULL, counted, when there is no mbuf or it does not fit. Before the spine's MAC is known a
 * datagram is dropped and counted and an ARP request goes out at a bounded rate
 * (ncd_uplink_route): a worker's retransmission makes the engine send it again (upstream.c). */
static struct rte_mbuf *spine_frame(struct ncd_io *io, enum ncd_route route,
                                    const struct nce_action *a, const uint8_t *dgram,
                                    uint32_t dgram_len, uint32_t *len)
{
    struct rte_mbuf *m = rte_pktmbuf_alloc(pool);
    if (m == NULL) {
        io->no_mbuf++;
        return NULL;
    }
    *len = ncd_frame_spine(rte_pktmbuf_mtod(m, uint8_t *), room(m), route, a, dgram, dgram_len);
    if (*len == 0) {                            /* larger than an mbuf: not sent, counted */
        io->oversize++;
        rte_pktmbuf_free(m);
        return NULL;
    }
    io->uplink_frames += route == NCD_R_SEND;
    return m;
}

static void send_uplink(struct strand *l, const struct nce_action *a)
{
    const enum ncd_route route = ncd_uplink_route();
    uint32_t len;
    struct rte_mbuf *m =
        route == NCD_R_WAIT ? NULL : spine_frame(&l->io, route, a, NULL, 0, &len);
    if (m != NULL)
        send_frame(l, m, len);
}

/* A fragment (classified, p) into the reassembly table: the whole packet's mbuf chain once its
 * last fragment is in, else NULL (the table keeps the fragment, or drops it on its death row:
 * a table full of packets in progress, a packet of more than RTE_LIBRTE_IP_FRAG_MAX_FRAG
 * fragments, overlaps). Strand 0 only. */
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

int ncd_whole_on_strand0(const uint8_t *dgram, uint32_t len, unsigned strands)
{
    return nce_strand_of(dgram, len, strands, 0) == 0;
}

/* The reassembled packet m as one frame (its IPv4 header checksum made valid again: the
 * fragments' were checked), classified into p; its tail segments are freed, so that m can
 * carry a reply. A frame that fits m's buffer is moved into it (it may then go to another
 * strand like any frame); a larger one stays in `whole` (*in_whole set), where strand 0 handles
 * it if it owns it (ncd_whole_on_strand0): IPv4 options can make a valid chunk's frame larger
 * than the room admission assumed, so such a datagram may well touch a slot. */
static enum ncd_class classify_whole(struct rte_mbuf *m, struct ncd_pkt *p, int *in_whole)
{
    const uint32_t len = rte_pktmbuf_pkt_len(m);
    enum ncd_class c = NCD_C_IGNORE;
    int moved = 0;
    *in_whole = 0;
    if (len <= sizeof whole && len >= RTE_ETHER_HDR_LEN + sizeof(struct rte_ipv4_hdr)) {
        const uint8_t *data = rte_pktmbuf_read(m, 0, len, whole);
        if (data != whole)
            memcpy(whole, data, len);
        struct rte_ipv4_hdr *ip = (struct rte_ipv4_hdr *)(whole + RTE_ETHER_HDR_LEN);
        ip->hdr_checksum = 0;
        ip->hdr_checksum = rte_ipv4_cksum(ip);
        moved = len <= room(m);
        if (moved)
            memcpy(rte_pktmbuf_mtod(m, uint8_t *), whole, len);
        c = ncd_classify(moved ? rte_pktmbuf_mtod(m, uint8_t *) : whole, len, p);
        *in_whole = !moved;
    }
    if (m->next != NULL) {
        rte_pktmbuf_free(m->next);
        m->next = NULL;
        m->nb_segs = 1;
    }
    if (moved)
        m->data_len = (uint16_t)len;
    m->pkt_len = m->data_len;
    return c == NCD_C_FRAGMENT ? NCD_C_IGNORE : c;
}

/* Ask the other strands to park between their bursts and wait until each has (or has left its
 * loop): strand 0 then has every slot to itself. Nothing strand 0 waits for waits on strand 0. */
static void park_others(void)
{
    const uint64_t seq = __atomic_add_fetch(&park_seq, 1, __ATOMIC_SEQ_CST);
    for (unsigned i = 1; i < nstrands; i++) {
        unsigned spins = 0;
        for (;;) {
            const uint64_t acked = __atomic_load_n(&strands[i].acked, __ATOMIC_ACQUIRE);
            if (acked == seq || acked == PARK_GONE)
                break;
            rte_pause();
            if (++spins % SPINS_PER_YIELD == 0)
                sched_yield();
        }
    }
    strands[0].io.parks++;
}

static void release_others(void)
{
    __atomic_add_fetch(&park_seq, 1, __ATOMIC_RELEASE);
}

/* The top of strands 1..N-1's loop: park while strand 0 asks (until it releases, or the loop
 * stops); whether it parked. */
static int park_if_asked(struct strand *l)
{
    const uint64_t seq = __atomic_load_n(&park_seq, __ATOMIC_ACQUIRE);
    if (!(seq & 1))
        return 0;
    __atomic_store_n(&l->acked, seq, __ATOMIC_RELEASE);
    unsigned spins = 0;
    while (__atomic_load_n(&park_seq, __ATOMIC_ACQUIRE) == seq && !stopping) {
        rte_pause();
        if (++spins % SPINS_PER_YIELD == 0)
            sched_yield();
    }
    return 1;
}

/* A datagram this strand owns through the engine; replies on this strand's queue. */
static void aggregate(struct strand *l, struct rte_mbuf *m, const struct ncd_pkt *p)
{
    struct nce_action a;
    /* Strand 0's job datagrams: a hello that may restart every slot of its job (checked read-only
     * first: well formed, authentic, its job quiet) is handled with the other strands parked;
     * any other one with them running, and then it restarts nothing. */
    const int hello = nstrands > 1 && nce_is_job_datagram(p->dgram, p->dgram_len);
    const int park = hello && nce_hello_may_restart(p->dgram, p->dgram_len);
    if (park)
        park_others();
    nce_no_restart = hello && !park;
    const enum nce_verdict v = nce_input(p->dgram, p->dgram_len, &p->from, &a);
    nce_no_restart = 0;
    if (park)
        release_others();
    if (a.up != NCE_UP_NONE)       /* a leaf's partial sums or hello (a leaf has one strand) */
        send_uplink(l, &a);
    switch (v) {
    case NCE_V_SEND_ONE:
    case NCE_V_NOTICE:
    case NCE_V_DESCRIPTOR: {
        /* The input mbuf becomes the reply: every mbuf holds NCD_FRAME_ROOM bytes, which
         * every job's result frames fit (nce_set_reply_room); a larger one is counted. */
        const uint32_t len =
            ncd_frame_to_sender(rte_pktmbuf_mtod(m, uint8_t *), room(m), &a, &p->from);
        if (len != 0) {
            send_frame(l, m, len);
            return;
        }
        l->io.oversize++;
        break;
    }
    case NCE_V_SEND_ALL:
        send_all(l, &a);
        break;
    case NCE_V_NONE:
        break;
    }
    rte_pktmbuf_free(m);
}

/* This burst's frames for other strands into their inboxes; what a full inbox refuses is
 * dropped and counted (enqueues never wait: no strand waits on another). */
static void hand_over(struct strand *l)
{
    for (unsigned o = 0; o < nstrands; o++) {
        const unsigned n = l->nout[o];
        if (n == 0)
            continue;
        const unsigned put = rte_ring_mp_enqueue_burst(inboxes[o], (void **)l->out[o], n,
                                                       NULL);
        l->io.handoffs += put;
        if (put < n) {
            l->io.handoff_full += n - put;
            rte_pktmbuf_free_bulk(&l->out[o][put], n - put);
        }
        l->nout[o] = 0;
    }
}

/* A classified frame to the strand that owns it: this one (handled now), or another (into this
 * burst's batch for that strand's inbox, its classification in the mbuf's private area). */
static void route(struct strand *l, struct rte_mbuf *m, enum ncd_class c, const struct ncd_pkt *p)
{
    unsigned owner = l->id;
    if (nstrands > 1 && c == NCD_C_FRAGMENT)
        owner = 0;
    else if (nstrands > 1 && c == NCD_C_DATAGRAM)
        owner = nce_strand_of(p->dgram, p->dgram_len, nstrands, l->id);
    if (owner != l->id) {
        if (l->nout[owner] == BURST)            /* (reassembled frames besides a full burst) */
            hand_over(l);
        struct handoff *h = rte_mbuf_to_priv(m);
        h->p = *p;
        h->c = c;
        l->out[owner][l->nout[owner]++] = m;
        return;
    }
    switch (c) {
    case NCD_C_ARP:
        ncd_build_arp_reply(rte_pktmbuf_mtod(m, uint8_t *));
        l->io.arp_replies++;
        send_frame(l, m, m->data_len);
        return;
    case NCD_C_IGNORE:
        l->io.ignored++;
        break;
    case NCD_C_BAD_CHECKSUM:
        l->io.bad_checksum++;
        break;
    case NCD_C_FRAGMENT: {     /* strand 0's: every fragment is handed to it */
        struct ncd_pkt whole_p;
        int in_whole;
        l->io.fragments++;
        m = reassemble(m, p);
        if (m == NULL)
            return;
        l->io.reassembled++;
        const enum ncd_class wc = classify_whole(m, &whole_p, &in_whole);
        if (wc != NCD_C_DATAGRAM || !in_whole) {
            route(l, m, wc, &whole_p);
            return;
        }
        if (ncd_whole_on_strand0(whole_p.dgram, whole_p.dgram_len, nstrands)) {
            aggregate(l, m, &whole_p);          /* strand 0's (a job's, or its slot's) */
            return;
        }
        l->io.ignored++;                        /* another strand's slot: never touched here */
        break;
    }
    case NCD_C_DATAGRAM:
        aggregate(l, m, p);
        return;
    }
    rte_pktmbuf_free(m);
}

/* The no-op forwarder: every frame goes back where it came from. IPv4/UDP frames become the
 * echo of their datagram (addresses and ports swapped; the checksums stay valid), so a UDP
 * sender gets its own datagram back, one reply per packet like the aggregator. An ARP request
 * for our address is classified as it arrived (a broadcast destination, the host's source) and
 * answered; classified after the swap its source would be the broadcast address, which
 * ncd_classify ignores, and no host would ever learn where to send. */
static inline void forward(struct strand *l, struct rte_mbuf *m)
{
    struct rte_ether_hdr *eth = rte_pktmbuf_mtod(m, struct rte_ether_hdr *);
    if (eth->ether_type == rte_cpu_to_be_16(RTE_ETHER_TYPE_ARP)) {
        struct ncd_pkt unused;
        if (ncd_classify((const uint8_t *)eth, m->data_len, &unused) == NCD_C_ARP) {
            ncd_build_arp_reply((uint8_t *)eth);    /* sets both MAC addresses */
            l->io.arp_replies++;
            send_frame(l, m, m->data_len);
            return;
        }
    }
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
    }
    send_frame(l, m, m->data_len);
}

/* One strand's burst loop: its RX queue and its inbox until ncd_stop(). */
static void strand_loop(struct strand *l)
{
    const struct timespec nap = {0, (long)run_idle_us * 1000};
    struct rte_mbuf *rx[BURST], *in[BURST];
    struct rte_ring *const inbox = inboxes[l->id];
    unsigned idle = 0;
    nce_strand = l->id;

    while (!stopping) {
        if (l->id != 0 && park_if_asked(l))
            continue;
        const uint16_t n = rte_eth_rx_burst(port_id, l->id, rx, BURST);
        const unsigned m =
            inbox != NULL ? rte_ring_sc_dequeue_burst(inbox, (void **)in, BURST, NULL) : 0;
        l->io.loops++;
        if (n + m == 0) {
            if (run_idle_us && ++idle >= IDLE_POLLS)
                nanosleep(&nap, NULL);
            continue;
        }
        idle = 0;
        l->io.rx_frames += n;
        l->io.handed_in += m;
        if (run_mode == 1) {
            for (uint16_t i = 0; i < n; i++)
                forward(l, rx[i]);
        } else {
            nce_dp_enter();
            for (unsigned i = 0; i < m; i++) {
                const struct handoff *h = rte_mbuf_to_priv(in[i]);
                route(l, in[i], h->c, &h->p);
            }
            for (uint16_t i = 0; i < n; i++) {
                struct ncd_pkt p;
                if (i + 1 < n)
                    rte_prefetch0(rte_pktmbuf_mtod(rx[i + 1], void *));
                const uint8_t *frame = rte_pktmbuf_mtod(rx[i], uint8_t *);
                route(l, rx[i], ncd_classify(frame, rte_pktmbuf_data_len(rx[i]), &p), &p);
            }
            nce_dp_leave();
            hand_over(l);
        }
        rte_eth_tx_buffer_flush(port_id, l->id, l->txb);
    }
    rte_eth_tx_buffer_flush(port_id, l->id, l->txb);
    __atomic_store_n(&l->acked, PARK_GONE, __ATOMIC_RELEASE);
}

static int strand_main(void *arg)
{
    strand_loop(arg);
    return 0;
}

int ncd_run(int mode, unsigned idle_sleep_us)
{
    if (!port_up)
        FAIL("the port is not started (ncd_init)");
    const int registered = rte_lcore_id() == LCORE_ID_ANY && rte_thread_register() == 0;
    run_mode = mode;
    run_idle_us = idle_sleep_us;
    unsigned launched = 1;
    int rc = 0;
    for (; launched < nstrands; launched++) {
        rc = rte_eal_remote_launch(strand_main, &strands[launched], strands[launched].lcore);
        if (rc != 0) {
            snprintf(nce_errbuf, sizeof nce_errbuf, "cannot launch strand %u on lcore %u: %s",
                     launched, strands[launched].lcore, rte_strerror(-rc));
            stopping = 1;
            break;
        }
    }
    if (rc == 0)
        strand_loop(&strands[0]);
    for (unsigned i = 1; i < launched; i++)
        rte_eal_wait_lcore(strands[i].lcore);
    for (unsigned i = 0; i < nstrands; i++) {    /* what was handed over and never taken */
        struct rte_mbuf *left;
        while (inboxes[i] != NULL && rte_ring_sc_dequeue(inboxes[i], (void **)&left) == 0)
            rte_pktmbuf_free(left);
    }
    if (registered)
        rte_thread_unregister();
    return rc == 0 ? 0 : -1;
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
        ncd_leaf_io->tx_frames++;
    } else {
        ncd_leaf_io->tx_dropped++;
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
    struct rte_mbuf *m = spine_frame(ncd_leaf_io, route, NULL, dgram, len, &n);
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
    ncd_leaf_io->rx_frames++;
    switch (ncd_classify(rte_pktmbuf_mtod(m, uint8_t *), rte_pktmbuf_data_len(m), &p)) {
    case NCD_C_ARP:
        ncd_build_arp_reply(rte_pktmbuf_mtod(m, uint8_t *));
        ncd_leaf_io->arp_replies++;
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
        ncd_leaf_io->bad_checksum++;
        break;
    case NCD_C_IGNORE:
    case NCD_C_FRAGMENT:    /* a handshake's answer is one small datagram */
        ncd_leaf_io->ignored++;
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
    ncd_leaf_io->uplink_frames += route == NCD_R_SEND;
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
