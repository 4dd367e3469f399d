/* The socket I/O layer (after DPDK's l2fwd, with the kernel as the port): receive a batch of
 * datagrams with recvmmsg, decide each with the slot engine, write its replies into the send
 * buffers (a completed slot's result once per member: the emulated multicast), and hand them to
 * the kernel with sendmmsg when the batch is done or the buffers are full. Idle, the loop sleeps
 * in poll() on the socket and an eventfd that ncs_stop() signals. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "datapath.h"
#include "ncs.h"

#define BATCH 64                /* datagrams per recvmmsg */
#define RX_BYTES 65536          /* any UDP datagram, so oversized ones are seen and counted */
#define TX_SLOTS 512            /* replies buffered before a sendmmsg */
#define TX_BYTES 9216           /* the largest MTU's datagram, and more */
#define SOCKET_BUFFER_BYTES (4 << 20)   /* asked for SO_RCVBUF/SO_SNDBUF, as the Python backend */
#define PKTINFO_SPACE CMSG_SPACE(sizeof(struct in_pktinfo))

static int sock = -1, stop_fd = -1;
static uint32_t bound_ip;       /* network order; 0: any (replies carry IP_PKTINFO) */
static volatile int stopping;
static struct ncs_io io;

static uint8_t rx_bufs[BATCH][RX_BYTES];
static struct sockaddr_in rx_names[BATCH];
static uint8_t rx_ctrl[BATCH][PKTINFO_SPACE];
static struct iovec rx_iov[BATCH];
static struct mmsghdr rx_msgs[BATCH];

static uint8_t tx_bufs[TX_SLOTS][TX_BYTES];
static struct sockaddr_in tx_names[TX_SLOTS];
static uint8_t tx_ctrl[TX_SLOTS][PKTINFO_SPACE];
static struct iovec tx_iov[TX_SLOTS];
static struct mmsghdr tx_msgs[TX_SLOTS];
static unsigned tx_count;

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
    const int size = SOCKET_BUFFER_BYTES, on = 1;
    /* Best effort: the kernel's default buffers still work, with more loss under bursts. */
    (void)setsockopt(sock, SOL_SOCKET, SO_RCVBUF, &size, sizeof size);
    (void)setsockopt(sock, SOL_SOCKET, SO_SNDBUF, &size, sizeof size);
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
    for (unsigned i = 0; i < BATCH; i++) {
        rx_iov[i].iov_base = rx_bufs[i];
        rx_iov[i].iov_len = RX_BYTES;
        rx_msgs[i].msg_hdr.msg_iov = &rx_iov[i];
        rx_msgs[i].msg_hdr.msg_iovlen = 1;
        rx_msgs[i].msg_hdr.msg_name = &rx_names[i];
    }
    for (unsigned i = 0; i < TX_SLOTS; i++) {
        tx_iov[i].iov_base = tx_bufs[i];
        tx_msgs[i].msg_hdr.msg_iov = &tx_iov[i];
        tx_msgs[i].msg_hdr.msg_iovlen = 1;
        tx_msgs[i].msg_hdr.msg_name = &tx_names[i];
        tx_msgs[i].msg_hdr.msg_namelen = sizeof tx_names[i];
    }
    return ntohs(addr.sin_port);
}

/* Hand the buffered replies to the kernel; a datagram it refuses is counted and skipped. */
static void flush(void)
{
    unsigned done = 0;
    while (done < tx_count) {
        const int n = sendmmsg(sock, tx_msgs + done, tx_count - done, 0);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            io.send_errors++;
            done++;
            continue;
        }
        io.tx_datagrams += (unsigned)n;
        done += (unsigned)n;
    }
    if (tx_count)
        io.tx_batches++;
    tx_count = 0;
}

/* The next send buffer, its message addressed to ip:port (network order) from src_ip. */
static struct mmsghdr *next_tx(uint32_t ip, uint16_t port, uint32_t src_ip)
{
    if (tx_count == TX_SLOTS)
        flush();
    struct mmsghdr *m = &tx_msgs[tx_count];
    tx_names[tx_count] = (struct sockaddr_in){
        .sin_family = AF_INET, .sin_port = port, .sin_addr.s_addr = ip};
    if (bound_ip == 0) {        /* from the address the worker sent to */
        m->msg_hdr.msg_control = tx_ctrl[tx_count];
        m->msg_hdr.msg_controllen = PKTINFO_SPACE;
        struct cmsghdr *c = CMSG_FIRSTHDR(&m->msg_hdr);
        c->cmsg_level = IPPROTO_IP;
        c->cmsg_type = IP_PKTINFO;
        c->cmsg_len = CMSG_LEN(sizeof(struct in_pktinfo));
        struct in_pktinfo info = {.ipi_spec_dst.s_addr = src_ip};
        memcpy(CMSG_DATA(c), &info, sizeof info);
    }
    return m;
}

/* Queue the engine's reply for rank to ip:port. */
static void queue_reply(const struct nce_action *a, uint16_t rank, uint32_t ip, uint16_t port,
                        uint32_t src_ip)
{
    struct mmsghdr *m = next_tx(ip, port, src_ip);
    const uint32_t len = nce_build_reply(tx_bufs[tx_count], TX_BYTES, a, rank);
    if (len == 0) {
        io.oversized++;
        return;
    }
    m->msg_hdr.msg_iov->iov_len = len;
    tx_count++;
}

/* The address datagram i was sent to (IP_PKTINFO when bound to any address). */
static uint32_t destination(unsigned i)
{
    if (bound_ip != 0)
        return bound_ip;
    struct msghdr *h = &rx_msgs[i].msg_hdr;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(h); c != NULL; c = CMSG_NXTHDR(h, c)) {
        if (c->cmsg_level == IPPROTO_IP && c->cmsg_type == IP_PKTINFO) {
            struct in_pktinfo info;
            memcpy(&info, CMSG_DATA(c), sizeof info);
            return info.ipi_addr.s_addr;
        }
    }
    return 0;
}

static void aggregate(unsigned i)
{
    const struct sockaddr_in *src = &rx_names[i];
    const struct nce_from from = {.src_ip = src->sin_addr.s_addr, .src_port = src->sin_port,
                                  .dst_ip = destination(i)};
    struct nce_action a;
    switch (nce_input(rx_bufs[i], rx_msgs[i].msg_len, &from, &a)) {
    case NCE_V_SEND_ONE:
    case NCE_V_NOTICE:
        queue_reply(&a, a.rank, from.src_ip, from.src_port, from.dst_ip);
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
}

/* The no-op forwarder: the datagram goes back to its sender as it came. */
static void echo(unsigned i)
{
    const uint32_t len = rx_msgs[i].msg_len;
    if (len > TX_BYTES) {
        io.oversized++;
        return;
    }
    struct mmsghdr *m = next_tx(rx_names[i].sin_addr.s_addr, rx_names[i].sin_port,
                                destination(i));
    memcpy(tx_bufs[tx_count], rx_bufs[i], len);
    m->msg_hdr.msg_iov->iov_len = len;
    tx_count++;
}

int ncs_run(int mode)
{
    if (sock < 0)
        FAIL("the socket is not open (ncs_open)");
    struct pollfd wait[2] = {{.fd = sock, .events = POLLIN}, {.fd = stop_fd, .events = POLLIN}};
    while (!stopping) {
        for (unsigned i = 0; i < BATCH; i++) {
            rx_msgs[i].msg_hdr.msg_namelen = sizeof rx_names[i];
            rx_msgs[i].msg_hdr.msg_control = bound_ip == 0 ? rx_ctrl[i] : NULL;
            rx_msgs[i].msg_hdr.msg_controllen = bound_ip == 0 ? PKTINFO_SPACE : 0;
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
        io.rx_datagrams += (unsigned)n;
        for (unsigned i = 0; i < (unsigned)n; i++) {
            if (rx_names[i].sin_family != AF_INET)
                continue;
            if (mode == 1)
                echo(i);
            else
                aggregate(i);
        }
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

void ncs_io_stats(struct ncs_io *out)
{
    const volatile uint64_t *src = (const volatile uint64_t *)&io;
    uint64_t *dst = (uint64_t *)out;
    for (size_t i = 0; i < sizeof *out / sizeof(uint64_t); i++)
        dst[i] = src[i];
}
