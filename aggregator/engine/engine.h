/* ncina slot engine: the protocol of docs/protocol.md on UDP datagrams, shared by the I/O
 * layers (aggregator/backends/socket: kernel UDP sockets; aggregator/backends/dpdk: Ethernet
 * frames on DPDK).
 *
 * This is the control-plane API every I/O layer's Python driver sees. Plain declarations only:
 * the bindings hand the lines of this file that are not preprocessor directives to cffi as part
 * of their cdef. One engine per process (one per extension module): all state is module-global.
 * The per-datagram API of the I/O layers is datapath.h.
 */
#ifndef NCE_ENGINE_H
#define NCE_ENGINE_H

#include <stddef.h>
#include <stdint.h>

/* Drop reasons, in the order of docs/protocol.md "Counters". */
enum nce_drop {
    NCE_TRUNCATED = 0,
    NCE_BAD_VERSION = 1,
    NCE_BAD_FLAGS = 2,
    NCE_BAD_FORMAT = 3,
    NCE_WINDOW_MISMATCH = 4,
    NCE_UNKNOWN_JOB = 5,
    NCE_NON_MEMBER = 6,
    NCE_BAD_SLOT = 7,
    NCE_BAD_COUNT = 8,
    NCE_BAD_LENGTH = 9,
    NCE_BAD_CODE = 10,
    NCE_CHUNK_MISMATCH = 11,
    NCE_BAD_TAG = 12,
    NCE_STALE_GENERATION = 13,
    NCE_LATE = 14,
    NCE_RESEND_LIMIT = 15,
    NCE_NDROPS = 16
};

/* Counters of one job, or of the engine-wide "global" section (datagrams no job claims); names
 * and meanings as in ncina.aggregator.stats. bytes count UDP payloads (ncina datagrams). */
struct nce_counters {
    uint64_t packets_in;
    uint64_t packets_out;
    uint64_t bytes_in;
    uint64_t bytes_out;
    uint64_t contributions;
    uint64_t slots_completed;
    uint64_t results_sent;
    uint64_t results_resent;
    uint64_t duplicates;
    uint64_t retx_seen;
    uint64_t notices_sent;
    uint64_t handshakes;        /* job datagrams answered with the job's descriptor */
    uint64_t drops[16];
};

/* The reason of the last failed call (a sentence). */
const char *nce_error(void);
/* The largest chunk size K a job may have (NC8 elements of a result at the largest MTU). */
uint32_t nce_max_k(void);
/* The largest reply datagram the I/O layer can send (bytes of UDP payload), and a description
 * of that limit for error messages (copied). Jobs whose result datagrams exceed it are refused
 * by nce_job_add, keyed jobs whose tagged results exceed it are removed by nce_job_set_key (a
 * job that cannot serve keyed must not serve unkeyed). Default: no limit beyond NCE_MAX_K. */
void nce_set_reply_room(uint32_t bytes, const char *limit);
/* Install a job. result_format 0 = nc8, 1 = int, 4 = int32; seed: of the nc8 results' rounding
 * bits (nc8_result_key). workers * 2^span must fit an int64 accumulator, and for int32 results
 * stay within 2^NCE_INT32_SUM_BITS (as nce_job_set_uplink checks for the total workers).
 * Returns 0, or -1 with nce_error(). */
int nce_job_add(uint16_t job, uint16_t workers, uint16_t k, uint16_t slots, int e_min, int span,
                int result_format, uint64_t seed);
/* What a job's members send (docs/protocol.md "Hierarchical aggregation"): uplink_format 0,
 * nc8 codes (workers: the default), or 1, int partial sums of leaf aggregators (a spine of
 * `workers` leaves); total_workers: the workers of the whole tree, a multiple of `workers` for
 * a spine. The job's window (nce_job_add's e_min and span) is the one of total_workers. Call
 * before nce_job_publish. Returns 0, or -1 with nce_error() (the job stays as it was). */
int nce_job_set_uplink(uint16_t job, int uplink_format, uint16_t total_workers);
/* Make a job a leaf of the spine at ip (4 bytes, network order):port (host order), where it is
 * member `rank` of the spine's job at the spine's `generation` (learned by the job handshake);
 * hello: the leaf's hello to the spine (a job datagram of at most 32 bytes), sent again when a
 * worker's hello restarts the job. One leaf job per engine; its members send nc8 codes. Returns
 * 0, or -1 with nce_error(). docs/protocol.md "Hierarchical aggregation". */
int nce_job_set_upstream(uint16_t job, const uint8_t *ip, uint16_t port, uint16_t rank,
                         uint8_t generation, const uint8_t *hello, uint32_t hello_len);
/* A leaf's counters of its traffic with the spine (the stats document's upstream section, as
 * ncina.aggregator.hierarchy.UpstreamStats; drops indexed by enum nce_drop). */
struct nce_upstream_counters {
    uint64_t packets_in;
    uint64_t bytes_in;
    uint64_t packets_out;
    uint64_t bytes_out;
    uint64_t sent;
    uint64_t resent;
    uint64_t results;
    uint64_t late;
    uint64_t notices;
    uint64_t handshakes;
    uint64_t hellos;
    uint64_t drops[16];
};
void nce_upstream_stats(struct nce_upstream_counters *out);
/* How many data-plane strands the I/O layer runs (1..NCE_MAX_STRANDS, 1 by default); set before
 * it starts. A leaf job (nce_job_set_upstream) serves on one strand only: refused with more, and
 * more refused while a leaf is installed. Returns 0, or -1 with nce_error(). */
int nce_set_strands(unsigned strands);
/* Jobs at run time. While live (a data plane runs) nce_job_add stages a job, invisible to the
 * data plane until nce_job_publish (after its key, members and key ring are set); otherwise it
 * is installed at once and nce_job_publish does nothing. nce_job_remove unpublishes a job,
 * waits until the data plane left the batch it may be in, and frees it. Both return 0, or -1
 * with nce_error(). Control-plane calls come from one thread. */
void nce_set_live(int on);
int nce_job_publish(uint16_t job);
int nce_job_remove(uint16_t job);
/* The engine's generation, 0..15 (docs/protocol.md "Generations and notices"): stamped on
 * every result and notice; 0 is an aggregator without generations (no notices). */
void nce_set_generation(uint8_t generation);
/* How long (ns) a job must have been quiet, no slot completed and no result sent again, before
 * an authentic hello starts it afresh (docs/protocol.md "A new set of workers"; the Python
 * reference's RESTART_IDLE, 10 s, by default; 0: whenever no round is partly filled). */
void nce_set_restart_idle(uint64_t ns);
/* How long (ns) after the last result sent again to a member for a slot version, once its
 * round's burst of NCE_RESEND_BURST is spent, rule 2 may send it again (the Python reference's
 * slots.RESEND_INTERVAL, 1 s, by default). */
void nce_set_resend_interval(uint64_t ns);
/* The job's authentication key (16..64 bytes; docs/protocol.md "Authentication tag"). Returns 0,
 * or -1 with nce_error(). */
int nce_job_set_key(uint16_t job, const uint8_t *key, uint32_t keylen);
/* Keyed BLAKE2b of msg with an outlen-byte digest (the tag's function; for tests): 0, or -1
 * (nothing written) unless 1 <= outlen <= 64 and keylen <= 64. */
int nce_blake2b(uint8_t *out, uint32_t outlen, const uint8_t *key, uint32_t keylen,
                 const uint8_t *msg, uint32_t len);
/* Configure a member's address (IPv4 network order, UDP port host order). Unconfigured members
 * are learned from their first valid datagram; a configured one only accepts its address. */
int nce_member_set(uint16_t job, uint16_t rank, const uint8_t *ip, uint16_t port);
/* Counters, every strand's summed, copied word by word (each strand writes its own; no value is
 * torn). */
int nce_job_stats(uint16_t job, struct nce_counters *out);
void nce_global_stats(struct nce_counters *out);
/* Remove every job and zero every counter (tests; never while a data plane runs). */
void nce_reset(void);

/* Offline, for tests and benchmarks (no I/O): one datagram from src_ip:src_port (IPv4 network
 * order, port host order) sent to dst_ip. The reply datagrams are written to out (max_out
 * buffers of stride bytes), their lengths to out_lens, their destinations to out_ips (network
 * order) and out_ports (host order). Returns how many replies, or -1 when they do not fit (the
 * engine's decision and counters stand; nothing is written past a buffer). */
int nce_process_datagram(const uint8_t *dgram, uint32_t len, const uint8_t *src_ip,
                         uint16_t src_port, const uint8_t *dst_ip, uint8_t *out, uint32_t stride,
                         uint32_t max_out, uint32_t *out_lens, uint32_t *out_ips,
                         uint16_t *out_ports);

#endif
