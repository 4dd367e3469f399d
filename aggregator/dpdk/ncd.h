/* ncina DPDK data plane: the API the Python driver sees.
 *
 * Plain declarations only: aggregator/dpdk/binding.py hands the lines of this file that are not
 * preprocessor directives to cffi as its cdef. One data plane per process (EAL can be started
 * once per process); all state is module-global in the C files.
 */
#ifndef NCD_H
#define NCD_H

#include <stddef.h>
#include <stdint.h>

/* Drop reasons, in the order of docs/protocol.md "Counters". */
enum ncd_drop {
    NCD_TRUNCATED = 0,
    NCD_BAD_VERSION = 1,
    NCD_BAD_FLAGS = 2,
    NCD_BAD_FORMAT = 3,
    NCD_WINDOW_MISMATCH = 4,
    NCD_UNKNOWN_JOB = 5,
    NCD_NON_MEMBER = 6,
    NCD_BAD_SLOT = 7,
    NCD_BAD_COUNT = 8,
    NCD_BAD_LENGTH = 9,
    NCD_BAD_CODE = 10,
    NCD_CHUNK_MISMATCH = 11,
    NCD_BAD_TAG = 12,
    NCD_STALE_GENERATION = 13,
    NCD_NDROPS = 14
};

/* Counters of one job, or of the aggregator-wide "global" section (packets no job claims);
 * names and meanings as in ncina.aggregator.stats. bytes count UDP payloads (ncina datagrams). */
struct ncd_counters {
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
    uint64_t key_underruns;     /* nc8 results keyed by the fallback (key ring empty) */
    uint64_t drops[14];
};

/* Port-level counters of the I/O loop (not protocol counters). */
struct ncd_io {
    uint64_t rx_frames;     /* frames taken from the RX ring */
    uint64_t ignored;       /* not ncina traffic: other ethertypes, other IP/UDP destinations */
    uint64_t arp_replies;   /* ARP requests for the aggregator's address answered */
    uint64_t tx_frames;     /* frames handed to the TX ring */
    uint64_t tx_dropped;    /* frames the TX ring refused (freed, counted) */
    uint64_t no_mbuf;       /* results not sent because the mbuf pool was empty */
    uint64_t oversize;      /* results not sent because the frame exceeds an mbuf (never, when
                               every job was admitted by ncd_job_add) */
    uint64_t loops;         /* RX polls */
};

/* ---- control plane (setup; not on the hot path) ---- */

/* Start EAL with argv (argv[0] is a program name) and bring up the first ethdev port with one
 * RX and one TX queue. Returns 0, or -1 with the reason in ncd_error(). */
int ncd_init(int argc, char **argv);
const char *ncd_error(void);
/* The port's MAC address (6 bytes). Offline (no EAL) it is the one given to ncd_set_mac. */
void ncd_get_mac(uint8_t *mac);
void ncd_set_mac(const uint8_t *mac);
/* The aggregator's IPv4 address (4 bytes, network order) and UDP port. Address 0.0.0.0 accepts
 * any destination address (results then come from the address the worker sent to). */
void ncd_set_address(const uint8_t *ip, uint16_t udp_port);
/* The bytes of the largest frame the data plane can send (an mbuf's data room). */
uint32_t ncd_frame_room(void);
/* Install a job. result_format 0 = nc8, 1 = int. Returns 0, or -1 with ncd_error(), also when
 * its result frames of k elements exceed ncd_frame_room(). */
int ncd_job_add(uint16_t job, uint16_t workers, uint16_t k, uint16_t slots, int e_min, int span,
                int result_format, uint64_t seed);
/* The aggregator's generation, 0..15 (docs/protocol.md "Generations and notices"): stamped on
 * every result and notice; 0 is an aggregator without generations (no notices). */
void ncd_set_generation(uint8_t generation);
/* The job's authentication key (16..64 bytes; docs/protocol.md "Authentication tag"). Returns 0,
 * or -1 with ncd_error(); a job whose tagged result frames would exceed ncd_frame_room() is
 * removed (it cannot serve keyed, and must not serve unkeyed). */
int ncd_job_set_key(uint16_t job, const uint8_t *key, uint32_t keylen);
/* Keyed BLAKE2b of msg with an outlen-byte digest (the tag's function; for tests). */
void ncd_blake2b(uint8_t *out, uint32_t outlen, const uint8_t *key, uint32_t keylen,
                 const uint8_t *msg, uint32_t len);
/* Configure a member's address (IPv4 network order, UDP port host order); its MAC is learned
 * from its first packet. Unconfigured members are learned from their first valid packet. */
/* The nc8 result keys: one per slot completion, in order, drawn by the control plane from the
 * same generator as the Python reference (numpy default_rng(seed)), through a ring of
 * size_pow2 keys. ncd_job_key_space says how many keys may be pushed now and the index of the
 * next one; ncd_job_key_push appends them. An empty ring falls back to a key derived from the
 * seed, the job and the completion index (counted as key_underruns). */
int ncd_job_key_ring(uint16_t job, uint32_t size_pow2);
uint32_t ncd_job_key_space(uint16_t job, uint64_t *next);
void ncd_job_key_push(uint16_t job, const uint64_t *keys, uint32_t n);
int ncd_member_set(uint16_t job, uint16_t rank, const uint8_t *ip, uint16_t port);
int ncd_job_stats(uint16_t job, struct ncd_counters *out);
/* Remove every job and zero every counter (tests; never while ncd_run is running). */
void ncd_reset(void);
void ncd_global_stats(struct ncd_counters *out, struct ncd_io *io);

/* ---- data plane ---- */

/* Run the burst loop on the calling thread until ncd_stop(). mode 0 aggregates; mode 1 is the
 * no-op forwarder (every frame goes back out with its MAC addresses swapped: the I/O limit).
 * idle_sleep_us > 0: after 256 empty polls, sleep that long between polls (frees the core of a
 * small emulation host; costs at most that much latency when traffic resumes). */
int ncd_run(int mode, unsigned idle_sleep_us);
void ncd_stop(void);
/* Stop and close the port and release EAL. */
void ncd_close(void);

/* Offline engine, for tests (no EAL needed): feed one Ethernet frame; the frames it sends are
 * written to out (max_out slots of stride bytes), their lengths to out_lens. Returns how many
 * frames were produced. */
int ncd_process_frame(const uint8_t *frame, uint32_t len, uint8_t *out, uint32_t stride,
                      uint32_t max_out, uint32_t *out_lens);

/* ---- benchmark load (gen.c; plain sockets, no DPDK) ---- */

struct ncd_gen_stats {
    uint64_t sent;              /* datagrams sent */
    uint64_t received;          /* datagrams received */
    uint64_t completed;         /* chunks whose result came back (per rank) */
    uint64_t send_errors;
    uint64_t retransmit_rounds; /* quiet spells that re-sent every outstanding chunk */
    double seconds;
};

/* nranks connected UDP sockets (fds) act as ranks 0..nranks-1 of job: each keeps window slots
 * outstanding with k codes per chunk (codes: k bytes), sends the next chunk into a slot when
 * its result (or, against the no-op forwarder, its echo) comes back, and re-sends everything
 * outstanding after retx_after seconds without progress. Runs for seconds. 0, or -1 for bad
 * parameters. */
int ncd_gen_run(const int *fds, unsigned nranks, uint16_t job, int emin, unsigned k,
                unsigned window, double seconds, double retx_after, const uint8_t *codes,
                struct ncd_gen_stats *st);

#endif
