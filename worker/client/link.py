"""The client's UDP socket to its aggregator: the resolved address, the socket (non-blocking,
large buffers), its poll object and the receive buffer, shared by the handshake
(``ncina.worker.client.handshake``) and the data paths (``ncina.worker.client.datapath``)."""

from __future__ import annotations

import select
import socket

from ncina.proto.wire import MAX_DATAGRAM

SOCKET_BUFFER = 4 << 20  # requested SO_RCVBUF/SO_SNDBUF; the kernel caps it at rmem_max/wmem_max


class Link:
    """A socket bound to ``bind`` that talks to ``aggregator`` (resolved once: ``sendto()`` with
    a host name would resolve it on every packet)."""

    def __init__(self, aggregator: tuple[str, int], bind: tuple[str, int]) -> None:
        family, _, _, _, address = socket.getaddrinfo(
            aggregator[0], aggregator[1], socket.AF_INET, socket.SOCK_DGRAM
        )[0]
        self.aggregator: tuple[str, int] = address
        self.sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
                self.sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
            self.sock.bind(bind)
            self.sock.setblocking(False)
        except OSError:
            self.sock.close()
            raise
        self.poll = select.poll()
        self.poll.register(self.sock, select.POLLIN)
        self.buf = bytearray(MAX_DATAGRAM)

    @property
    def address(self) -> tuple[str, int]:
        """The local address results come back to."""
        return self.sock.getsockname()

    def close(self) -> None:
        """Close the socket."""
        self.sock.close()
