/* Benchmark traffic: N emulated workers (one connected UDP socket each) running the SwitchML
 * closed loop against an aggregator: a window of slots per rank, the next chunk into a slot
 * when its result is back, retransmission (RETX) of everything outstanding after a quiet spell.
 * Plain sockets, no DPDK: this is the load, not the data plane. */
#define _GNU_SOURCE
#include <errno.h>
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
static uint8_t rx_bufs[GEN_BATCH][GEN_MAX_DGRAM];

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

static void flush(int fd, struct gen_rank *g, unsigned r, uint16_t job, int emin, unsigned k,
                  int retx, const uint8_t *codes, struct ncd_gen_stats *st)
{
    struct mmsghdr msgs[GEN_BATCH];
    struct iovec iov[GEN_BATCH];
    for (unsigned i = 0; i < g->queued; i++) {
        const uint16_t s = g->queue[i];
        fill(tx_bufs[r][i], job, (uint16_t)r, emin, k, s, g->version[s], g->chunk[s], retx, codes);
        iov[i].iov_base = tx_bufs[r][i];
        iov[i].iov_len = 16 + k;
        memset(&msgs[i].msg_hdr, 0, sizeof msgs[i].msg_hdr);
        msgs[i].msg_hdr.msg_iov = &iov[i];
        msgs[i].msg_hdr.msg_iovlen = 1;
    }
    unsigned done = 0;
    while (done < g->queued) {
        int n = sendmmsg(fd, msgs + done, g->queued - done, 0);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            st->send_errors += g->queued - done; /* ENOBUFS and friends: the window recovers */
            break;
        }
        done += (unsigned)n;
    }
    st->sent += done;
    g->queued = 0;
}

int ncd_gen_run(const int *fds, unsigned nranks, uint16_t job, int emin, unsigned k,
                unsigned window, double seconds, double retx_after, const uint8_t *codes,
                struct ncd_gen_stats *st)
{
    if (nranks < 1 || nranks > GEN_MAX_RANKS || window < 1 || window > GEN_MAX_WINDOW ||
        k < 1 || k > NCE_MAX_K)
        return -1;
    memset(st, 0, sizeof *st);
    memset(ranks_state, 0, sizeof ranks_state);
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
        iov[i].iov_len = GEN_MAX_DGRAM;
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
            }
            int n = recvmmsg(fds[r], msgs, GEN_BATCH, MSG_DONTWAIT, NULL);
            if (n <= 0)
                continue;
            struct gen_rank *g = &ranks_state[r];
            for (int i = 0; i < n; i++) {
                const uint8_t *d = rx_bufs[i];
                if (msgs[i].msg_len < 16)
                    continue;
                st->received++;
                const uint16_t s = (uint16_t)(d[8] << 8 | d[9]);
                const unsigned v = (d[1] & 0x04) != 0;
                const uint32_t off = (uint32_t)d[12] << 24 | (uint32_t)d[13] << 16 |
                                     (uint32_t)d[14] << 8 | d[15];
                if (s >= window || v != g->version[s] || off != g->chunk[s] * k)
                    continue; /* a duplicate result (after a retransmission) */
                st->completed++;
                g->version[s] ^= 1;
                g->chunk[s] += window;
                g->queue[g->queued++] = s;
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
