/* The socket I/O layer (after DPDK's l2fwd, with the kernel as the port): receive a batch of
 * buffers with recvmmsg, split each into its datagrams (with UDP GRO a buffer holds a run of
 * datagrams of one segment size, the last maybe shorter), decide each datagram with the slot
 * engine, write its replies into the send buffers (a completed slot's result once per member:
 * the emulated multicast), and hand them to the kernel with sendmmsg when the batch is done or
 * the buffers are full, runs of equal-length replies to one destination as one UDP_SEGMENT (GSO)
 * send. Idle, the loop sleeps in poll() on the socket and an eventfd that ncs_stop() signals. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/udp.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "datapath.h"
#include "ncs.h"

#define BATCH 64                /* buffers per recvmmsg */
#define RX_BYTES 65536          /* any UDP datagram (oversized ones are seen and counted), or a
                                 * GRO buffer (at most one IP packet's 64 KiB) */
#define TX_SLOTS 512            /* replies buffered before a sendmmsg */
#define TX_BYTES 9216           /* the largest MTU's datagram, and more */
#define SOCKET_BUFFER_BYTES (4 << 20)   /* asked for SO_RCVBUF/SO_SNDBUF, as the Python backend */
#define PKTINFO_SPACE CMSG_SPACE(sizeof(struct in_pktinfo))
#define RX_CTRL (PKTINFO_SPACE + CMSG_SPACE(sizeof(int)))       /* IP_PKTINFO, UDP_GRO */
#define TX_CTRL (PKTINFO_SPACE + CMSG_SPACE(sizeof(uint16_t)))  /* IP_PKTINFO, UDP_SEGMENT */
#define GSO_SEGMENTS 64         /* datagrams per UDP_SEGMENT send (UDP_MAX_SEGMENTS of 4.18) */
#define GSO_BYTES 65000         /* and their bytes, under the 64 KiB of one IP packet */
#define GSO_OPEN 64             /* destinations with a run open while a batch is grouped */

static int sock = -1, stop_fd = -1;
static uint32_t bound_ip;       /* network order; 0: any (replies carry IP_PKTINFO) */
static volatile int stopping;
static struct ncs_io io;
static int gro, gso;            /* the kernel coalesces what we receive / segments what we send */

static uint8_t rx_bufs[BATCH][RX_BYTES];
static struct sockaddr_in rx_names[BATCH];
static uint8_t rx_ctrl[BATCH][RX_CTRL] __attribute__((aligned(8)));
static struct iovec rx_iov[BATCH];
static struct mmsghdr rx_msgs[BATCH];

/* Replies as queued (buffer, destination, source address, length); flush() groups them into
 * messages: message m sends tx_iov[tx_first[m]] and the tx_segments[m] - 1 after it, to the
 * destination of reply tx_head[m]. */
static uint8_t tx_bufs[TX_SLOTS][TX_BYTES];
static struct sockaddr_in tx_names[TX_SLOTS];
static uint32_t tx_src[TX_SLOTS];
static uint32_t tx_lens[TX_SLOTS];
static uint16_t tx_group[TX_SLOTS];     /* the message each queued reply joins */
static unsigned tx_count;

static unsigned tx_head[TX_SLOTS], tx_first[TX_SLOTS], tx_segments[TX_SLOTS], tx_fill[TX_SLOTS];
static uint8_t tx_ctrl[TX_SLOTS][TX_CTRL] __attribute__((aligned(8)));
static struct iovec tx_iov[TX_SLOTS];
static struct mmsghdr tx_msgs[TX_SLOTS];

/* A destination whose run of equal-length replies is still open while flush() groups. */
struct run {
    uint32_t ip, src, seg, bytes;
    uint16_t port;
    uint16_t msg;
};
static struct run runs[GSO_OPEN];

#define FAIL(...)                                                   \
    do {                                                            \
        snprintf(nce_errbuf, sizeof nce_errbuf, __VA_ARGS__);       \
        return -1;                                                  \
    } while (0)

uint32_t ncs_dgram_room(void)
{
    return TX_BYTES;
}

int ncs_open(const uint8_t *ip, uint16_t port)
{
    if (sock >= 0)
        FAIL("the socket data plane is already open in this process");
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons(port)};
    memcpy(&addr.sin_addr.s_addr, ip, 4);
    char where[INET_ADDRSTRLEN] = "?";
    inet_ntop(AF_INET, &addr.sin_addr, where, sizeof where);
    sock = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (sock < 0)
        FAIL("cannot open a UDP socket: %s", strerror(errno));
    const int size = SOCKET_BUFFER_BYTES, on = 1, off = 0;
    /* Best effort: the kernel's default buffers still work, with more loss under bursts. */
    (void)setsockopt(sock, SOL_SOCKET, SO_RCVBUF, &size, sizeof size);
    (void)setsockopt(sock, SOL_SOCKET, SO_SNDBUF, &size, sizeof size);
    /* Best effort too: a kernel without UDP GRO hands us one datagram per buffer, one without
     * UDP GSO (segment size 0 is "off", refused only where the option does not exist) gets one
     * datagram per send, as before either existed. */
    gro = setsockopt(sock, SOL_UDP, UDP_GRO, &on, sizeof on) == 0;
    gso = setsockopt(sock, SOL_UDP, UDP_SEGMENT, &off, sizeof off) == 0;
    bound_ip = addr.sin_addr.s_addr;
    socklen_t len = sizeof addr;
    if ((bound_ip == 0 && setsockopt(sock, IPPROTO_IP, IP_PKTINFO, &on, sizeof on) != 0) ||
        bind(sock, (struct sockaddr *)&addr, sizeof addr) != 0 ||
        getsockname(sock, (struct sockaddr *)&addr, &len) != 0) {
        const int err = errno;
        ncs_close();
        FAIL("cannot listen on %s:%u/udp: %s", where, port, strerror(err));
    }
    stop_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (stop_fd < 0) {
        const int err = errno;
        ncs_close();
        FAIL("eventfd: %s", strerror(err));
    }
    stopping = 0;
    io.gro = (uint64_t)gro;
    io.gso = (uint64_t)gso;
    for (unsigned i = 0; i < BATCH; i++) {
        rx_iov[i].iov_base = rx_bufs[i];
        rx_iov[i].iov_len = RX_BYTES;
        rx_msgs[i].msg_hdr.msg_iov = &rx_iov[i];
        rx_msgs[i].msg_hdr.msg_iovlen = 1;
        rx_msgs[i].msg_hdr.msg_name = &rx_names[i];
    }
    return ntohs(addr.sin_port);
}

/* Group the queued replies into messages, in order: a reply joins the open run of its
 * destination (address, port, source address) when it is no longer than the run's first (a
 * shorter one ends the run, as UDP_SEGMENT requires) and the run stays within the kernel's
 * limits; otherwise it starts a message of its own. Replies to one destination keep their
 * order. Returns how many messages. */
static unsigned group(void)
{
    unsigned messages = 0, open = 0;
    for (unsigned i = 0; i < tx_count; i++) {
        const uint32_t ip = tx_names[i].sin_addr.s_addr, src = tx_src[i], len = tx_lens[i];
        const uint16_t port = tx_names[i].sin_port;
        unsigned r = 0;
        while (r < open && (runs[r].ip != ip || runs[r].port != port || runs[r].src != src))
            r++;
        if (r < open) {
            struct run *run = &runs[r];
            if (len <= run->seg && tx_segments[run->msg] < GSO_SEGMENTS &&
                run->bytes + len <= GSO_BYTES) {
                tx_group[i] = run->msg;
                tx_segments[run->msg]++;
                run->bytes += len;
                if (len < run->seg)
                    runs[r] = runs[--open];
                continue;
            }
            runs[r] = runs[--open];     /* this reply starts the destination's next run */
        }
        tx_head[messages] = i;
        tx_segments[messages] = 1;
        tx_group[i] = (uint16_t)messages;
        if (gso && open < GSO_OPEN)
            runs[open++] = (struct run){.ip = ip, .src = src, .seg = len, .bytes = len,
                                        .port = port, .msg = (uint16_t)messages};
        messages++;
    }
    return messages;
}

/* Lay the grouped replies out as sendmmsg messages: each message's datagrams side by side in
 * tx_iov, its control messages IP_PKTINFO (bound to any address) and UDP_SEGMENT (a run). */
static void lay_out(unsigned messages)
{
    unsigned at = 0;
    for (unsigned m = 0; m < messages; m++) {
        tx_first[m] = tx_fill[m] = at;
        at += tx_segments[m];
    }
    for (unsigned i = 0; i < tx_count; i++)
        tx_iov[tx_fill[tx_group[i]]++] = (struct iovec){.iov_base = tx_bufs[i],
                                                        .iov_len = tx_lens[i]};
    for (unsigned m = 0; m < messages; m++) {
        const unsigned head = tx_head[m];
        struct msghdr *h = &tx_msgs[m].msg_hdr;
        h->msg_name = &tx_names[head];
        h->msg_namelen = sizeof tx_names[head];
        h->msg_iov = &tx_iov[tx_first[m]];
        h->msg_iovlen = tx_segments[m];
        size_t ctrl = 0;
        if (bound_ip == 0) {    /* from the address the worker sent to */
            struct cmsghdr *c = (struct cmsghdr *)tx_ctrl[m];
            c->cmsg_level = IPPROTO_IP;
            c->cmsg_type = IP_PKTINFO;
            c->cmsg_len = CMSG_LEN(sizeof(struct in_pktinfo));
            const struct in_pktinfo info = {.ipi_spec_dst.s_addr = tx_src[head]};
            memcpy(CMSG_DATA(c), &info, sizeof info);
            ctrl = PKTINFO_SPACE;
        }
        if (tx_segments[m] > 1) {       /* after IP_PKTINFO: one_by_one() cuts it off */
            struct cmsghdr *c = (struct cmsghdr *)(tx_ctrl[m] + ctrl);
            c->cmsg_level = SOL_UDP;
            c->cmsg_type = UDP_SEGMENT;
            c->cmsg_len = CMSG_LEN(sizeof(uint16_t));
            const uint16_t seg = (uint16_t)tx_lens[head];
            memcpy(CMSG_DATA(c), &seg, sizeof seg);
            ctrl += CMSG_SPACE(sizeof(uint16_t));
        }
        h->msg_control = ctrl ? tx_ctrl[m] : NULL;
        h->msg_controllen = ctrl;
    }
}

/* The kernel refused message m's GSO send: send its datagrams one by one. A refusal other than
 * for this message's size (EINVAL: e.g. a segment over the route's MTU) means the kernel or the
 * device cannot segment: GSO is off from now on. */
static void one_by_one(unsigned m, int err)
{
    io.gso_fallbacks++;
    if (err != EINVAL && err != EMSGSIZE)
        io.gso = (uint64_t)(gso = 0);
    struct msghdr h = tx_msgs[m].msg_hdr;
    h.msg_iovlen = 1;
    h.msg_controllen = bound_ip == 0 ? PKTINFO_SPACE : 0;
    h.msg_control = h.msg_controllen ? h.msg_control : NULL;
    for (unsigned s = 0; s < tx_segments[m]; s++) {
        h.msg_iov = &tx_iov[tx_first[m] + s];
        ssize_t n;
        while ((n = sendmsg(sock, &h, 0)) < 0 && errno == EINTR)
            ;
        if (n < 0) {
            io.tx_datagrams--;  /* counted by flush() before it was sent */
            io.send_errors++;
        }
    }
}

/* Hand the buffered replies to the kernel; a datagram it refuses is counted and skipped. They are
 * counted as sent before the send and taken back on a refusal, so that the stats never show fewer
 * datagrams than a peer has already received (a reader of ncs_io_stats runs on another thread). */
static void flush(void)
{
    if (tx_count == 0)
        return;
    const unsigned messages = group();
    lay_out(messages);
    io.tx_datagrams += tx_count;
    unsigned at = 0;
    while (at < messages) {
        const int n = sendmmsg(sock, tx_msgs + at, messages - at, 0);
        if (n < 0) {
            const int err = errno;
            if (err == EINTR)
                continue;
            if (tx_segments[at] > 1 && (err == EINVAL || err == EMSGSIZE || err == EIO ||
                                        err == ENOPROTOOPT || err == EOPNOTSUPP))
                one_by_one(at, err);
            else {
                io.tx_datagrams -= tx_segments[at];
                io.send_errors += tx_segments[at];
            }
            at++;
            continue;
        }
        for (unsigned m = at; m < at + (unsigned)n; m++)
            io.tx_gso_sends += tx_segments[m] > 1;
        at += (unsigned)n;
    }
    io.tx_batches++;
    tx_count = 0;
}

/* The next send buffer's index, its reply addressed to ip:port (network order) from src_ip. */
static unsigned next_tx(uint32_t ip, uint16_t port, uint32_t src_ip)
{
    if (tx_count == TX_SLOTS)
        flush();
    tx_names[tx_count] = (struct sockaddr_in){
        .sin_family = AF_INET, .sin_port = port, .sin_addr.s_addr = ip};
    tx_src[tx_count] = src_ip;
    return tx_count;
}

/* Queue the engine's reply for rank to ip:port. */
static void queue_reply(const struct nce_action *a, uint16_t rank, uint32_t ip, uint16_t port,
                        uint32_t src_ip)
{
    const unsigned t = next_tx(ip, port, src_ip);
    const uint32_t len = nce_build_reply(tx_bufs[t], TX_BYTES, a, rank);
    if (len == 0) {
        io.oversized++;
        return;
    }
    tx_lens[t] = len;
    tx_count++;
}

/* Queue a leaf's datagram to its spine (from the address the kernel chooses). */
static void queue_uplink(const struct nce_action *a)
{
    const unsigned t = next_tx(a->up_ip, a->up_port, 0);
    const uint32_t len = nce_build_uplink(tx_bufs[t], TX_BYTES, a);
    if (len == 0) {
        io.oversized++;
        return;
    }
    tx_lens[t] = len;
    tx_count++;
}

/* What buffer i's control messages say: the address its datagrams were sent to (IP_PKTINFO when
 * bound to any address) and their segment size (UDP_GRO; 0: the buffer is one datagram). */
static void ancillary(unsigned i, uint32_t *dst, uint32_t *seg)
{
    *dst = bound_ip;
    *seg = 0;
    struct msghdr *h = &rx_msgs[i].msg_hdr;
    if (h->msg_control == NULL)
        return;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(h); c != NULL; c = CMSG_NXTHDR(h, c)) {
        if (c->cmsg_level == IPPROTO_IP && c->cmsg_type == IP_PKTINFO &&
            c->cmsg_len >= CMSG_LEN(sizeof(struct in_pktinfo))) {
            struct in_pktinfo info;
            memcpy(&info, CMSG_DATA(c), sizeof info);
            *dst = info.ipi_addr.s_addr;
        } else if (c->cmsg_level == SOL_UDP && c->cmsg_type == UDP_GRO &&
                   c->cmsg_len >= CMSG_LEN(sizeof(int))) {
            int size;
            memcpy(&size, CMSG_DATA(c), sizeof size);
            *seg = size > 0 ? (uint32_t)size : 0;
        }
    }
}

static void aggregate(const uint8_t *dgram, uint32_t len, const struct nce_from *from)
{
    struct nce_action a;
    switch (nce_input(dgram, len, from, &a)) {
    case NCE_V_SEND_ONE:
    case NCE_V_NOTICE:
    case NCE_V_DESCRIPTOR:
        queue_reply(&a, a.rank, from->src_ip, from->src_port, from->dst_ip);
        break;
    case NCE_V_SEND_ALL:
        for (uint16_t r = 0; r < a.members; r++) {
            const struct nce_member *m = nce_member_of(&a, r);
            queue_reply(&a, r, m->ip, m->port, m->agg_ip);
        }
        break;
    case NCE_V_NONE:
        break;
    }
    if (a.up != NCE_UP_NONE)            /* a leaf's partial sums or hello, to its spine */
        queue_uplink(&a);
}

/* The no-op forwarder: the datagram goes back to its sender as it came. */
static void echo(const uint8_t *dgram, uint32_t len, const struct nce_from *from)
{
    if (len > TX_BYTES) {
        io.oversized++;
        return;
    }
    const unsigned t = next_tx(from->src_ip, from->src_port, from->dst_ip);
    memcpy(tx_bufs[t], dgram, len);
    tx_lens[t] = len;
    tx_count++;
}

/* Hand buffer i's datagrams to the engine (or the forwarder) one by one, as if each had come
 * alone: a GRO buffer holds datagrams of seg bytes, the last one maybe shorter. */
static void take(unsigned i, int mode)
{
    const struct sockaddr_in *src = &rx_names[i];
    if (src->sin_family != AF_INET)
        return;
    struct nce_from from = {.src_ip = src->sin_addr.s_addr, .src_port = src->sin_port};
    uint32_t seg;
    ancillary(i, &from.dst_ip, &seg);
    const uint32_t len = rx_msgs[i].msg_len;
    if (seg == 0 || seg >= len)
        seg = len;
    else
        io.rx_coalesced++;
    uint32_t off = 0;
    do {
        const uint32_t n = len - off < seg ? len - off : seg;
        io.rx_datagrams++;
        if (mode == 1)
            echo(rx_bufs[i] + off, n, &from);
        else
            aggregate(rx_bufs[i] + off, n, &from);
        off += n;
    } while (off < len);
}

int ncs_run(int mode)
{
    if (sock < 0)
        FAIL("the socket is not open (ncs_open)");
    struct pollfd wait[2] = {{.fd = sock, .events = POLLIN}, {.fd = stop_fd, .events = POLLIN}};
    const int ancillaries = bound_ip == 0 || gro;
    while (!stopping) {
        for (unsigned i = 0; i < BATCH; i++) {
            rx_msgs[i].msg_hdr.msg_namelen = sizeof rx_names[i];
            rx_msgs[i].msg_hdr.msg_control = ancillaries ? rx_ctrl[i] : NULL;
            rx_msgs[i].msg_hdr.msg_controllen = ancillaries ? RX_CTRL : 0;
        }
        const int n = recvmmsg(sock, rx_msgs, BATCH, MSG_DONTWAIT, NULL);
        if (n <= 0) {
            if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                FAIL("recvmmsg: %s", strerror(errno));  /* nothing more will come */
            io.wakeups++;
            poll(wait, 2, -1);
            continue;
        }
        io.rx_batches++;
        io.rx_buffers += (unsigned)n;
        nce_dp_enter();
        for (unsigned i = 0; i < (unsigned)n; i++)
            take(i, mode);
        nce_dp_leave();
        flush();
    }
    return 0;
}

void ncs_stop(void)
{
    stopping = 1;
    if (stop_fd >= 0) {
        const uint64_t one = 1;
        (void)!write(stop_fd, &one, sizeof one);
    }
}

void ncs_close(void)
{
    if (sock >= 0)
        close(sock);
    if (stop_fd >= 0)
        close(stop_fd);
    sock = stop_fd = -1;
}

int ncs_fileno(void)
{
    return sock;
}

void ncs_io_stats(struct ncs_io *out)
{
    const volatile uint64_t *src = (const volatile uint64_t *)&io;
    uint64_t *dst = (uint64_t *)out;
    for (size_t i = 0; i < sizeof *out / sizeof(uint64_t); i++)
        dst[i] = src[i];
}
