/* ncina socket data plane: the kernel-UDP-socket I/O layer around the slot engine
 * (aggregator/engine), the API its Python driver sees besides the engine's (engine.h).
 *
 * Plain declarations only: aggregator/backends/socket/binding.py hands the lines of engine.h and of
 * this file that are not preprocessor directives to cffi as its cdef. One socket data plane per
 * process; its state is module-global in loop.c. Needs no root and no DPDK.
 */
#ifndef NCS_H
#define NCS_H

#include <stddef.h>
#include <stdint.h>

/* Counters of the I/O loop (not protocol counters). */
struct ncs_io {
    uint64_t rx_datagrams;  /* datagrams received (each datagram of a GRO buffer counts) */
    uint64_t rx_batches;    /* recvmmsg calls that returned datagrams */
    uint64_t tx_datagrams;  /* datagrams the kernel accepted (each segment of a GSO send) */
    uint64_t tx_batches;    /* sendmmsg flushes */
    uint64_t send_errors;   /* datagrams the kernel refused (counted, skipped) */
    uint64_t oversized;     /* replies larger than a send buffer (not sent, counted) */
    uint64_t wakeups;       /* waits for the socket or the stop event */
    uint64_t rx_buffers;    /* buffers recvmmsg filled (one datagram, or a GRO run of them) */
    uint64_t rx_coalesced;  /* buffers that held more than one datagram (UDP GRO) */
    uint64_t tx_gso_sends;  /* messages sent as one UDP_SEGMENT send of several datagrams */
    uint64_t gso_fallbacks; /* GSO sends the kernel refused, sent again one by one */
    uint64_t gro;           /* 1: UDP GRO is on (the kernel took UDP_GRO) */
    uint64_t gso;           /* 1: replies go out with UDP GSO (UDP_SEGMENT) */
};

/* The largest reply datagram a send buffer holds (the driver gives it to nce_set_reply_room). */
uint32_t ncs_dgram_room(void);
/* Open the UDP socket on ip (4 bytes, network order; 0.0.0.0: any, replies then come from the
 * address each worker sent to) and port (0: a free one), with UDP GRO and GSO where the kernel
 * has them (ncs_io's gro and gso say). Returns the bound port, or -1 with the reason in
 * nce_error(). */
int ncs_open(const uint8_t *ip, uint16_t port);
/* Serve on the calling thread until ncs_stop(): receive in batches (recvmmsg; with UDP GRO a
 * buffer holds a run of datagrams, split again here), hand every datagram to the engine, send
 * the replies in batches (sendmmsg; a run of equal-length replies to one destination as one
 * UDP_SEGMENT send), and sleep in poll() on the
 * socket and a stop eventfd when idle. mode 0 aggregates; mode 1 is the no-op forwarder (every
 * datagram goes back to its sender unchanged: the I/O limit of this path). 0, or -1 with
 * nce_error() (no socket, or the socket failed). */
int ncs_run(int mode);
/* Make ncs_run return (from any thread; prompt even when it sleeps). */
void ncs_stop(void);
/* The socket's descriptor (-1: none), for a leaf's job handshake with its spine before
 * ncs_run serves (the driver does it in Python on a duplicate). */
int ncs_fileno(void);
/* Close the socket and the stop event. */
void ncs_close(void);
void ncs_io_stats(struct ncs_io *io);

#endif
