/* Retransmission timeout of the worker's C data path: ncina.worker.timing.RtoEstimator in C.
 *
 * RFC 6298 gains, clamped to [floor, cap]; a sample above twice SRTT is skipped as an outlier
 * unless it is the OUTLIER_STREAK-th such sample in a row; a timed-out chunk's own timeout
 * doubles up to the cap. The Python class is the reference (its docstrings say why); the
 * transfer copies its state in before a call and back after, so both paths share one estimator.
 * Plain declarations only: worker/cpath.py hands the lines that are not preprocessor directives
 * to cffi as its cdef.
 */
#ifndef NCW_TIMING_H
#define NCW_TIMING_H

#include <stdint.h>

struct ncw_rto {
    double initial; /* the timeout until the first sample */
    double cap;
    double floor;
    double rto;     /* the timeout a fresh chunk gets */
    double srtt;
    double rttvar;
    int64_t samples;
    int64_t outliers;
    int64_t streak; /* slow samples skipped in a row */
};

/* Take one RTT measurement (seconds) of a chunk sent once, and recompute rto. */
void ncw_rto_sample(struct ncw_rto *t, double rtt);

/* A re-sent chunk answered in order, rtt after its first send and since after its last re-send:
 * taken as a sample when since > 2 SRTT + G (RtoEstimator.spurious says why); 1 if taken. */
int ncw_rto_spurious(struct ncw_rto *t, double rtt, double since);

/* The timeout after one more retransmission of a chunk whose timeout was rto. */
double ncw_rto_backoff(const struct ncw_rto *t, double rto);

#endif
