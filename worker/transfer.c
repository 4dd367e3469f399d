/* The worker's C data path (transfer.h): one INA all-reduce, a tight burst loop.
 *
 * Per iteration: receive a burst (recvmmsg), take each datagram (tag, header compare, decode,
 * release the slot's next chunk), send the burst of chunks it released (sendmmsg); at a timer
 * check, re-send expired slots with RETX. A burst that emptied the socket is followed by a sleep
 * in poll() (until data or the next check) rather than by another read that would find nothing:
 * three system calls per result when they come one by one. The order of decisions is that of
 * ncina.worker.transfer.Transfer.run, so both paths put the same bytes on the wire for the same
 * seed (timing aside: a burst shares one clock reading). The RTO estimator is timing.c's. */
#define _GNU_SOURCE
#include "transfer.h"

#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/udp.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "blake2b.h"
#include "nc8.h"

#define NCW_BURST 32           /* datagrams per recvmmsg */
#define NCW_RX_SIZE 65536      /* room for any UDP datagram: the same checks as the Python path */
#define NCW_HEADER 16
#define NCW_TAG 8
#define NCW_NOTICE 8           /* a notice's payload: the 64-bit bitmap */
#define NCW_MAX_CODE 64        /* largest code of a re-compressed sum */
#define NCW_GAMMA 0x9E3779B97F4A7C15ULL
#define NCW_GSO_SEGMENTS 64    /* datagrams per UDP_SEGMENT send (UDP_MAX_SEGMENTS of 4.18) */
#define NCW_GSO_BYTES 65000    /* and their bytes, under the 64 KiB of one IP packet */
#define NCW_GSO_CTRL CMSG_SPACE(sizeof(uint16_t))
#define NCW_GRO_CTRL CMSG_SPACE(sizeof(int))
#define NCW_YIELD_S 0.1        /* ncw_run returns to Python at least this often (signals) */

#define FLAG_RESULT 0x01
#define FLAG_RETX 0x02
#define FLAG_POOL 0x04
#define GENERATION_SHIFT 3
#define GENERATION_MASK 0x78
#define FLAG_TAG 0x80

struct ncw_io {
    uint8_t *frames;            /* S frames of frame_stride bytes: each slot's datagram */
    size_t frame_stride;
    uint64_t *idle;             /* bit t: slot t is idle and its next chunk is one of the call's
                                   (fill() looks at these slots only: a result frees one) */
    uint8_t *rx;                /* NCW_BURST receive buffers of NCW_RX_SIZE bytes */
    struct mmsghdr rx_msgs[NCW_BURST];
    struct iovec rx_iov[NCW_BURST];
    struct sockaddr_in rx_from[NCW_BURST];  /* each buffer's sender */
    uint8_t rx_ctrl[NCW_BURST][NCW_GRO_CTRL] __attribute__((aligned(8))); /* UDP_GRO's size */
    int gro;                    /* UDP_GRO is on for this call */
    struct iovec *tx_iov;       /* the send burst, one entry a datagram: S + NCW_BURST */
    uint32_t tx_cap;
    uint32_t tx_count;
    struct mmsghdr *tx_msgs;    /* the burst as sendmmsg messages (tx_cap at most) */
    uint32_t *tx_segments;      /* datagrams in each message */
    uint8_t *tx_ctrl;           /* each message's UDP_SEGMENT control message */
    int gso;                    /* 1 until the kernel refuses a UDP_SEGMENT send */
    struct sockaddr_in peer;
    struct ncd_b2b keyed;       /* BLAKE2b state right after taking the key */
    float codes[256];           /* NC8 code -> float32 of the job's window */
    float table[256];           /* the same divided by the call's divisor (float32 division) */
    float int_scale;            /* 2^e_min: units of an INT result */
};

static inline double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static inline uint16_t rd16(const uint8_t *p)
{
    return (uint16_t)(p[0] << 8 | p[1]);
}

static inline uint32_t rd32(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static inline uint64_t rd64(const uint8_t *p)
{
    return (uint64_t)rd32(p) << 32 | rd32(p + 4);
}

/* Bytes per element of a result format (ncina.proto.header.ELEMENT_SIZE): NC8 1, INT 8,
 * INT32 4; 0 for any other (ncw_open refuses it). */
static inline size_t result_size(int result_format)
{
    return result_format == 0 ? 1 : result_format == 1 ? 8 : result_format == 4 ? 4 : 0;
}

static inline void wr16(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 8);
    p[1] = (uint8_t)v;
}

static inline void wr32(uint8_t *p, uint32_t v)
{
    wr16(p, v >> 16);
    wr16(p + 2, v);
}

/* Slot t's bit in io->idle: set while it is idle with a next chunk of the call to start. */
static inline void mark_idle(struct ncw *w, uint32_t t)
{
    struct ncw_io *io = w->io;
    if (w->slots[t].following < w->chunks) /* t < pool_size: the bitmap's words hold it */
        io->idle[t >> 6] |= (uint64_t)1 << (t & 63);
}

static inline uint8_t *frame_of(const struct ncw *w, uint32_t slot)
{
    const struct ncw_io *io = w->io;
    return io->frames + (size_t)slot * io->frame_stride;
}

static size_t tag_size(const struct ncw *w)
{
    return w->cfg.key_size ? NCW_TAG : 0;
}

static void compute_tag(const struct ncw *w, const uint8_t *data, size_t len, uint8_t *out)
{
    struct ncd_b2b s = ((const struct ncw_io *)w->io)->keyed;
    ncd_b2b_update(&s, data, len);
    ncd_b2b_final(&s, out);
}

/* Whether the datagram carries the TAG flag and a tag that verifies (constant-time compare);
 * a failure counts as bad_tag. */
static int authentic(struct ncw *w, const uint8_t *buf, size_t size)
{
    if (size >= NCW_TAG && size <= NCW_RX_SIZE && size >= 2 && (buf[1] & FLAG_TAG)) {
        uint8_t want[NCW_TAG];
        compute_tag(w, buf, size - NCW_TAG, want);
        uint8_t diff = 0;
        for (int i = 0; i < NCW_TAG; i++)
            diff |= want[i] ^ buf[size - NCW_TAG + i];
        if (!diff)
            return 1;
    }
    w->stats.bad_tag++;
    return 0;
}

/* --- sending ------------------------------------------------------------------------------ */

/* Make message m of the datagrams from `first` on: one datagram, or with GSO a run of datagrams
 * of one length (a shorter last one allowed, as UDP_SEGMENT requires) sent as one. Returns how
 * many datagrams it holds. */
static uint32_t group(struct ncw_io *io, uint32_t first, uint32_t m)
{
    const size_t seg = io->tx_iov[first].iov_len;
    size_t bytes = seg;
    uint32_t n = 1;
    while (io->gso && first + n < io->tx_count && n < NCW_GSO_SEGMENTS) {
        const size_t len = io->tx_iov[first + n].iov_len;
        if (len > seg || bytes + len > NCW_GSO_BYTES)
            break;
        bytes += len;
        n++;
        if (len < seg)
            break;
    }
    struct msghdr *h = &io->tx_msgs[m].msg_hdr;
    h->msg_name = &io->peer;
    h->msg_namelen = sizeof io->peer;
    h->msg_iov = &io->tx_iov[first];
    h->msg_iovlen = n;
    h->msg_control = NULL;
    h->msg_controllen = 0;
    if (n > 1) {
        h->msg_control = io->tx_ctrl + (size_t)m * NCW_GSO_CTRL;
        h->msg_controllen = NCW_GSO_CTRL;
        struct cmsghdr *c = CMSG_FIRSTHDR(h);
        c->cmsg_level = SOL_UDP;
        c->cmsg_type = UDP_SEGMENT;
        c->cmsg_len = CMSG_LEN(sizeof(uint16_t));
        const uint16_t size = (uint16_t)seg;
        memcpy(CMSG_DATA(c), &size, sizeof size);
    }
    io->tx_segments[m] = n;
    return n;
}

/* Send the queued burst (sendmmsg; runs of equal-length datagrams as one UDP_SEGMENT send each).
 * A full send buffer, or a local firewall rule that refuses a datagram (EPERM: counted as
 * send_refused; Mininet's lossy links drop so where the aggregator's kernel never sees the
 * frames), loses the datagrams as the network would (the slots' timers re-send them);
 * a kernel or device that refuses GSO turns it off for good and the rest goes out one by one;
 * any other error is returned as -errno. */
static int flush(struct ncw *w)
{
    struct ncw_io *io = w->io;
    uint32_t messages = 0;
    for (uint32_t j = 0; j < io->tx_count; messages++)
        j += group(io, j, messages);
    uint32_t at = 0, done = 0; /* messages and datagrams handled */
    while (at < messages) {
        const int sent = sendmmsg(w->cfg.fd, io->tx_msgs + at, messages - at, MSG_DONTWAIT);
        if (sent > 0) {
            for (uint32_t m = at; m < at + (uint32_t)sent; m++) {
                const struct msghdr *h = &io->tx_msgs[m].msg_hdr;
                for (size_t j = 0; j < h->msg_iovlen; j++)
                    w->stats.bytes_sent += h->msg_iov[j].iov_len;
                w->stats.packets_sent += io->tx_segments[m];
                done += io->tx_segments[m];
            }
            at += (uint32_t)sent;
        } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
            done += io->tx_segments[at++]; /* lost; try the rest */
        } else if (errno == EPERM) {
            w->stats.send_refused += io->tx_segments[at];
            done += io->tx_segments[at++];
        } else if (errno == EINTR) {
            continue;
        } else if (io->tx_segments[at] > 1 && (errno == EIO || errno == EINVAL
                                               || errno == ENOPROTOOPT || errno == EOPNOTSUPP)) {
            io->gso = 0; /* regroup what is left, one datagram a message */
            memmove(io->tx_iov, io->tx_iov + done, (io->tx_count - done) * sizeof *io->tx_iov);
            io->tx_count -= done;
            return flush(w);
        } else {
            io->tx_count = 0;
            return -errno;
        }
    }
    io->tx_count = 0;
    return 0;
}

/* Queue the slot's frame (tagged now: the tag covers the flags as they are, RETX and
 * generation included). */
static int send_slot(struct ncw *w, uint32_t slot, double now)
{
    struct ncw_io *io = w->io;
    struct ncw_slot *s = &w->slots[slot];
    uint8_t *frame = frame_of(w, slot);
    s->sent_at = now;
    if (w->cfg.key_size)
        compute_tag(w, frame, s->frame_len - NCW_TAG, frame + s->frame_len - NCW_TAG);
    if (io->tx_count == io->tx_cap) {
        const int rc = flush(w);
        if (rc)
            return rc;
    }
    io->tx_iov[io->tx_count].iov_base = frame;
    io->tx_iov[io->tx_count].iov_len = s->frame_len;
    io->tx_count++;
    return 0;
}

/* Make chunk i the outstanding chunk of slot: header, NC8 codes of its elements, the result it
 * waits for, its timeout; then queue it. */
static int start(struct ncw *w, uint64_t i, uint32_t slot, double now)
{
    const struct ncw_config *c = &w->cfg;
    struct ncw_slot *s = &w->slots[slot];
    uint8_t *frame = frame_of(w, slot);
    const uint64_t offset = i * c->k;
    const uint64_t left = w->n - offset;
    const uint32_t count = left < c->k ? (uint32_t)left : c->k;
    /* Use u of the slot: version u & 1, offset u * S + slot mod 2^32 (docs/protocol.md). */
    const uint64_t use = (uint64_t)c->slot_uses[slot];
    c->slot_uses[slot] = (int64_t)(use + 1);
    const int pool = (int)(use & 1);
    const uint8_t common = (uint8_t)((pool ? FLAG_POOL : 0) | w->generation << GENERATION_SHIFT
                                     | (c->key_size ? FLAG_TAG : 0));
    frame[0] = 1; /* version */
    frame[1] = common;
    frame[2] = 0; /* NC8 */
    frame[3] = (uint8_t)(int8_t)c->e_min;
    wr16(frame + 4, c->job);
    wr16(frame + 6, c->rank);
    wr16(frame + 8, slot);
    wr16(frame + 10, count);
    wr32(frame + 12, (uint32_t)(use * c->pool_size + slot));
    /* count <= k: the frame has room for it and the tag (ncw_open sized it). */
    nc8_encode(w->x + offset, frame + NCW_HEADER, count, w->key + offset * NCW_GAMMA, c->e_min,
               c->span, &w->stats.saturated);
    s->chunk = (int64_t)i;
    s->following = i + c->pool_size;
    ((struct ncw_io *)w->io)->idle[slot >> 6] &= ~((uint64_t)1 << (slot & 63));
    w->outstanding++;
    s->first_sent = now;
    s->frame_len = (uint32_t)(NCW_HEADER + count + tag_size(w));
    memcpy(s->want, frame, NCW_HEADER);
    s->want[1] = common | FLAG_RESULT;
    s->want[2] = (uint8_t)c->result_format;
    s->want_len = (uint32_t)(NCW_HEADER + (size_t)count * result_size(c->result_format)
                             + tag_size(w));
    if (slot)
        s->rto = w->timer.rto;
    else {
        if (w->clean) /* else keep the backed-off timeout until a sample comes back (Karn) */
            s->rto = w->timer.rto;
        w->clean = 1;
    }
    return send_slot(w, slot, now);
}

/* Start the next chunk of idle slots, the lowest first, while the window has room or the chunk
 * is lower than every outstanding one (Transfer.fill: so the workers' windows cannot wait on
 * each other). The idle slots with a next chunk are io->idle's bits (usually one: the slot a
 * result just freed); their next chunks are distinct (slot t's are t mod S), so the lowest is
 * the one Transfer.fill picks. The lowest outstanding chunk matters only with the window full,
 * and is then found by a pass over the slots. */
static int fill(struct ncw *w, double now)
{
    const struct ncw_io *io = w->io;
    const uint32_t S = w->cfg.pool_size;
    const uint32_t words = (S + 63) / 64;
    const int64_t limit = ncw_cwnd_limit(&w->cwnd);
    for (;;) {
        uint32_t slot = S; /* the idle slot with the lowest next chunk */
        for (uint32_t word = 0; word < words; word++) {
            for (uint64_t bits = io->idle[word]; bits; bits &= bits - 1) {
                const uint32_t t = word * 64 + (uint32_t)__builtin_ctzll(bits);
                if (slot == S || w->slots[t].following < w->slots[slot].following)
                    slot = t;
            }
        }
        if (slot == S)
            return 0;
        if ((int64_t)w->outstanding >= limit) {
            uint64_t lowest = w->chunks; /* the lowest outstanding chunk */
            for (uint32_t t = 0; t < S; t++) {
                const int64_t chunk = w->slots[t].chunk;
                if (chunk >= 0 && (uint64_t)chunk < lowest)
                    lowest = (uint64_t)chunk;
            }
            if (w->slots[slot].following > lowest)
                return 0;
        }
        const int rc = start(w, w->slots[slot].following, slot, now);
        if (rc)
            return rc;
    }
}

/* --- receiving ---------------------------------------------------------------------------- */

/* Write the result payload of chunk i into the output at its offset, divided by the call's
 * divisor (one float32 division each, as numpy's `sum / np.float32(N)`: the same bits), and the
 * undivided results into keep. */
static void deliver(struct ncw *w, uint64_t i, const uint8_t *payload)
{
    const struct ncw_io *io = w->io;
    const uint64_t offset = i * w->cfg.k;
    const uint64_t left = w->n - offset;
    const uint32_t count = left < w->cfg.k ? (uint32_t)left : w->cfg.k;
    if (offset >= w->n) /* cannot happen: chunk < chunks; the writes below stay inside out, keep */
        return;
    float *out = w->out + offset; /* offset + count <= n */
    if (w->cfg.result_format == 0) {
        uint8_t top = 0;
        for (uint32_t j = 0; j < count; j++) {
            const uint8_t b = payload[j];
            const uint8_t m = b & 0x7F;
            top = m > top ? m : top;
            out[j] = io->table[b];
        }
        if (w->keep) /* n codes */
            memcpy((uint8_t *)w->keep + offset, payload, count);
        if (top > NCW_MAX_CODE) { /* remember the first such code of the tensor */
            for (uint32_t j = 0; j < count; j++) {
                if ((payload[j] & 0x7F) > NCW_MAX_CODE) {
                    if (w->bad_code_index < 0 || (int64_t)(offset + j) < w->bad_code_index) {
                        w->bad_code_index = (int64_t)(offset + j);
                        w->bad_code = payload[j];
                    }
                    break;
                }
            }
        }
    } else {
        /* want_len made the payload count elements of the format: 8 (INT) or 4 (INT32) bytes */
        float *keep = w->keep ? (float *)w->keep + offset : NULL; /* n float32 sums */
        const int wide = w->cfg.result_format == 1;
        for (uint32_t j = 0; j < count; j++) {
            const int64_t lane = wide ? (int64_t)rd64(payload + 8 * (size_t)j)
                                      : (int64_t)(int32_t)rd32(payload + 4 * (size_t)j);
            const float sum = (float)lane * io->int_scale;
            out[j] = sum / w->divisor;
            if (keep)
                keep[j] = sum;
        }
    }
}

/* A datagram that is not the expected result of its slot (off the per-packet path; its tag,
 * if the job has a key, is verified): note a notice, detect another generation, adopt the first
 * result's generation. Returns 1 when it is the expected result after all, 0 to ignore it,
 * NCW_RESTARTED as -1. */
static int unexpected(struct ncw *w, const uint8_t *buf, size_t size, uint32_t slot)
{
    const struct ncw_config *c = &w->cfg;
    if (slot >= c->pool_size || w->slots[slot].chunk < 0) /* slot >= S also if size < 16 */
        return 0;
    struct ncw_slot *s = &w->slots[slot];
    const int flags = buf[1];
    if (!(flags & FLAG_RESULT) || rd16(buf + 4) != c->job || rd16(buf + 6) != c->rank)
        return 0;
    const int generation = (flags & GENERATION_MASK) >> GENERATION_SHIFT;
    if (w->generation && generation != w->generation) {
        w->seen_generation = generation;
        return -1;
    }
    if (rd16(buf + 10) == 0) {
        if (size == NCW_HEADER + NCW_NOTICE + tag_size(w)) {
            w->stats.notices++;
            w->waited = w->held != 0;
            s->notice_offset = rd32(buf + 12);
            s->notice_held = rd64(buf + NCW_HEADER);
        } else if (size == NCW_HEADER + tag_size(w) && memcmp(buf, s->want, 10) == 0 &&
                   memcmp(buf + 12, s->want + 12, NCW_HEADER - 12) == 0) {
            /* A restart notice of the generation learned (s->want holds it), about this very
             * chunk: a new start of the aggregator that drew the same generation, and this
             * rank has not said hello to it (Transfer._about_current). */
            w->seen_generation = generation;
            return -1;
        }
        return 0;
    }
    if (!generation)
        return 0;
    const uint8_t bits = (uint8_t)(generation << GENERATION_SHIFT);
    uint8_t header[NCW_HEADER];
    memcpy(header, buf, NCW_HEADER);
    header[1] ^= bits;
    if (size != s->want_len || memcmp(header, s->want, NCW_HEADER) != 0)
        return 0;
    w->generation = generation;
    for (uint32_t j = 0; j < c->pool_size; j++) {
        if (w->slots[j].chunk >= 0) {
            frame_of(w, j)[1] |= bits;
            w->slots[j].want[1] |= bits;
        }
    }
    return 1;
}

/* End a stall's hold at a result (Transfer.release): with no notice during the hold the held
 * chunks' first copies are taken as lost, and they expire now. */
static void release(struct ncw *w, double now)
{
    const int lost = !w->waited;
    for (uint32_t slot = 0; slot < w->cfg.pool_size; slot++) {
        struct ncw_slot *s = &w->slots[slot];
        if (!s->held)
            continue;
        s->held = 0;
        if (lost && s->chunk >= 0)
            s->sent_at = now - s->rto;
    }
    if (lost)
        w->next_check = now;
    w->held = 0;
    w->waited = 0;
}

/* Count a datagram of the aggregator's address that no call takes any more (it came in the burst
 * that ended the call): ignored, and bad_tag when the job has a key and its tag fails. */
static void ignore(struct ncw *w, const uint8_t *buf, size_t size)
{
    w->stats.packets_received++;
    w->stats.bytes_received += size;
    w->stats.results_ignored++;
    if (w->cfg.key_size)
        authentic(w, buf, size);
}

/* Take one received datagram (buf may be modified: an echoed RETX flag is cleared). */
static int take(struct ncw *w, uint8_t *buf, size_t size, double now)
{
    const uint32_t S = w->cfg.pool_size;
    w->stats.packets_received++;
    w->stats.bytes_received += size;
    uint32_t slot = size >= NCW_HEADER ? rd16(buf + 8) : S;
    if (w->cfg.key_size && !authentic(w, buf, size))
        slot = S; /* nothing in it is believed */
    else if (slot < S && (buf[1] & FLAG_RETX))
        buf[1] ^= FLAG_RETX; /* an echoed RETX flag does not make it foreign */
    struct ncw_slot *s = slot < S ? &w->slots[slot] : NULL;
    if (!s || s->chunk < 0 || size != s->want_len || memcmp(buf, s->want, NCW_HEADER) != 0) {
        const int verdict = unexpected(w, buf, size, slot);
        if (verdict < 0)
            return NCW_RESTARTED;
        if (!verdict) {
            w->stats.results_ignored++;
            return 0;
        }
    }
    /* The expected result: size == want_len, which ncw_open bounded by NCW_RX_SIZE. */
    const uint64_t i = (uint64_t)s->chunk;
    deliver(w, i, buf + NCW_HEADER);
    w->done++;
    w->last_progress = now;
    w->outstanding--;
    if (w->held)
        release(w, now);
    const int retx = frame_of(w, slot)[1] & FLAG_RETX;
    double rtt = retx ? -1.0 : now - s->first_sent; /* < 0: no RTT (Karn) */
    if (!retx && s->first_sent <= w->stalled_at) {
        ncw_cwnd_resume(&w->cwnd); /* it waited in the stall: no RTT */
        rtt = -1.0;
    }
    ncw_cwnd_sample(&w->cwnd, rtt);
    if (slot == 0 && w->clean)
        ncw_rto_sample(&w->timer, now - s->sent_at);
    if ((int64_t)i > w->top) { /* in order: no later chunk was answered before it */
        if (retx && w->probe /* re-sent: spuriously? */
            && ncw_rto_spurious(&w->timer, now - s->first_sent, now - s->sent_at))
            w->probe = 0;
        w->top = (int64_t)i;
    }
    s->chunk = -1;
    mark_idle(w, slot);
    return fill(w, now);
}

/* --- timers ------------------------------------------------------------------------------- */

/* Whether the aggregator's latest notice about the slot's outstanding chunk says it holds this
 * rank's contribution (Transfer.holds). */
static int holds(const struct ncw *w, const struct ncw_slot *s)
{
    return s->notice_offset == (int64_t)rd32(s->want + 12)
           && (s->notice_held >> (w->cfg.rank & 63) & 1) && w->cfg.rank < 64;
}

/* In a stall (no result for an RTO): the slot whose expired chunk is re-sent, the oldest of
 * those the aggregator is not known to hold, else the oldest; S when none expired. */
static uint32_t stall_probe(const struct ncw *w, double now)
{
    const uint32_t S = w->cfg.pool_size;
    uint32_t unknown = S, any = S;
    for (uint32_t slot = 0; slot < S; slot++) {
        const struct ncw_slot *s = &w->slots[slot];
        if (s->chunk < 0 || s->sent_at + s->rto > now)
            continue;
        if (any == S || s->chunk < w->slots[any].chunk)
            any = slot;
        if (!holds(w, s) && (unknown == S || s->chunk < w->slots[unknown].chunk))
            unknown = slot;
    }
    return unknown < S ? unknown : any;
}

/* Re-send expired slots with RETX; NCW_TIMEOUT past the deadline. Sets the next check: the
 * earliest expiry, and no later than one fresh chunk's RTO from now. No result for an RTO makes
 * it a stall (Transfer.check_timers): only chunks re-sent before, or else the oldest expired
 * one, are re-sent, the others held back (their timers restart, backed off). */
static int check_timers(struct ncw *w, double now)
{
    const uint32_t S = w->cfg.pool_size;
    if (now - w->last_progress >= w->cfg.deadline)
        return NCW_TIMEOUT;
    int stalled = now - w->last_progress >= w->timer.rto;
    uint32_t probe = S;
    if (stalled) {
        probe = stall_probe(w, now);
        if (probe == S || !ncw_cwnd_stall(&w->cwnd))
            stalled = 0;
        else
            w->stalled_at = now;
    }
    double next = now + w->timer.rto;
    uint64_t expired = 0, resent = 0, held = 0;
    for (uint32_t slot = 0; slot < S; slot++) {
        struct ncw_slot *s = &w->slots[slot];
        if (s->chunk < 0)
            continue;
        double due = s->sent_at + s->rto;
        if (due <= now) {
            uint8_t *frame = frame_of(w, slot);
            s->rto = ncw_rto_backoff(&w->timer, s->rto);
            if (slot == 0)
                w->clean = 0;
            expired++;
            if (stalled && slot != probe) {
                s->sent_at = now; /* held back: its timer restarts, nothing is sent */
                if (!s->held) {
                    s->held = 1;
                    w->held++;
                }
                held++;
            } else {
                frame[1] |= FLAG_RETX;
                const int rc = send_slot(w, slot, now);
                if (rc)
                    return rc;
                resent += s->frame_len;
            }
            due = now + s->rto;
        }
        next = due < next ? due : next;
    }
    if (expired) {
        if (expired > held)
            w->probe = 1;
        w->stats.retransmissions += expired - held;
        w->stats.bytes_retransmitted += resent;
        w->stats.held_back += held;
        w->stats.timeouts++;
    }
    w->next_check = next;
    return 0;
}

/* --- the loop ----------------------------------------------------------------------------- */

int ncw_begin(struct ncw *w, const float *x, float *out, uint64_t n, uint64_t key)
{
    const uint32_t S = w->cfg.pool_size;
    if (!(w->divisor > 0.0f) || w->divisor > 3.4e38f) /* NaN, 0, negative, infinite */
        return -EINVAL;
    w->x = x;
    w->out = out;
    w->n = n;
    w->chunks = (n + w->cfg.k - 1) / w->cfg.k;
    w->done = 0;
    w->key = key;
    w->clean = 0;
    w->top = -1;
    w->probe = 0;
    w->bad_code_index = -1;
    w->bad_code = 0;
    w->seen_generation = 0;
    struct ncw_io *io = w->io;
    for (int b = 0; b < 256; b++)
        io->table[b] = io->codes[b] / w->divisor;
    w->outstanding = 0;
    w->held = 0;
    w->waited = 0;
    w->stalled_at = -1.0;
    memset(io->idle, 0, (size_t)(S + 63) / 64 * sizeof *io->idle);
    for (uint32_t slot = 0; slot < S; slot++) {
        w->slots[slot].chunk = -1;
        w->slots[slot].following = slot;
        w->slots[slot].held = 0;
        w->slots[slot].rto = w->timer.rto;
        w->slots[slot].notice_offset = -1;
        w->slots[slot].notice_held = 0;
        mark_idle(w, slot);
    }
    const double now = now_s();
    const int rc = fill(w, now);
    if (rc)
        return rc;
    w->last_progress = now;
    w->next_check = now + w->timer.rto;
    return flush(w);
}

/* Whether received datagram j came from the aggregator's address and port: an unkeyed job's
 * results and notices are believed from there only (docs/reliability.md "Threat model"). */
static inline int from_peer(const struct ncw_io *io, int j)
{
    const struct sockaddr_in *from = &io->rx_from[j];
    return io->rx_msgs[j].msg_hdr.msg_namelen == sizeof *from && from->sin_family == AF_INET &&
           from->sin_addr.s_addr == io->peer.sin_addr.s_addr &&
           from->sin_port == io->peer.sin_port;
}

/* The size of the datagrams in receive buffer j of len bytes: the UDP_GRO control message's
 * segment size when the kernel put a run of datagrams into it (the last one maybe shorter), else
 * len (one datagram). */
static size_t segment_size(struct ncw_io *io, int j, size_t len)
{
    struct msghdr *h = &io->rx_msgs[j].msg_hdr;
    if (!io->gro || h->msg_control == NULL || len > NCW_RX_SIZE)
        return len ? len : 1;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(h); c != NULL; c = CMSG_NXTHDR(h, c)) {
        if (c->cmsg_level == SOL_UDP && c->cmsg_type == UDP_GRO
            && c->cmsg_len >= CMSG_LEN(sizeof(int))) {
            int size;
            memcpy(&size, CMSG_DATA(c), sizeof size);
            if (size > 0 && (size_t)size < len)
                return (size_t)size;
        }
    }
    return len ? len : 1;
}

int ncw_gro(struct ncw *w, int on)
{
    struct ncw_io *io = w->io;
    on = on && w->cfg.gro;
    if (on == io->gro)
        return 0;
    /* A kernel without UDP_GRO (before 5.0) refuses it: every buffer is one datagram then. */
    if (setsockopt(w->cfg.fd, SOL_UDP, UDP_GRO, &on, sizeof on) != 0)
        return on ? 0 : -errno;
    io->gro = on;
    return 0;
}

int ncw_run(struct ncw *w)
{
    struct ncw_io *io = w->io;
    int drained = 0; /* the last burst emptied the socket: wait in poll() before reading again */
    const double entered = now_s();
    while (w->done < w->chunks) {
        if (drained) {
            const double before = now_s();
            if (before < w->next_check) {
                struct pollfd pfd = {.fd = w->cfg.fd, .events = POLLIN};
                const int ms = (int)ceil((w->next_check - before) * 1000);
                if (poll(&pfd, 1, ms < 1 ? 1 : ms) < 0) {
                    if (errno == EINTR)
                        return NCW_AGAIN;
                    return -errno;
                }
            }
        }
        for (int j = 0; j < NCW_BURST; j++) { /* recvmmsg writes each length */
            io->rx_msgs[j].msg_hdr.msg_namelen = sizeof io->rx_from[j];
            io->rx_msgs[j].msg_hdr.msg_control = io->gro ? io->rx_ctrl[j] : NULL;
            io->rx_msgs[j].msg_hdr.msg_controllen = io->gro ? NCW_GRO_CTRL : 0;
        }
        const int got = recvmmsg(w->cfg.fd, io->rx_msgs, NCW_BURST, MSG_DONTWAIT | MSG_TRUNC,
                                 NULL);
        if (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
            return -errno;
        const double now = now_s();
        drained = got < NCW_BURST;
        int ended = 0; /* take() ended the call (a restart, an error): the rest is only counted */
        for (int j = 0; j < got; j++) {
            w->rx_buffers++;
            /* MSG_TRUNC: msg_len is the datagram's (or GRO run's) real length, even past the
             * buffer: a datagram past it is seen whole by its length and refused by take(). */
            const size_t len = io->rx_msgs[j].msg_len;
            const size_t seg = segment_size(io, j, len);
            uint8_t *buf = io->rx + (size_t)j * NCW_RX_SIZE;
            const int peer = from_peer(io, j);
            size_t off = 0;
            do {
                const size_t at = off, size = len - at < seg ? len - at : seg;
                off += seg;
                if (!peer) { /* not the aggregator's: nothing in it is believed */
                    w->stats.packets_received++;
                    w->stats.bytes_received += size;
                    w->stats.results_ignored++;
                    continue;
                }
                if (ended || w->done == w->chunks) {
                    /* Read with the call's end, after it: counted as ignored (and a forged one
                     * as bad_tag), as the next call would have counted it. */
                    ignore(w, buf + at, size);
                    continue;
                }
                /* A run fits its buffer (seg < len <= NCW_RX_SIZE); a lone datagram (seg ==
                 * len) may not, and take() refuses it by its size before reading past. */
                ended = take(w, buf + at, size, now);
            } while (off < len);
        }
        if (ended) {
            flush(w);
            return ended;
        }
        int rc = got > 0 ? flush(w) : 0;
        /* The timers wait until the socket is empty (results that already came must not be
         * re-sent for: a descheduled worker finds a backlog), at most an RTO more. */
        if (!rc && now >= w->next_check && (drained || now - w->next_check >= w->timer.rto)) {
            rc = check_timers(w, now);
            const int sent = flush(w);
            rc = rc ? rc : sent;
        }
        if (rc)
            return rc;
        if (now - entered >= NCW_YIELD_S && w->done < w->chunks)
            return NCW_AGAIN; /* Python runs the handlers of signals another thread took */
    }
    return NCW_DONE;
}

uint64_t ncw_first_nonfinite(const float *x, uint64_t n)
{
    enum { BLOCK = 1024 }; /* a branch-free pass per block (vectorised), a scan only on a hit */
    for (uint64_t start = 0; start < n; start += BLOCK) {
        const uint64_t end = n - start < BLOCK ? n : start + BLOCK;
        uint32_t bad = 0;
        for (uint64_t i = start; i < end; i++) {
            uint32_t u;
            memcpy(&u, &x[i], sizeof u);
            bad |= (u & 0x7F800000u) == 0x7F800000u;
        }
        if (bad) {
            for (uint64_t i = start; i < end; i++) {
                uint32_t u;
                memcpy(&u, &x[i], sizeof u);
                if ((u & 0x7F800000u) == 0x7F800000u)
                    return i;
            }
        }
    }
    return n;
}

/* --- setup -------------------------------------------------------------------------------- */

struct ncw *ncw_open(const struct ncw_config *cfg)
{
    if (cfg->pool_size == 0 || cfg->k == 0 || cfg->slot_uses == NULL
        || result_size(cfg->result_format) == 0 || cfg->key_size > 64
        || (cfg->key_size && cfg->key == NULL) || cfg->e_min < -126 || cfg->e_min > 63) {
        errno = EINVAL;
        return NULL;
    }
    const size_t S = cfg->pool_size;
    const size_t tag = cfg->key_size ? NCW_TAG : 0;
    /* The largest result must fit a receive buffer, or no result could ever be accepted. */
    if (NCW_HEADER + (size_t)cfg->k * result_size(cfg->result_format) + tag > NCW_RX_SIZE) {
        errno = EINVAL;
        return NULL;
    }
    struct ncw *w = calloc(1, sizeof *w);
    struct ncw_io *io = calloc(1, sizeof *io);
    if (!w || !io) {
        free(w);
        free(io);
        errno = ENOMEM;
        return NULL;
    }
    w->cfg = *cfg;
    w->io = io;
    w->divisor = 1.0f;
    io->frame_stride = (NCW_HEADER + cfg->k + tag + 63) & ~(size_t)63;
    io->tx_cap = (uint32_t)(S + NCW_BURST);
    w->slots = calloc(S, sizeof *w->slots);
    io->frames = calloc(S, io->frame_stride);
    io->idle = calloc((S + 63) / 64, sizeof *io->idle);
    io->rx = malloc((size_t)NCW_BURST * NCW_RX_SIZE);
    io->tx_msgs = calloc(io->tx_cap, sizeof *io->tx_msgs);
    io->tx_iov = calloc(io->tx_cap, sizeof *io->tx_iov);
    io->tx_segments = calloc(io->tx_cap, sizeof *io->tx_segments);
    io->tx_ctrl = calloc(io->tx_cap, NCW_GSO_CTRL);
    io->gso = cfg->gso != 0;
    if (!w->slots || !io->frames || !io->idle || !io->rx || !io->tx_msgs || !io->tx_iov || !io->tx_segments
        || !io->tx_ctrl) {
        ncw_close(w);
        errno = ENOMEM;
        return NULL;
    }
    for (size_t s = 0; s < S; s++)
        w->slots[s].chunk = -1;
    io->peer.sin_family = AF_INET;
    io->peer.sin_addr.s_addr = cfg->addr;
    io->peer.sin_port = htons(cfg->port);
    for (int j = 0; j < NCW_BURST; j++) {
        io->rx_iov[j].iov_base = io->rx + (size_t)j * NCW_RX_SIZE;
        io->rx_iov[j].iov_len = NCW_RX_SIZE;
        io->rx_msgs[j].msg_hdr.msg_iov = &io->rx_iov[j];
        io->rx_msgs[j].msg_hdr.msg_iovlen = 1;
        io->rx_msgs[j].msg_hdr.msg_name = &io->rx_from[j];
    }
    if (cfg->key_size)
        ncd_b2b_init(&io->keyed, NCW_TAG, cfg->key, cfg->key_size);
    uint8_t all[256];
    for (int b = 0; b < 256; b++)
        all[b] = (uint8_t)b;
    nc8_decode(all, io->codes, 256, cfg->e_min);
    const uint32_t scale = (uint32_t)(cfg->e_min + 127) << 23; /* 2^e_min, a float32 normal */
    memcpy(&io->int_scale, &scale, sizeof scale);
    return w;
}

void ncw_close(struct ncw *w)
{
    if (!w)
        return;
    struct ncw_io *io = w->io;
    if (io) {
        free(io->frames);
        free(io->idle);
        free(io->rx);
        free(io->tx_msgs);
        free(io->tx_iov);
        free(io->tx_segments);
        free(io->tx_ctrl);
        free(io);
    }
    free(w->slots);
    free(w);
}
