/* Benchmark traffic: N emulated workers (one connected UDP socket each) running the SwitchML
 * closed loop against an aggregator: a window of slots per rank, the next chunk into a slot
 * when its result is back, retransmission (RETX) of everything outstanding after a quiet spell.
 * Plain sockets, no DPDK: this is the load, not the data plane. Batched as the workers' C
 * transfer batches (ncd_gen_run_batched): each flush's chunks as UDP_SEGMENT (GSO) runs, and
 * UDP GRO buffers received and split into their datagrams. */
#define _GNU_SOURCE
#include <errno.h>
#include <netinet/udp.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "datapath.h"
#include "ncd.h"

#define GEN_MAX_RANKS 16
#define GEN_MAX_WINDOW 1024
#define GEN_BATCH 64
#define GEN_MAX_DGRAM (NCE_HDR_LEN + NCE_MAX_K)   /* an MTU-sized chunk: the engine's largest */
#define GEN_GSO_SEGMENTS 64     /* datagrams per UDP_SEGMENT send, as the workers' (transfer.c) */
#define GEN_GSO_BYTES 65000     /* and their bytes, under the 64 KiB of one IP packet */
#define GEN_GRO_BYTES 65536     /* a GRO buffer: at most one IP packet's 64 KiB */
#define GEN_GSO_CTRL CMSG_SPACE(sizeof(uint16_t))
#define GEN_GRO_CTRL CMSG_SPACE(sizeof(int))

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

struct gen_rank {
    uint8_t version[GEN_MAX_WINDOW];   /* outstanding version of each slot */
    uint32_t chunk[GEN_MAX_WINDOW];    /* outstanding chunk number of each slot */
    uint16_t queue[GEN_BATCH];         /* slots to send now */
    unsigned queued;
};

static struct gen_rank ranks_state[GEN_MAX_RANKS];
static uint8_t tx_bufs[GEN_MAX_RANKS][GEN_BATCH][GEN_MAX_DGRAM];
static uint8_t rx_bufs[GEN_BATCH][GEN_GRO_BYTES];
static uint8_t rx_ctrl[GEN_BATCH][GEN_GRO_CTRL] __attribute__((aligned(8)));
static uint8_t tx_ctrl[GEN_BATCH][GEN_GSO_CTRL] __attribute__((aligned(8)));
static int gen_gso, gen_gro;    /* this run sends UDP_SEGMENT runs / takes UDP GRO buffers */

static void fill(uint8_t *d, uint16_t job, uint16_t rank, int emin, unsigned k, uint16_t slot,
                 unsigned version, uint32_t chunk, int retx, const uint8_t *codes)
{
    const uint32_t offset = chunk * k;
    d[0] = 1;
    d[1] = (uint8_t)((version ? 0x04 : 0) | (retx ? 0x02 : 0));
    d[2] = 0;
    d[3] = (uint8_t)emin;
    d[4] = (uint8_t)(job >> 8), d[5] = (uint8_t)job;
    d[6] = (uint8_t)(rank >> 8), d[7] = (uint8_t)rank;
    d[8] = (uint8_t)(slot >> 8), d[9] = (uint8_t)slot;
    d[10] = (uint8_t)(k >> 8), d[11] = (uint8_t)k;
    d[12] = (uint8_t)(offset >> 24), d[13] = (uint8_t)(offset >> 16);
    d[14] = (uint8_t)(offset >> 8), d[15] = (uint8_t)offset;
    memcpy(d + 16, codes, k);
}

/* Message m of a flush: datagrams first.. of queued, one or (with GSO) a run of up to
 * GEN_GSO_SEGMENTS equal-length ones in GEN_GSO_BYTES, sent as one. Returns how many it took. */
static unsigned lay_out(struct mmsghdr *msg, struct iovec *iov, unsigned first, unsigned queued,
                        unsigned m, unsigned len)
{
    unsigned n = 1;
    while (gen_gso && first + n < queued && n < GEN_GSO_SEGMENTS && (n + 1) * len <= GEN_GSO_BYTES)
        n++;
    memset(&msg->msg_hdr, 0, sizeof msg->msg_hdr);
    msg->msg_hdr.msg_iov = &iov[first];
    msg->msg_hdr.msg_iovlen = n;
    if (n > 1) {
        struct cmsghdr *c = (struct cmsghdr *)tx_ctrl[m];
        c->cmsg_level = SOL_UDP;
        c->cmsg_type = UDP_SEGMENT;
        c->cmsg_len = CMSG_LEN(sizeof(uint16_t));
        const uint16_t seg = (uint16_t)len;
        memcpy(CMSG_DATA(c), &seg, sizeof seg);
        msg->msg_hdr.msg_control = tx_ctrl[m];
        msg->msg_hdr.msg_controllen = GEN_GSO_CTRL;
    }
    return n;
}

/* Lay out datagrams first.. of queued as messages from m on (lay_out); their counts in count.
 * Returns the message count. */
static unsigned lay_out_all(struct mmsghdr *msgs, struct iovec *iov, unsigned *count,
                            unsigned first, unsigned m, unsigned queued, unsigned len)
{
    for (unsigned i = first; i < queued; i += count[m++])
        count[m] = lay_out(&msgs[m], iov, i, queued, m, len);
    return m;
}

static void flush(int fd, struct gen_rank *g, unsigned r, uint16_t job, int emin, unsigned k,
                  int retx, const uint8_t *codes, struct ncd_gen_stats *st)
{
    struct mmsghdr msgs[GEN_BATCH];
    struct iovec iov[GEN_BATCH];
    unsigned count[GEN_BATCH];
    for (unsigned i = 0; i < g->queued; i++) {
        const uint16_t s = g->queue[i];
        fill(tx_bufs[r][i], job, (uint16_t)r, emin, k, s, g->version[s], g->chunk[s], retx, codes);
        iov[i].iov_base = tx_bufs[r][i];
        iov[i].iov_len = 16 + k;
    }
    unsigned messages = lay_out_all(msgs, iov, count, 0, 0, g->queued, 16 + k);
    unsigned done = 0, sent = 0;
    while (done < messages) {
        int n = sendmmsg(fd, msgs + done, messages - done, 0);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (count[done] > 1) {      /* the kernel cannot segment: the rest one by one */
                gen_gso = 0;
                messages = lay_out_all(msgs, iov, count, sent, done, g->queued, 16 + k);
                continue;
            }
            st->send_errors += g->queued - sent; /* ENOBUFS and friends: the window recovers */
            break;
        }
        for (unsigned m = done; m < done + (unsigned)n; m++)
            sent += count[m];
        done += (unsigned)n;
    }
    st->sent += sent;
    g->queued = 0;
}

/* The size of the datagrams in receive buffer i: its UDP_GRO control message's, or 0 (one
 * datagram). */
static uint32_t gro_size(struct msghdr *h)
{
    if (h->msg_control == NULL)
        return 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(h); c != NULL; c = CMSG_NXTHDR(h, c))
        if (c->cmsg_level == SOL_UDP && c->cmsg_type == UDP_GRO &&
            c->cmsg_len >= CMSG_LEN(sizeof(int))) {
            int size;
            memcpy(&size, CMSG_DATA(c), sizeof size);
            return size > 0 ? (uint32_t)size : 0;
        }
    return 0;
}

/* One datagram of a result (or an echo) for rank r: its slot's chunk completes when it is the
 * one outstanding. */
static void take(struct gen_rank *g, const uint8_t *d, uint32_t len, unsigned window, unsigned k,
                 struct ncd_gen_stats *st)
{
    if (len < 16)
        return;
    st->received++;
    const uint16_t s = (uint16_t)(d[8] << 8 | d[9]);
    const unsigned v = (d[1] & 0x04) != 0;
    const uint32_t off = (uint32_t)d[12] << 24 | (uint32_t)d[13] << 16 | (uint32_t)d[14] << 8 |
                         d[15];
    if (s >= window || v != g->version[s] || off != g->chunk[s] * k)
        return; /* a duplicate result (after a retransmission) */
    st->completed++;
    g->version[s] ^= 1;
    g->chunk[s] += window;
    g->queue[g->queued++] = s;
}

static int gen_run(const int *fds, unsigned nranks, uint16_t job, int emin, unsigned k,
                   unsigned window, double seconds, double retx_after, const uint8_t *codes,
                   struct ncd_gen_stats *st)
{
    if (nranks < 1 || nranks > GEN_MAX_RANKS || window < 1 || window > GEN_MAX_WINDOW ||
        k < 1 || k > NCE_MAX_K)
        return -1;
    memset(st, 0, sizeof *st);
    memset(ranks_state, 0, sizeof ranks_state);
    const int on = 1;
    for (unsigned r = 0; r < nranks && gen_gro; r++) /* a kernel without UDP_GRO: none */
        gen_gro = setsockopt(fds[r], SOL_UDP, UDP_GRO, &on, sizeof on) == 0;
    struct pollfd pfd[GEN_MAX_RANKS];
    for (unsigned r = 0; r < nranks; r++) {
        pfd[r].fd = fds[r];
        pfd[r].events = POLLIN;
        struct gen_rank *g = &ranks_state[r];
        for (unsigned s = 0; s < window; s++) {
            g->chunk[s] = s;
            g->queue[g->queued++] = (uint16_t)s;
            if (g->queued == GEN_BATCH)
                flush(fds[r], g, r, job, emin, k, 0, codes, st);
        }
        flush(fds[r], g, r, job, emin, k, 0, codes, st);
    }
    struct mmsghdr msgs[GEN_BATCH];
    struct iovec iov[GEN_BATCH];
    for (unsigned i = 0; i < GEN_BATCH; i++) {
        iov[i].iov_base = rx_bufs[i];
        iov[i].iov_len = gen_gro ? GEN_GRO_BYTES : GEN_MAX_DGRAM;
    }
    const double start = now_s(), end = start + seconds;
    double last_progress = start;
    double t = start;
    while (t < end) {
        int progress = 0;
        for (unsigned r = 0; r < nranks; r++) {
            for (unsigned i = 0; i < GEN_BATCH; i++) {
                memset(&msgs[i].msg_hdr, 0, sizeof msgs[i].msg_hdr);
                msgs[i].msg_hdr.msg_iov = &iov[i];
                msgs[i].msg_hdr.msg_iovlen = 1;
                msgs[i].msg_hdr.msg_control = gen_gro ? rx_ctrl[i] : NULL;
                msgs[i].msg_hdr.msg_controllen = gen_gro ? GEN_GRO_CTRL : 0;
            }
            int n = recvmmsg(fds[r], msgs, GEN_BATCH, MSG_DONTWAIT, NULL);
            if (n <= 0)
                continue;
            struct gen_rank *g = &ranks_state[r];
            for (int i = 0; i < n; i++) {
                const uint32_t len = msgs[i].msg_len;
                uint32_t seg = gro_size(&msgs[i].msg_hdr);
                if (seg == 0 || seg >= len)
                    seg = len;
                for (uint32_t off = 0; off < len; off += seg) {
                    if (g->queued == GEN_BATCH) /* GRO buffers hold more than a batch */
                        flush(fds[r], g, r, job, emin, k, 0, codes, st);
                    take(g, rx_bufs[i] + off, len - off < seg ? len - off : seg, window, k, st);
                }
            }
            if (g->queued) {
                flush(fds[r], g, r, job, emin, k, 0, codes, st);
                progress = 1;
            }
        }
        t = now_s();
        if (progress) {
            last_progress = t;
            continue;
        }
        if (t - last_progress > retx_after) {
            for (unsigned r = 0; r < nranks; r++) {
                struct gen_rank *g = &ranks_state[r];
                for (unsigned s = 0; s < window; s++) {
                    g->queue[g->queued++] = (uint16_t)s;
                    if (g->queued == GEN_BATCH)
                        flush(fds[r], g, r, job, emin, k, 1, codes, st);
                }
                flush(fds[r], g, r, job, emin, k, 1, codes, st);
            }
            st->retransmit_rounds++;
            last_progress = t;
        }
        poll(pfd, nranks, 1);
    }
    st->seconds = now_s() - start;
    return 0;
}

int ncd_gen_run(const int *fds, unsigned nranks, uint16_t job, int emin, unsigned k,
                unsigned window, double seconds, double retx_after, const uint8_t *codes,
                struct ncd_gen_stats *st)
{
    gen_gso = gen_gro = 0;
    return gen_run(fds, nranks, job, emin, k, window, seconds, retx_after, codes, st);
}

int ncd_gen_run_batched(const int *fds, unsigned nranks, uint16_t job, int emin, unsigned k,
                        unsigned window, double seconds, double retx_after,
                        const uint8_t *codes, int gso, int gro, struct ncd_gen_stats *st)
{
    gen_gso = gso != 0, gen_gro = gro != 0;
    return gen_run(fds, nranks, job, emin, k, window, seconds, retx_after, codes, st);
}
