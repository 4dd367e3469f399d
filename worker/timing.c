/* RTO estimator (timing.h); mirrors ncina.worker.timing.RtoEstimator operation for operation,
 * so both give the same doubles for the same samples. */
#include "timing.h"

#include <math.h>

#define NCW_ALPHA 0.125      /* SRTT gain (RFC 6298) */
#define NCW_BETA 0.25        /* RTTVAR gain */
#define NCW_GRANULARITY 0.001 /* G: the loop sleeps in whole milliseconds */
#define NCW_OUTLIER_STREAK 4 /* slow samples in a row taken as a slower path */

void ncw_rto_sample(struct ncw_rto *t, double rtt)
{
    if (t->samples && rtt > 2 * t->srtt) {
        t->streak++;
        if (t->streak < NCW_OUTLIER_STREAK) {
            t->outliers++;
            return;
        }
    }
    t->streak = 0;
    if (t->samples) {
        t->rttvar += NCW_BETA * (fabs(t->srtt - rtt) - t->rttvar);
        t->srtt += NCW_ALPHA * (rtt - t->srtt);
    } else {
        t->srtt = rtt;
        t->rttvar = rtt / 2;
    }
    t->samples++;
    const double var = 4 * t->rttvar;
    const double rto = t->srtt + (NCW_GRANULARITY > var ? NCW_GRANULARITY : var);
    const double floored = rto > t->floor ? rto : t->floor;
    t->rto = floored < t->cap ? floored : t->cap;
}

int ncw_rto_spurious(struct ncw_rto *t, double rtt, double since)
{
    if (since <= 2 * t->srtt + NCW_GRANULARITY)
        return 0;
    ncw_rto_sample(t, rtt);
    return 1;
}

double ncw_rto_backoff(const struct ncw_rto *t, double rto)
{
    const double doubled = 2.0 * rto;
    return doubled < t->cap ? doubled : t->cap;
}
