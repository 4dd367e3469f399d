/* Congestion window (window.h); mirrors ncina.worker.window.CongestionWindow operation for
 * operation, so both give the same doubles for the same samples. */
#include "window.h"

#define NCW_TARGET 0.005 /* queueing delay aimed at (s) */
#define NCW_GAIN 1.0     /* slots per window of results at full off-target */

int64_t ncw_cwnd_limit(const struct ncw_cwnd *c)
{
    const int64_t n = (int64_t)c->cwnd;
    const int64_t at_least = n > 1 ? n : 1;
    return at_least < c->pool ? at_least : c->pool;
}

void ncw_cwnd_sample(struct ncw_cwnd *c, double rtt)
{
    if (!c->adaptive)
        return;
    if (rtt >= 0.0) {
        if (c->base == 0.0 || rtt < c->base)
            c->base = rtt;
        c->delay = rtt - c->base;
        if (c->saved > 0.0) { /* its first copy was answered: the stall lost nothing */
            c->cwnd = c->cwnd > c->saved ? c->cwnd : c->saved;
            c->saved = 0.0;
        }
    }
    c->since_cut++;
    if (c->slow_start && c->delay < NCW_TARGET) {
        c->cwnd += 1.0;
    } else {
        c->slow_start = 0;
        double off = (NCW_TARGET - c->delay) / NCW_TARGET;
        off = off < 1.0 ? off : 1.0;
        off = off > -1.0 ? off : -1.0;
        c->cwnd += NCW_GAIN * off / c->cwnd;
    }
    const double pool = (double)c->pool;
    const double floored = c->cwnd > 1.0 ? c->cwnd : 1.0;
    c->cwnd = pool < floored ? pool : floored;
}

void ncw_cwnd_loss(struct ncw_cwnd *c)
{
    if (!c->adaptive || c->delay < NCW_TARGET || (double)c->since_cut < c->cwnd)
        return;
    const double half = c->cwnd / 2.0;
    c->cwnd = half > 1.0 ? half : 1.0;
    c->slow_start = 0;
    c->since_cut = 0;
    c->cuts++;
}

int ncw_cwnd_stall(struct ncw_cwnd *c)
{
    if (!c->adaptive)
        return 0;
    if (c->saved == 0.0)
        c->saved = c->cwnd;
    c->cwnd = 1.0;
    c->slow_start = 1;
    c->delay = 0.0; /* no result for an RTO: whatever queue there was has drained */
    c->stalls++;
    return 1;
}
