/* Micro-benchmark of a worker's packet path (issue 36 item 3): what one K = 64 datagram costs to
 * send and to receive, per way of handing it to the kernel, on one veth pair.
 *
 * One process per end (tools/worker_path_microbench.py runs them in two network namespaces):
 *
 *   send MODE IFACE SRC_IP DST_IP DST_MAC PORT RATE SECONDS
 *   recv MODE IFACE PORT SECONDS
 *
 * A sender sends bursts of BURST datagrams (PAYLOAD bytes of UDP payload: a K = 64 chunk's 16-byte
 * header and 64 codes, a 122-byte frame) paced at RATE datagrams a second for SECONDS, so that
 * every mode carries the same load; it prints its datagrams and its own CPU time (user + system:
 * a veth delivers in the sender's context, so the receiver's stack up to its socket is in it).
 * Send modes:
 *   udp       sendmmsg, one datagram a message (a worker without GSO);
 *   gso       sendmmsg, one UDP_SEGMENT (GSO) message of BURST datagrams (worker/transfer.c);
 *   ring      AF_PACKET TX ring (TPACKET_V2), BURST frames then one send() kick, through the
 *             qdisc (no PACKET_QDISC_BYPASS: HTB still shapes and counts);
 *   ring_bypass  the same with PACKET_QDISC_BYPASS (skips HTB: not usable on the fabric);
 *   vnet_gso  AF_PACKET with PACKET_VNET_HDR: one frame of BURST datagrams' payload marked as UDP
 *             GSO (gso_size PAYLOAD), one sendmsg a burst, through the qdisc.
 * Receive modes (the datagrams counted, then the process's CPU time):
 *   gro       a UDP socket with UDP_GRO, recvmmsg of 32 buffers (worker/transfer.c);
 *   ring      an AF_PACKET TPACKET_V3 RX ring with PACKET_VNET_HDR (a GRO or GSO skb is one
 *             frame, its gso_size tells the datagrams); the Python driver drops the datagrams in
 *             netfilter's raw PREROUTING so that the UDP stack never sees them.
 * Output: one line of JSON. Everything is bounds-checked against the fixed buffers below. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <linux/if_packet.h>
#include <linux/virtio_net.h>
#include <net/ethernet.h>
#include <net/if.h>
#include <netinet/ip.h>
#include <netinet/udp.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define PAYLOAD 80      /* 16-byte ncina header + 64 NC8 codes */
#define BURST 32        /* datagrams per send: the C transfer's typical GSO run at K = 64 */
#define HDRS (14 + 20 + 8)
#define FRAME (HDRS + PAYLOAD)
#define RING_FRAME 256  /* TPACKET_V2 TX frame size: header + FRAME fits */
#define RING_FRAMES 1024
#define RX_BLOCK (1 << 20)
#define RX_BLOCKS 16
#define RX_BUF 65536
#ifndef VIRTIO_NET_HDR_GSO_UDP_L4
#define VIRTIO_NET_HDR_GSO_UDP_L4 5
#endif

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static double cpu_s(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6 + ru.ru_stime.tv_sec
           + ru.ru_stime.tv_usec * 1e-6;
}

static void die(const char *what)
{
    fprintf(stderr, "%s: %s\n", what, strerror(errno));
    exit(1);
}

static uint16_t ip_checksum(const uint8_t *p, size_t n)
{
    uint32_t sum = 0;
    for (size_t i = 0; i + 1 < n; i += 2)
        sum += (uint32_t)p[i] << 8 | p[i + 1];
    while (sum >> 16)
        sum = (sum & 0xFFFF) + (sum >> 16);
    return (uint16_t)~sum;
}

/* Ethernet + IPv4 + UDP headers for a UDP payload of `payload` bytes; the UDP checksum is 0
 * (none), or with `partial` the folded pseudo-header sum a CHECKSUM_PARTIAL skb carries. */
static void headers(uint8_t *f, const uint8_t *dmac, const uint8_t *smac, uint32_t src,
                    uint32_t dst, uint16_t port, size_t payload, int partial)
{
    memcpy(f, dmac, 6);
    memcpy(f + 6, smac, 6);
    f[12] = 0x08;
    f[13] = 0x00;
    uint8_t *ip = f + 14;
    const size_t udp_len = 8 + payload;
    memset(ip, 0, 20);
    ip[0] = 0x45;
    ip[2] = (uint8_t)((20 + udp_len) >> 8);
    ip[3] = (uint8_t)(20 + udp_len);
    ip[6] = 0x40; /* DF */
    ip[8] = 64;
    ip[9] = IPPROTO_UDP;
    memcpy(ip + 12, &src, 4);
    memcpy(ip + 16, &dst, 4);
    const uint16_t c = ip_checksum(ip, 20);
    ip[10] = (uint8_t)(c >> 8);
    ip[11] = (uint8_t)c;
    uint8_t *udp = ip + 20;
    udp[0] = (uint8_t)(port >> 8);
    udp[1] = (uint8_t)port;
    udp[2] = (uint8_t)(port >> 8);
    udp[3] = (uint8_t)port;
    udp[4] = (uint8_t)(udp_len >> 8);
    udp[5] = (uint8_t)udp_len;
    udp[6] = udp[7] = 0;
    if (partial) {
        uint32_t sum = 0;
        for (int i = 12; i < 20; i += 2)
            sum += (uint32_t)ip[i] << 8 | ip[i + 1];
        sum += IPPROTO_UDP + (uint32_t)udp_len;
        while (sum >> 16)
            sum = (sum & 0xFFFF) + (sum >> 16);
        udp[6] = (uint8_t)(sum >> 8);
        udp[7] = (uint8_t)sum;
    }
}

static int packet_socket(const char *iface, struct sockaddr_ll *ll)
{
    const int fd = socket(AF_PACKET, SOCK_RAW, htons(ETH_P_ALL));
    if (fd < 0)
        die("socket(AF_PACKET)");
    memset(ll, 0, sizeof *ll);
    ll->sll_family = AF_PACKET;
    ll->sll_protocol = htons(ETH_P_ALL);
    ll->sll_ifindex = (int)if_nametoindex(iface);
    if (!ll->sll_ifindex)
        die(iface);
    return fd;
}

static int parse_mac(const char *s, uint8_t *mac)
{
    unsigned m[6];
    if (sscanf(s, "%x:%x:%x:%x:%x:%x", &m[0], &m[1], &m[2], &m[3], &m[4], &m[5]) != 6)
        return -1;
    for (int i = 0; i < 6; i++)
        mac[i] = (uint8_t)m[i];
    return 0;
}

static int run_send(int argc, char **argv)
{
    if (argc != 10)
        return 2;
    const char *mode = argv[2], *iface = argv[3];
    uint32_t src, dst;
    uint8_t dmac[6], smac[6] = {0x02, 0, 0, 0, 0, 1};
    if (inet_pton(AF_INET, argv[4], &src) != 1 || inet_pton(AF_INET, argv[5], &dst) != 1
        || parse_mac(argv[6], dmac))
        return 2;
    const uint16_t port = (uint16_t)atoi(argv[7]);
    const double rate = atof(argv[8]), seconds = atof(argv[9]);
    const int is_udp = !strcmp(mode, "udp"), is_gso = !strcmp(mode, "gso");
    const int is_ring = !strcmp(mode, "ring"), is_bypass = !strcmp(mode, "ring_bypass");
    const int is_vnet = !strcmp(mode, "vnet_gso");
    if (!(is_udp || is_gso || is_ring || is_bypass || is_vnet))
        return 2;
    uint8_t payload[BURST][PAYLOAD];
    for (int i = 0; i < BURST; i++)
        for (int j = 0; j < PAYLOAD; j++)
            payload[i][j] = (uint8_t)(i * 7 + j);
    int fd;
    struct sockaddr_ll ll;
    struct sockaddr_in to = {.sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = dst};
    struct mmsghdr msgs[BURST];
    struct iovec iov[BURST];
    uint8_t ctrl[CMSG_SPACE(sizeof(uint16_t))] __attribute__((aligned(8)));
    uint8_t *ring = NULL;
    unsigned ring_at = 0;
    static uint8_t vframe[sizeof(struct virtio_net_hdr) + HDRS + BURST * PAYLOAD];
    memset(msgs, 0, sizeof msgs);
    for (int i = 0; i < BURST; i++) {
        iov[i].iov_base = payload[i];
        iov[i].iov_len = PAYLOAD;
    }
    if (is_udp || is_gso) {
        fd = socket(AF_INET, SOCK_DGRAM, 0);
        if (fd < 0)
            die("socket");
        struct sockaddr_in me = {.sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = src};
        if (bind(fd, (struct sockaddr *)&me, sizeof me))
            die("bind");
        const int sndbuf = 4 << 20;
        setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof sndbuf);
        for (int i = 0; i < BURST; i++) {
            msgs[i].msg_hdr.msg_name = &to;
            msgs[i].msg_hdr.msg_namelen = sizeof to;
            msgs[i].msg_hdr.msg_iov = &iov[i];
            msgs[i].msg_hdr.msg_iovlen = 1;
        }
        if (is_gso) {
            msgs[0].msg_hdr.msg_iov = iov;
            msgs[0].msg_hdr.msg_iovlen = BURST;
            msgs[0].msg_hdr.msg_control = ctrl;
            msgs[0].msg_hdr.msg_controllen = sizeof ctrl;
            struct cmsghdr *c = CMSG_FIRSTHDR(&msgs[0].msg_hdr);
            c->cmsg_level = SOL_UDP;
            c->cmsg_type = UDP_SEGMENT;
            c->cmsg_len = CMSG_LEN(sizeof(uint16_t));
            const uint16_t seg = PAYLOAD;
            memcpy(CMSG_DATA(c), &seg, sizeof seg);
        }
    } else {
        fd = packet_socket(iface, &ll);
        if (bind(fd, (struct sockaddr *)&ll, sizeof ll))
            die("bind(AF_PACKET)");
        if (is_vnet) {
            const int on = 1;
            if (setsockopt(fd, SOL_PACKET, PACKET_VNET_HDR, &on, sizeof on))
                die("PACKET_VNET_HDR");
            struct virtio_net_hdr *v = (struct virtio_net_hdr *)vframe;
            memset(v, 0, sizeof *v);
            v->flags = VIRTIO_NET_HDR_F_NEEDS_CSUM;
            v->gso_type = VIRTIO_NET_HDR_GSO_UDP_L4;
            v->gso_size = PAYLOAD;
            v->hdr_len = HDRS;
            v->csum_start = 14 + 20;
            v->csum_offset = 6;
            uint8_t *f = vframe + sizeof *v;
            headers(f, dmac, smac, src, dst, port, BURST * PAYLOAD, 1);
            for (int i = 0; i < BURST; i++)
                memcpy(f + HDRS + i * PAYLOAD, payload[i], PAYLOAD);
        } else {
            const int v2 = TPACKET_V2;
            if (setsockopt(fd, SOL_PACKET, PACKET_VERSION, &v2, sizeof v2))
                die("PACKET_VERSION");
            if (is_bypass) {
                const int on = 1;
                if (setsockopt(fd, SOL_PACKET, PACKET_QDISC_BYPASS, &on, sizeof on))
                    die("PACKET_QDISC_BYPASS");
            }
            struct tpacket_req req = {.tp_block_size = 4096, .tp_frame_size = RING_FRAME,
                                      .tp_block_nr = RING_FRAMES * RING_FRAME / 4096,
                                      .tp_frame_nr = RING_FRAMES};
            if (setsockopt(fd, SOL_PACKET, PACKET_TX_RING, &req, sizeof req))
                die("PACKET_TX_RING");
            ring = mmap(NULL, (size_t)RING_FRAMES * RING_FRAME, PROT_READ | PROT_WRITE,
                        MAP_SHARED, fd, 0);
            if (ring == MAP_FAILED)
                die("mmap");
        }
    }
    const double interval = BURST / rate;
    uint64_t sent = 0, failed = 0;
    const double c0 = cpu_s(), t0 = now_s();
    double next = t0;
    while (1) {
        double t = now_s();
        if (t - t0 >= seconds)
            break;
        if (t < next) {
            const double wait = next - t;
            struct timespec ts = {.tv_sec = (time_t)wait, .tv_nsec = (long)((wait - (time_t)wait) * 1e9)};
            nanosleep(&ts, NULL);
        }
        next += interval;
        if (is_udp || is_gso) {
            const int n = sendmmsg(fd, msgs, is_gso ? 1 : BURST, 0);
            if (n > 0)
                sent += is_gso ? BURST : (uint64_t)n;
            else
                failed += BURST;
        } else if (is_vnet) {
            const ssize_t n = sendto(fd, vframe, sizeof vframe, 0, (struct sockaddr *)&ll, sizeof ll);
            if (n == (ssize_t)sizeof vframe)
                sent += BURST;
            else
                failed += BURST;
        } else {
            int queued = 0;
            for (int i = 0; i < BURST; i++) {
                struct tpacket2_hdr *h = (struct tpacket2_hdr *)(ring + (size_t)ring_at * RING_FRAME);
                if (h->tp_status != TP_STATUS_AVAILABLE) { /* the kernel has not sent it yet */
                    failed++;
                    continue;
                }
                uint8_t *f = (uint8_t *)h + TPACKET2_HDRLEN - sizeof(struct sockaddr_ll);
                headers(f, dmac, smac, src, dst, port, PAYLOAD, 0);
                memcpy(f + HDRS, payload[i], PAYLOAD);
                h->tp_len = FRAME;
                __atomic_store_n(&h->tp_status, TP_STATUS_SEND_REQUEST, __ATOMIC_RELEASE);
                ring_at = (ring_at + 1) % RING_FRAMES;
                queued++;
            }
            if (send(fd, NULL, 0, 0) < 0)
                failed += (uint64_t)queued;
            else
                sent += (uint64_t)queued;
        }
    }
    const double c1 = cpu_s(), t1 = now_s();
    printf("{\"role\": \"send\", \"mode\": \"%s\", \"datagrams\": %llu, \"failed\": %llu, "
           "\"cpu_s\": %.6f, \"wall_s\": %.6f}\n",
           mode, (unsigned long long)sent, (unsigned long long)failed, c1 - c0, t1 - t0);
    return 0;
}

static int run_recv(int argc, char **argv)
{
    if (argc != 6)
        return 2;
    const char *mode = argv[2], *iface = argv[3];
    const uint16_t port = (uint16_t)atoi(argv[4]);
    const double seconds = atof(argv[5]);
    uint64_t got = 0, buffers = 0;
    double first = 0, last = 0, c0 = 0;
    if (!strcmp(mode, "gro")) {
        const int fd = socket(AF_INET, SOCK_DGRAM, 0);
        if (fd < 0)
            die("socket");
        struct sockaddr_in me = {.sin_family = AF_INET, .sin_port = htons(port)};
        if (bind(fd, (struct sockaddr *)&me, sizeof me))
            die("bind");
        const int on = 1, rcvbuf = 8 << 20;
        setsockopt(fd, SOL_UDP, UDP_GRO, &on, sizeof on);
        setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof rcvbuf);
        static uint8_t bufs[32][RX_BUF];
        static uint8_t ctrl[32][CMSG_SPACE(sizeof(int))] __attribute__((aligned(8)));
        struct mmsghdr msgs[32];
        struct iovec iov[32];
        printf("{\"role\": \"ready\"}\n");
        fflush(stdout);
        c0 = cpu_s();
        const double end = now_s() + seconds;
        while (now_s() < end) {
            struct pollfd p = {.fd = fd, .events = POLLIN};
            if (poll(&p, 1, 100) <= 0)
                continue;
            for (int j = 0; j < 32; j++) {
                iov[j].iov_base = bufs[j];
                iov[j].iov_len = RX_BUF;
                memset(&msgs[j].msg_hdr, 0, sizeof msgs[j].msg_hdr);
                msgs[j].msg_hdr.msg_iov = &iov[j];
                msgs[j].msg_hdr.msg_iovlen = 1;
                msgs[j].msg_hdr.msg_control = ctrl[j];
                msgs[j].msg_hdr.msg_controllen = sizeof ctrl[j];
            }
            const int n = recvmmsg(fd, msgs, 32, MSG_DONTWAIT, NULL);
            for (int j = 0; j < n; j++) {
                size_t seg = msgs[j].msg_len;
                for (struct cmsghdr *c = CMSG_FIRSTHDR(&msgs[j].msg_hdr); c;
                     c = CMSG_NXTHDR(&msgs[j].msg_hdr, c))
                    if (c->cmsg_level == SOL_UDP && c->cmsg_type == UDP_GRO) {
                        int s;
                        memcpy(&s, CMSG_DATA(c), sizeof s);
                        if (s > 0)
                            seg = (size_t)s;
                    }
                if (seg)
                    got += (msgs[j].msg_len + seg - 1) / seg;
                buffers++;
            }
            if (n > 0) {
                last = now_s();
                if (!first)
                    first = last;
            }
        }
    } else if (!strcmp(mode, "ring")) {
        struct sockaddr_ll ll;
        const int fd = packet_socket(iface, &ll);
        const int v3 = TPACKET_V3, on = 1;
        if (setsockopt(fd, SOL_PACKET, PACKET_VERSION, &v3, sizeof v3))
            die("PACKET_VERSION");
        if (setsockopt(fd, SOL_PACKET, PACKET_VNET_HDR, &on, sizeof on))
            die("PACKET_VNET_HDR");
        struct tpacket_req3 req = {.tp_block_size = RX_BLOCK, .tp_block_nr = RX_BLOCKS,
                                   .tp_frame_size = 2048, .tp_frame_nr = RX_BLOCK / 2048 * RX_BLOCKS,
                                   .tp_retire_blk_tov = 1};
        if (setsockopt(fd, SOL_PACKET, PACKET_RX_RING, &req, sizeof req))
            die("PACKET_RX_RING");
        uint8_t *ring = mmap(NULL, (size_t)RX_BLOCK * RX_BLOCKS, PROT_READ | PROT_WRITE,
                             MAP_SHARED | MAP_LOCKED, fd, 0);
        if (ring == MAP_FAILED)
            die("mmap");
        if (bind(fd, (struct sockaddr *)&ll, sizeof ll))
            die("bind(AF_PACKET)");
        printf("{\"role\": \"ready\"}\n");
        fflush(stdout);
        c0 = cpu_s();
        const double end = now_s() + seconds;
        unsigned block = 0;
        while (now_s() < end) {
            struct tpacket_block_desc *b = (struct tpacket_block_desc *)(ring + (size_t)block * RX_BLOCK);
            if (!(__atomic_load_n(&b->hdr.bh1.block_status, __ATOMIC_ACQUIRE) & TP_STATUS_USER)) {
                struct pollfd p = {.fd = fd, .events = POLLIN};
                poll(&p, 1, 100);
                continue;
            }
            const uint32_t n = b->hdr.bh1.num_pkts;
            uint32_t off = b->hdr.bh1.offset_to_first_pkt;
            for (uint32_t i = 0; i < n && off < RX_BLOCK; i++) {
                const struct tpacket3_hdr *h = (const struct tpacket3_hdr *)((uint8_t *)b + off);
                if ((size_t)off + h->tp_mac + h->tp_snaplen <= RX_BLOCK
                    && h->tp_mac >= sizeof(struct virtio_net_hdr)) {
                    const uint8_t *frame = (const uint8_t *)h + h->tp_mac;
                    const struct virtio_net_hdr *v = (const void *)(frame - sizeof *v);
                    const uint32_t len = h->tp_len;
                    /* IPv4 UDP to `port`: the datagrams of this frame (a GSO/GRO run: its
                     * gso_size each) */
                    if (len >= HDRS && frame[12] == 0x08 && frame[13] == 0 && frame[23] == 17
                        && (frame[36] << 8 | frame[37]) == port) {
                        const uint32_t data = len - HDRS;
                        got += v->gso_size ? (data + v->gso_size - 1) / v->gso_size : 1;
                        buffers++;
                    }
                }
                off += h->tp_next_offset;
                if (!h->tp_next_offset)
                    break;
            }
            __atomic_store_n(&b->hdr.bh1.block_status, TP_STATUS_KERNEL, __ATOMIC_RELEASE);
            block = (block + 1) % RX_BLOCKS;
            last = now_s();
            if (!first)
                first = last;
        }
    } else {
        return 2;
    }
    const double c1 = cpu_s();
    printf("{\"role\": \"recv\", \"mode\": \"%s\", \"datagrams\": %llu, \"buffers\": %llu, "
           "\"cpu_s\": %.6f, \"active_s\": %.6f}\n",
           mode, (unsigned long long)got, (unsigned long long)buffers, c1 - c0, last - first);
    return 0;
}

int main(int argc, char **argv)
{
    int rc = 2;
    if (argc > 1 && !strcmp(argv[1], "send"))
        rc = run_send(argc, argv);
    else if (argc > 1 && !strcmp(argv[1], "recv"))
        rc = run_recv(argc, argv);
    if (rc == 2)
        fprintf(stderr, "usage: send MODE IFACE SRC_IP DST_IP DST_MAC PORT RATE SECONDS | "
                        "recv MODE IFACE PORT SECONDS\n");
    return rc;
}
