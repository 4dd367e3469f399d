/* Congestion window (window.h); mirrors ncina.worker.window.CongestionWindow operation for
 * operation, so both give the same doubles for the same samples. */
#include "window.h"

#define NCW_TARGET 0.005      /* standing queueing delay aimed at (s) */
#define NCW_BETA 0.8          /* share of the excess delay a decrease takes off */
#define NCW_MAX_DECREASE 0.5  /* the most one round takes off */
#define NCW_GAIN 1.0          /* slots added per round below the target */

int64_t ncw_cwnd_limit(const struct ncw_cwnd *c)
{
    const int64_t n = (int64_t)c->cwnd;
    const int64_t at_least = n > 1 ? n : 1;
    return at_least < c->pool ? at_least : c->pool;
}

/* A window of results is in: measure the standing delay, move the window. */
static void end_round(struct ncw_cwnd *c)
{
    if (c->round_min > 0.0)
        c->delay = c->round_min - c->base;
    if (c->delay >= NCW_TARGET) {
        c->slow_start = 0;
        const double excess = NCW_BETA * (c->delay - NCW_TARGET) / c->delay;
        const double keep = 1.0 - (excess < NCW_MAX_DECREASE ? excess : NCW_MAX_DECREASE);
        const double cut = c->cwnd * keep;
        c->cwnd = cut > 1.0 ? cut : 1.0;
    } else if (!c->slow_start) {
        const double grown = c->cwnd + NCW_GAIN;
        const double pool = (double)c->pool;
        c->cwnd = pool < grown ? pool : grown;
    }
    c->round_min = 0.0;
    c->round_results = 0;
    c->round_size = ncw_cwnd_limit(c);
}

void ncw_cwnd_sample(struct ncw_cwnd *c, double rtt)
{
    if (!c->adaptive)
        return;
    if (rtt >= 0.0) {
        if (c->base == 0.0 || rtt < c->base)
            c->base = rtt;
        if (c->round_min == 0.0 || rtt < c->round_min)
            c->round_min = rtt;
    }
    c->round_results++;
    if (c->slow_start)
        c->cwnd += 1.0;
    const double pool = (double)c->pool;
    const double floored = c->cwnd > 1.0 ? c->cwnd : 1.0;
    c->cwnd = pool < floored ? pool : floored;
    if (c->round_results >= c->round_size)
        end_round(c);
}

void ncw_cwnd_resume(struct ncw_cwnd *c)
{
    if (!c->adaptive || c->saved == 0.0)
        return;
    c->cwnd = c->cwnd > c->saved ? c->cwnd : c->saved;
    c->slow_start = c->saved_slow_start;
    c->saved = 0.0;
    c->round_min = 0.0;
    c->round_results = 0;
    c->round_size = ncw_cwnd_limit(c);
}

int ncw_cwnd_stall(struct ncw_cwnd *c)
{
    if (!c->adaptive)
        return 0;
    if (c->saved == 0.0) {
        c->saved = c->cwnd;
        c->saved_slow_start = c->slow_start;
    }
    c->cwnd = 1.0;
    c->slow_start = 1;
    c->delay = 0.0; /* no result for an RTO: whatever queue there was has drained */
    c->round_min = 0.0;
    c->round_results = 0;
    c->round_size = 1;
    c->stalls++;
    return 1;
}
