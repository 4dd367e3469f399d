/* ncina DPDK data plane: the DPDK I/O layer around the slot engine (aggregator/engine), the API
 * its Python driver sees besides the engine's (engine.h).
 *
 * Plain declarations only: aggregator/backends/dpdk/binding.py hands the lines of engine.h and of
 * this file that are not preprocessor directives to cffi as its cdef. One data plane per process
 * (EAL can be started once per process); all state is module-global in the C files (per strand
 * where several strands write it).
 */
#ifndef NCD_H
#define NCD_H

#include <stddef.h>
#include <stdint.h>

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
    uint64_t bad_checksum;  /* IPv4 header or UDP checksum wrong: dropped, as by a host's stack */
    uint64_t fragments;     /* IPv4 fragments to us, taken into reassembly */
    uint64_t reassembled;   /* IPv4 packets reassembled from them */
    /* A leaf's link to its spine (ncd_set_spine; docs/dpdk.md "A leaf"): */
    uint64_t uplink_frames; /* datagrams to the spine sent (partial sums, hellos) */
    uint64_t uplink_no_mac; /* datagrams to the spine dropped: its MAC was not known yet (the
                               workers' retransmissions make the leaf send them again) */
    uint64_t arp_requests;  /* ARP requests sent for the spine's address (at most one per
                               ARP interval while its MAC is unknown) */
    uint64_t spine_mac_learned; /* times the spine's MAC was learned or changed (from an ARP
                               reply or request to the leaf's address only) */
    /* Several strands (ncd_set_strands; docs/dpdk.md "Several lcores"): */
    uint64_t handoffs;      /* frames handed to the strand that owns them */
    uint64_t handoff_full;  /* frames dropped because that strand's inbox was full */
    uint64_t handed_in;     /* frames other strands handed to this one */
    uint64_t parks;         /* job datagrams strand 0 handled with the other strands parked */
};

/* ---- control plane (setup; not on the hot path); jobs and counters are engine.h's ---- */

/* The data-plane strands (1..8, default 1; before ncd_init): the port gets as many RX/TX queue
 * pairs, strand i runs on the i-th lcore of EAL's --lcores (strand 0 on ncd_run's thread) and owns
 * the slots s with s % strands == i. Returns 0, or -1 with nce_error(). */
int ncd_set_strands(unsigned strands);
unsigned ncd_strands(void);
/* Start EAL with argv (argv[0] is a program name) and bring up the first ethdev port with one
 * RX/TX queue pair per strand. Returns 0, or -1 with the reason in nce_error(). */
int ncd_init(int argc, char **argv);
/* The port's MAC address (6 bytes). Offline (no EAL) it is the one given to ncd_set_mac. */
void ncd_get_mac(uint8_t *mac);
void ncd_set_mac(const uint8_t *mac);
/* The aggregator's IPv4 address (4 bytes, network order) and UDP port. Address 0.0.0.0 accepts
 * any destination address (results then come from the address the worker sent to). */
void ncd_set_address(const uint8_t *ip, uint16_t udp_port);
/* Make the data plane a leaf's: datagrams to the spine (ncd_spine_send, and the engine's
 * uplinks while ncd_run serves) go to ip (4 bytes, network order; on the port's link) and udp_port,
 * from the aggregator's address (ncd_set_address, not 0.0.0.0), to the MAC the data plane
 * learns by ARP (the spine must be on the port's link). 0.0.0.0: no spine. Forgets a
 * learned MAC. */
void ncd_set_spine(const uint8_t *ip, uint16_t udp_port);
/* The spine's MAC (6 bytes) into mac: 1, or 0 while it is not known. */
int ncd_spine_mac(uint8_t *mac);
/* Microseconds between two ARP requests for the spine while its MAC is unknown (default
 * 100000; 0: one for every datagram to the spine). */
void ncd_set_arp_interval(uint32_t us);
/* The port-level counters of the I/O loop, summed over the strands, or one strand's (-1: no such
 * strand). */
void ncd_io_stats(struct ncd_io *io);
int ncd_strand_io_stats(unsigned strand, struct ncd_io *io);
/* Zero the port-level counters (tests; with nce_reset). */
void ncd_io_reset(void);
/* The bytes of the largest frame the data plane can send (an mbuf's data room); jobs whose
 * result frames are larger are refused (the driver gives the engine this room, less the
 * Ethernet, IPv4 and UDP headers, with nce_set_reply_room). */
uint32_t ncd_frame_room(void);
/* ncd_frame_room() less the Ethernet, IPv4 and UDP headers: the room of a datagram. */
uint32_t ncd_dgram_room(void);

/* ---- data plane ---- */

/* Run the burst loop until ncd_stop(): strand 0 on the calling thread, strands 1.. on their lcores
 * (joined before it returns). mode 0 aggregates; mode 1 is the
 * no-op forwarder (every frame goes back out with its MAC addresses swapped: the I/O limit).
 * idle_sleep_us > 0: after 256 empty polls, sleep that long between polls (frees the core of a
 * small emulation host; costs at most that much latency when traffic resumes). */
int ncd_run(int mode, unsigned idle_sleep_us);
/* Before ncd_run, on the thread that ran ncd_init (a leaf's job handshake): send one datagram
 * to the spine: 1, or 0 when its MAC is not known yet (then an ARP request goes, if due; the
 * datagram is counted in uplink_no_mac), or -1 (not a leaf, or no mbuf, or too large). */
int ncd_spine_send(const uint8_t *dgram, uint32_t len);
/* Before ncd_run: poll the port for up to wait_us microseconds (answering ARP for our address
 * and learning the spine's) until an IPv4/UDP datagram to our address and port arrives; copies
 * it into buf (cap bytes) and its source into src_ip (network order) and src_port (host order).
 * Returns its length, 0 when none came, or -1 when it is larger than cap (dropped). */
int ncd_spine_receive(uint8_t *buf, uint32_t cap, uint32_t *src_ip, uint16_t *src_port,
                      unsigned wait_us);
void ncd_stop(void);
/* Stop and close the port and release EAL. */
void ncd_close(void);

/* Whether strand 0 may hand the engine a reassembled datagram that stays in its own buffer
 * (larger than an mbuf, so it cannot go to another strand): only when strand 0 owns it among
 * `strands` (nce_strand_of), so that no slot is touched by two strands; otherwise it is dropped and
 * counted as ignored. */
int ncd_whole_on_strand0(const uint8_t *dgram, uint32_t len, unsigned strands);

/* Offline engine, for tests (no EAL needed): feed one Ethernet frame; the frames it sends are
 * written to out (max_out slots of stride bytes), their lengths to out_lens: the replies, then
 * a leaf's frame to its spine (or the ARP request for the spine's MAC sent instead). Returns
 * how many frames were produced, or -1 when they do not fit. */
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

/* ncd_gen_run batched as the workers' C transfer batches (worker/transfer.c): with gso each
 * flush sends its chunks as UDP_SEGMENT runs (up to 64 datagrams in 65,000 bytes; a kernel
 * that refuses one turns it off), with gro the sockets take UDP GRO buffers and split them into
 * their datagrams (a kernel without UDP_GRO: one datagram a buffer). The fabric's echo
 * (ncina.harness.echo) runs it, so that its runs cross the links as a job's do. */
int ncd_gen_run_batched(const int *fds, unsigned nranks, uint16_t job, int emin, unsigned k,
                        unsigned window, double seconds, double retx_after,
                        const uint8_t *codes, int gso, int gro, struct ncd_gen_stats *st);

#endif
