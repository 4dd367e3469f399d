/* The congestion window of the worker's C data path: ncina.worker.window.CongestionWindow in C.
 *
 * How many slots may have a chunk outstanding: a delay-based window (per round, Swift's
 * decrease or an additive increase from the standing queueing delay above the smallest RTT; a
 * slow start; one slot after a stall, with the
 * window before put back when a first copy is answered).
 * The Python class is the reference (its docstrings say why); the transfer copies its state in
 * before a call and back after, so both paths share one window per client.
 * Plain declarations only: worker/cpath.py hands the lines that are not preprocessor directives
 * to cffi as its cdef.
 */
#ifndef NCW_WINDOW_H
#define NCW_WINDOW_H

#include <stdint.h>

struct ncw_cwnd {
    int64_t pool;       /* the most slots in flight (S) */
    int64_t adaptive;   /* 0: fixed at the pool, none of the rules */
    double cwnd;        /* slots in flight allowed, before rounding down */
    double base;        /* smallest RTT seen (s), 0: none yet */
    double delay;       /* the last round's standing queueing delay (s) */
    double round_min;   /* smallest RTT of the round so far, 0: none yet */
    int64_t round_results; /* results of the round so far */
    int64_t round_size; /* results that end it: the window when it began */
    int64_t slow_start;
    double saved;       /* cwnd before a stall, 0: no stall pending */
    int64_t saved_slow_start; /* and whether it was in slow start */
    int64_t stalls;     /* timer checks that found no result for an RTO */
};

/* Slots that may have a chunk outstanding (1..pool). */
int64_t ncw_cwnd_limit(const struct ncw_cwnd *c);

/* A result came back: of a chunk sent once rtt seconds before, or (rtt < 0: no measurement) of
 * a re-sent one or one sent before a stall. */
void ncw_cwnd_sample(struct ncw_cwnd *c, double rtt);

/* A chunk sent once before a stall was answered: the window before the stall comes back. */
void ncw_cwnd_resume(struct ncw_cwnd *c);

/* A timer check found no result for an RTO; 1: hold back the chunks not re-sent yet. */
int ncw_cwnd_stall(struct ncw_cwnd *c);

#endif
