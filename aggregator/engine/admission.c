/* Admission: the jobs (installed by the control plane), the engine's generation, and the
 * job-level checks a well-formed datagram passes before it reaches the slots, steps 8-15 of
 * docs/protocol.md "Order of checks" in that order, as
 * ncina.aggregator.backends.python.admission: flags, format, membership (asked of members.c),
 * window, slot and count bounds, generation, codes (or a spine's int partial sums,
 * nce_job_set_uplink). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "state.h"

#define FAIL(...)                                                   \
    do {                                                            \
        snprintf(nce_errbuf, sizeof nce_errbuf, __VA_ARGS__);       \
        return -1;                                                  \
    } while (0)

static uint32_t reply_room = UINT32_MAX;
static char reply_limit[128] = "no limit";

void nce_set_reply_room(uint32_t bytes, const char *limit)
{
    reply_room = bytes;
    snprintf(reply_limit, sizeof reply_limit, "%s", limit);
}

/* Whether a result datagram of k elements of the format (and a tag) fits the I/O layer's reply
 * room; if not, the reason, with the largest k that fits, goes to nce_errbuf. Results are the
 * largest datagrams the engine writes: a notice has none. */
/* Bytes per element of a result format, and its name; size 0 for one that is none. */
static uint32_t result_size(int result_format)
{
    return result_format == NCE_FMT_NC8     ? 1
           : result_format == NCE_FMT_INT   ? 8
           : result_format == NCE_FMT_INT32 ? 4
                                            : 0;
}

static const char *result_name(int result_format)
{
    return result_format == NCE_FMT_INT ? "int" : result_format == NCE_FMT_INT32 ? "int32" : "nc8";
}

/* Whether n workers' codes up to 2^span can be int32 results: their largest sum n * 2^span
 * stays within 2^NCE_INT32_SUM_BITS; if not, ncina.proto.nc8.int32_refusal's sentence goes to
 * nce_errbuf. Other formats: always (64-bit accumulators, checked where the job is added). */
static int int32_fits(uint16_t id, int result_format, unsigned n, unsigned span)
{
    if (result_format != NCE_FMT_INT32
        || (span <= NCE_INT32_SUM_BITS && (uint64_t)n << span <= (uint64_t)1 << NCE_INT32_SUM_BITS))
        return 1;
    snprintf(nce_errbuf, sizeof nce_errbuf,
             "job %u: int32 results: %u workers' codes up to 2^%u can sum to %u * 2^%u, beyond "
             "the 2^%d a signed 32-bit lane is kept within (span + ceil(log2 N) <= %d)",
             id, n, span, n, span, NCE_INT32_SUM_BITS, NCE_INT32_SUM_BITS);
    return 0;
}

static int fits_reply_room(uint16_t id, uint32_t k, int result_format, int tagged)
{
    const uint32_t size = result_size(result_format);
    const uint32_t around = NCE_HDR_LEN + (tagged ? NCE_TAG_LEN : 0);
    if (around + k * size <= reply_room)
        return 1;
    const char *name = result_name(result_format);
    snprintf(nce_errbuf, sizeof nce_errbuf,
             "job %u: a result datagram of k=%u %s elements is %u bytes, more than the %u bytes "
             "of %.80s; the largest k for %s results is %u",
             id, k, name, around + k * size, reply_room, reply_limit, name,
             reply_room > around ? (reply_room - around) / size : 0);
    return 0;
}

static void job_free(struct nce_job *job)
{
    nce_pool_free(job);
    nce_members_free(job);
    free(job);
}

/* Jobs added while a data plane runs wait here, invisible to it, until nce_job_publish: their
 * key and members are set first, so that no datagram meets a half-configured job. */
static struct nce_job *staged[65536];
static int live;
unsigned nce_strands = 1;
static uint16_t leaf_job;       /* + 1: the leaf job's id, 0 when there is none */

/* The job of an id for the control plane: published, or staged. */
static struct nce_job *ctl_job(uint16_t id)
{
    return nce_jobs[id] != NULL ? nce_jobs[id] : staged[id];
}

/* Forget a job that was never published, or that no data plane runs for. */
static void job_drop(uint16_t id)
{
    job_free(ctl_job(id));
    staged[id] = NULL;
    nce_jobs[id] = NULL;
}

void nce_set_live(int on)
{
    live = on;
}

int nce_set_strands(unsigned strands)
{
    if (strands < 1 || strands > NCE_MAX_STRANDS)
        FAIL("%u strands: an engine runs 1 to %d", strands, NCE_MAX_STRANDS);
    if (strands > 1 && leaf_job != 0 && ctl_job((uint16_t)(leaf_job - 1)) != NULL)
        FAIL("job %u is a leaf, which serves on one strand only, not %u", leaf_job - 1, strands);
    nce_strands = strands;
    return 0;
}

int nce_job_publish(uint16_t id)
{
    struct nce_job *job = staged[id];
    if (job == NULL)
        return nce_jobs[id] != NULL ? 0 : -1;
    staged[id] = NULL;
    __atomic_store_n(&nce_jobs[id], job, __ATOMIC_RELEASE);
    return 0;
}

int nce_job_remove(uint16_t id)
{
    struct nce_job *job = nce_jobs[id];
    if (job == NULL) {
        if (staged[id] == NULL)
            FAIL("job %u is not installed", id);
        job_drop(id);
        return 0;
    }
    /* Unpublish, then wait until every strand is outside the batch it may be in (its epoch is
     * odd inside one): every later batch reads the NULL (both sides fence, Dekker-style). A
     * strand handing a datagram to another passes the frame, never the job's pointer. */
    __atomic_store_n(&nce_jobs[id], NULL, __ATOMIC_SEQ_CST);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    const struct timespec nap = {0, 50000};
    for (unsigned strand = 0; strand < NCE_MAX_STRANDS; strand++) {
        const uint64_t epoch = __atomic_load_n(&nce_dp_epoch[strand].v, __ATOMIC_SEQ_CST);
        while ((epoch & 1) && __atomic_load_n(&nce_dp_epoch[strand].v, __ATOMIC_ACQUIRE) == epoch)
            nanosleep(&nap, NULL);
    }
    job_free(job);
    return 0;
}

uint32_t nce_max_k(void)
{
    return NCE_MAX_K;
}

int nce_job_add(uint16_t id, uint16_t workers, uint16_t k, uint16_t nslots, int e_min, int span,
                int result_format, uint64_t seed)
{
    if (ctl_job(id) != NULL)
        FAIL("job %u is already installed", id);
    if (workers < 1 || workers > NCE_MAX_WORKERS || k < 1 || k > NCE_MAX_K || nslots < 1 ||
        span < 0 || span > 62 || result_size(result_format) == 0)
        FAIL("job %u: bad parameters (workers %u of at most %d, k %u of at most %d, "
             "slots %u, span %d, result format %d)",
             id, workers, NCE_MAX_WORKERS, k, NCE_MAX_K, nslots, span, result_format);
    /* The sum of the workers' codes, at most workers * 2^span, must fit the accumulators. */
    if ((uint64_t)workers > (uint64_t)INT64_MAX >> span)
        FAIL("job %u: %u workers of values up to 2^%d overflow 64 bits", id, workers, span);
    if (!int32_fits(id, result_format, workers, (unsigned)span))
        return -1;
    if (!fits_reply_room(id, k, result_format, 0))
        return -1;
    /* Aligned for its per-strand counters (a multiple of the alignment, as aligned_alloc asks). */
    struct nce_job *job = aligned_alloc(_Alignof(struct nce_job), sizeof *job);
    if (job == NULL)
        FAIL("job %u: out of memory", id);
    memset(job, 0, sizeof *job);
    job->id = id;
    job->n = workers;
    job->k = k;
    job->nslots = nslots;
    job->e_min = (int8_t)e_min;
    job->span = (uint8_t)span;
    job->result_format = (uint8_t)result_format;
    job->elem_size = (uint8_t)result_size(result_format);
    job->seed = seed;
    job->uplink_format = NCE_FMT_NC8;
    job->total = workers;
    if (nce_members_alloc(job) != 0 || nce_pool_alloc(job) != 0) {
        job_free(job);
        FAIL("job %u: out of memory", id);
    }
    if (live)
        staged[id] = job;
    else
        __atomic_store_n(&nce_jobs[id], job, __ATOMIC_RELEASE);
    return 0;
}

int nce_job_set_uplink(uint16_t id, int uplink_format, uint16_t total)
{
    struct nce_job *job = ctl_job(id);
    if (job == NULL)
        FAIL("job %u is not installed", id);
    if (uplink_format != NCE_FMT_NC8 && uplink_format != NCE_FMT_INT)
        FAIL("job %u: an uplink is nc8 (0) or int (1), not %d", id, uplink_format);
    if (total < job->n)
        FAIL("job %u: %u total workers are fewer than its %u members", id, total, job->n);
    if (uplink_format == NCE_FMT_INT && total % job->n != 0)
        FAIL("job %u: a spine's %u total workers must be a multiple of its %u leaves", id, total,
             job->n);
    /* The sum of the n partial sums, at most total * 2^span, must fit the accumulators. */
    if ((uint64_t)total > (uint64_t)INT64_MAX >> job->span)
        FAIL("job %u: %u workers of values up to 2^%u overflow 64 bits", id, total, job->span);
    if (!int32_fits(id, job->result_format, total, job->span))
        return -1;
    job->uplink_format = (uint8_t)uplink_format;
    job->total = total;
    job->bound = uplink_format == NCE_FMT_INT ? (int64_t)(total / job->n) << job->span : 0;
    return 0;
}

int nce_job_set_upstream(uint16_t id, const uint8_t *ip, uint16_t port, uint16_t rank,
                         uint8_t generation, const uint8_t *hello, uint32_t hello_len)
{
    struct nce_job *job = ctl_job(id);
    if (job == NULL)
        FAIL("job %u is not installed", id);
    if (job->uplink_format != NCE_FMT_NC8)
        FAIL("job %u: a leaf's workers send nc8 codes: a spine cannot be a leaf", id);
    if (job->total % job->n != 0 || rank >= job->total / job->n)
        FAIL("job %u: upstream rank %u is not a leaf of a spine of %u workers, %u a leaf", id,
             rank, job->total, job->n);
    uint32_t ip_be;
    memcpy(&ip_be, ip, 4);
    if (nce_strands > 1)          /* its upstream state (upstream.c) is one strand's */
        FAIL("job %u: a leaf serves on one strand, not %u (--lcores 1)", id, nce_strands);
    if (nce_upstream_set(id, ip_be, port, rank, generation, hello, hello_len) != 0)
        FAIL("job %u: another job is the leaf, or the hello is not a job datagram", id);
    job->leaf = 1;
    leaf_job = (uint16_t)(id + 1);
    return 0;
}

void nce_set_generation(uint8_t generation)
{
    nce_generation = generation & (NCE_GEN_MASK >> NCE_GEN_SHIFT);
}

int nce_job_set_key(uint16_t id, const uint8_t *key, uint32_t keylen)
{
    struct nce_job *job = ctl_job(id);
    if (job == NULL || keylen < 16 || keylen > 64)
        FAIL("job %u: a key has 16 to 64 bytes, not %u", id, keylen);
    if (!fits_reply_room(id, job->k, job->result_format, 1)) {
        job_drop(id);
        return -1;
    }
    nce_tag_key(job, key, keylen);
    return 0;
}

int nce_member_set(uint16_t id, uint16_t rank, const uint8_t *ip, uint16_t port)
{
    struct nce_job *job = ctl_job(id);
    uint32_t ip_be;
    memcpy(&ip_be, ip, 4);
    if (job == NULL || nce_members_set(job, rank, ip_be, port) != 0)
        FAIL("job %u has no rank %u", id, rank);
    return 0;
}

void nce_reset(void)
{
    for (size_t id = 0; id < 65536; id++) {
        if (ctl_job((uint16_t)id) != NULL)
            job_drop((uint16_t)id);
    }
    memset(nce_global, 0, sizeof nce_global);
    nce_upstream_reset();
    leaf_job = 0;
}

/* Each strand's counters are written by that strand only; readers sum them word by word (64-bit
 * aligned loads are atomic on the targets we build for, so no value is torn). */
static void sum_counters(struct nce_counters *out, const struct nce_strand_counters *strands)
{
    uint64_t *dst = (uint64_t *)out;
    memset(out, 0, sizeof *out);
    for (unsigned strand = 0; strand < NCE_MAX_STRANDS; strand++) {
        const volatile uint64_t *src = (const volatile uint64_t *)&strands[strand].c;
        for (size_t i = 0; i < sizeof *out / sizeof(uint64_t); i++)
            dst[i] += src[i];
    }
}

int nce_job_stats(uint16_t id, struct nce_counters *out)
{
    const struct nce_job *job = ctl_job(id);
    if (job == NULL)
        return -1;
    sum_counters(out, job->c);
    return 0;
}

void nce_global_stats(struct nce_counters *out)
{
    sum_counters(out, nce_global);
}

/* Largest exponent code in the payload (sign bits masked). */
static inline unsigned max_code(const uint8_t *codes, unsigned n)
{
    uint8_t top = 0;
    for (unsigned i = 0; i < n; i++) {
        const uint8_t c = codes[i] & 0x7F;
        top = c > top ? c : top;
    }
    return top;
}

/* Whether an int payload's lanes (big-endian int64, n of them) are all within bound in
 * magnitude: a spine's partial sums of leaves of total / n workers. */
static inline int within(const uint8_t *lanes, unsigned n, int64_t bound)
{
    for (unsigned i = 0; i < n; i++) {
        const int64_t v = (int64_t)nce_get_be64(lanes + 8 * (size_t)i);
        if (v > bound || v < -bound)
            return 0;
    }
    return 1;
}

int nce_admit(const struct nce_job *job, const struct nce_pkt *p, const struct nce_from *from)
{
    if (p->flags & NCE_FLAG_RESULT)
        return NCE_BAD_FLAGS;
    if (p->format != job->uplink_format)       /* nc8 codes, or a spine's int partial sums */
        return NCE_BAD_FORMAT;
    if (p->rank >= job->n || !nce_member_accepts(job, p->rank, from))
        return NCE_NON_MEMBER;
    if (p->emin != job->e_min)
        return NCE_WINDOW_MISMATCH;
    if (p->slot >= job->nslots)
        return NCE_BAD_SLOT;
    if (p->count > job->k)
        return NCE_BAD_COUNT;
    /* After the header checks: a stale packet's notice names a slot of the pool. */
    /* A generation from a rank that said no hello to this start was learned from an earlier
     * start that drew the same one: stale too. */
    const unsigned stamp = p->flags & NCE_GEN_MASK;
    const uint64_t joined = __atomic_load_n(&job->joined, __ATOMIC_RELAXED);
    if (stamp && (stamp != (unsigned)nce_generation << NCE_GEN_SHIFT || !(joined >> p->rank & 1)))
        return nce_generation ? NCE_STALE_GENERATION : NCE_BAD_FLAGS;
    /* Parse checked payload_len against count and the format's element size (8 for int). */
    if (job->uplink_format == NCE_FMT_INT)
        return within(p->payload, p->count, job->bound) ? -1 : NCE_BAD_CODE;
    /* payload_len, not count: equal for NC8 (parse checked it), and never past a blob's end */
    if (max_code(p->payload, p->payload_len) > (unsigned)job->span + 1)
        return NCE_BAD_CODE;
    return -1;
}
