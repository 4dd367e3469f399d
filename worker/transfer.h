/* The worker's C data path: one all-reduce of a float32 tensor in INA mode, end to end.
 *
 * ncina.worker.transfer.Transfer is the reference and docs/protocol.md the wire format; this is
 * the same loop without the interpreter: chunk i of the tensor goes into slot i % S with the
 * pool version and offset of the slot's next use (u & 1, u * S + slot), NC8-encoded right
 * before it first goes out (element j of a call uses the random word of flat index j, so chunk
 * by chunk gives the bytes of the whole tensor at once), tagged when the job has a key, sent in
 * sendmmsg batches; results arrive in recvmmsg batches and are decoded (NC8 codes or int sums)
 * straight into the float32 output. A slot's result releases its next chunk when the congestion
 * window (window.h) has room; the timers re-send with RETX (a stall holds most copies back); the generation is learned from the first result and stamped on every packet;
 * notices are remembered per slot.
 *
 * Nothing is allocated after ncw_open. Plain declarations only: worker/cpath.py hands the lines
 * of timing.h and this file that are not preprocessor directives to cffi as its cdef.
 */
#ifndef NCW_TRANSFER_H
#define NCW_TRANSFER_H

#include <stddef.h>
#include <stdint.h>

#include "timing.h"
#include "window.h"

/* ncw_begin/ncw_run results; negative values are -errno of a failed system call. */
#define NCW_DONE 0      /* every chunk's result is in the output */
#define NCW_AGAIN 1     /* a signal, or 0.1 s passed: let Python run its handlers, call ncw_run */
#define NCW_TIMEOUT 2   /* no result for `deadline` seconds; the slots tell what is missing */
#define NCW_RESTARTED 3 /* a result or notice of generation `seen_generation` */

struct ncw_config {
    int fd;            /* a bound, non-blocking IPv4 UDP socket (the client's) */
    uint32_t addr;     /* the aggregator's IPv4 address, network byte order */
    uint16_t port;     /* its UDP port, host byte order */
    uint16_t job;
    uint16_t rank;
    uint16_t pool_size; /* S */
    uint16_t k;         /* elements per chunk */
    int e_min;          /* the job's window */
    int span;
    int result_format;  /* 0 NC8, 1 INT, 4 INT32 (ncina.proto.header.Format) */
    const uint8_t *key; /* the job's key, or NULL: no tag */
    uint32_t key_size;
    double deadline;    /* seconds without progress before NCW_TIMEOUT */
    int64_t *slot_uses; /* S: uses of each slot so far (the client's, shared) */
    int gso;            /* send runs of equal-length datagrams as one UDP_SEGMENT send */
    int gro;            /* take runs of datagrams in one buffer (UDP_GRO) during a call */
};

/* Cumulative counters, named as the Python client's stats. */
struct ncw_stats {
    uint64_t packets_sent;
    uint64_t packets_received;
    uint64_t bytes_sent;
    uint64_t bytes_received;
    uint64_t retransmissions;
    uint64_t bytes_retransmitted;
    uint64_t timeouts;
    uint64_t results_ignored;
    uint64_t notices;
    uint64_t bad_tag;
    uint64_t saturated;
    uint64_t send_refused; /* datagrams a local firewall rule refused (EPERM): lost */
    uint64_t held_back;    /* expired chunks a stall did not re-send */
};

/* Per slot: the outstanding chunk and what its result must look like, its timer, and the last
 * notice about it. */
struct ncw_slot {
    int64_t chunk;         /* outstanding chunk, -1: none */
    uint64_t following;    /* the slot's next chunk (its chunk + S once started) */
    double sent_at;        /* the last send (first or re-sent) */
    double first_sent;     /* the chunk's first send */
    double rto;
    uint32_t frame_len;    /* the datagram's length, tag included */
    uint32_t want_len;     /* the result's length */
    int64_t notice_offset; /* offset the last notice was about, -1: none */
    uint64_t notice_held;  /* its bitmap of the ranks whose contribution the aggregator holds */
    uint8_t want[16];      /* the result's header, byte for byte */
    uint8_t held;          /* a stall held its re-send back */
};

struct ncw {
    struct ncw_config cfg;
    struct ncw_rto timer;
    struct ncw_cwnd cwnd;   /* how many slots may be outstanding */
    struct ncw_stats stats;
    int generation;         /* the aggregator's, 0: not known yet */
    int seen_generation;    /* the other generation behind NCW_RESTARTED */
    int64_t bad_code_index; /* first flat index of a result code above 64 (NC8), -1: none */
    int bad_code;           /* that byte */
    uint64_t rx_buffers;    /* receive buffers that held datagrams (fewer than them with GRO) */
    /* The call in progress. */
    const float *x;
    float *out;
    float divisor;          /* each result is divided by it: 1 for a sum, N for a mean */
    void *keep;             /* NULL, or n NC8 result codes (uint8) or n float32 int sums: the
                               undivided results as they arrive (a restart's recovery serves
                               them); set before ncw_begin, like divisor */
    uint64_t n;
    uint64_t chunks;
    uint64_t done;
    uint64_t key;           /* the NC8 random stream's */
    double last_progress;
    double next_check;
    int clean;              /* slot 0's chunk was sent once (Karn) */
    int64_t top;            /* the highest chunk answered so far, -1: none */
    int probe;              /* a timer check re-sent chunks: take one in-order sample */
    struct ncw_slot *slots; /* S */
    uint32_t outstanding;   /* slots with a chunk outstanding */
    uint32_t held;          /* slots a stall held back */
    int waited;             /* a notice came while chunks were held: the stall was a wait */
    double stalled_at;      /* the last stall (a chunk sent before it waited in it) */
    void *io;               /* frames, receive buffers, message headers (transfer.c) */
};

/* Allocate the state of a client (everything the loop needs); NULL with errno set on failure
 * (EINVAL for a bad configuration). The configuration's pointers must outlive it. */
struct ncw *ncw_open(const struct ncw_config *cfg);
void ncw_close(struct ncw *w);

/* The first index of x[0..n) that is NaN or +-Inf, or n. */
uint64_t ncw_first_nonfinite(const float *x, uint64_t n);

/* Start the all-reduce of x[0..n) (n > 0, finite) into out[0..n) (divided by `divisor`, the
 * undivided results also into `keep` unless NULL), NC8 stream key `key`: send the first window. Then call ncw_run until it returns something else than NCW_AGAIN. */
int ncw_begin(struct ncw *w, const float *x, float *out, uint64_t n, uint64_t key);
int ncw_run(struct ncw *w);
/* Switch UDP GRO on the client's socket on or off (when the configuration asks for it: on for a
 * call, off after it, so that the Python side, which reads the socket between calls, never sees
 * a run of datagrams in one buffer); 0, or -errno. */
int ncw_gro(struct ncw *w, int on);

#endif
