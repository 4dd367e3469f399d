"""Sizes and limits of the wire: one definition of each, for the worker, every aggregator backend,
the topologies and the benchmarks.

A datagram is an ncina header (``HEADER_SIZE``), its payload and, for a keyed job, a tag
(``TAG_SIZE``), inside UDP in IPv4 without options, inside an Ethernet frame (docs/protocol.md).
An MTU counts IPv4 bytes; a frame adds the Ethernet header to it. The C engines and the P4
program keep their own ``#define``s/constants; ``tests/test_wire.py`` checks that they equal these.
"""

from __future__ import annotations

# ---- header sizes, outermost first ----

ETHERNET_HEADER = 14
"""An Ethernet II header without VLAN tag: destination, source, ethertype."""
IPV4_HEADER = 20
"""An IPv4 header without options (every backend sends none, and drops fragments it cannot
reassemble)."""
UDP_HEADER = 8
HEADER_SIZE = 16
"""The ncina header (``ncina.proto.header.HEADER``, docs/protocol.md)."""
TAG_SIZE = 8
"""The authentication tag at the end of a keyed job's datagram (``ncina.proto.tag``)."""

# ---- what they add up to ----

IPV4_UDP_HEADERS = IPV4_HEADER + UDP_HEADER
"""28: the bytes of an IP MTU that are not the UDP payload."""
ETH_IPV4_UDP_HEADERS = ETHERNET_HEADER + IPV4_UDP_HEADERS
"""42: the bytes of a frame in front of its UDP payload (BMv2 counts frames, stats count UDP
payloads)."""
ETH_IPV4_UDP_NCINA_HEADERS = ETH_IPV4_UDP_HEADERS + HEADER_SIZE
"""58: the bytes of a frame in front of its ncina payload."""

# ---- limits shared by the worker and every aggregator ----

MIN_MTU = 68
"""The smallest link MTU (IPv4's minimum)."""
DEFAULT_MTU = 1500
"""The MTU of an Ethernet link without jumbo frames: every command's default."""
MAX_MTU = 9216
"""The largest jumbo frame common NICs and Linux veths take."""
MAX_DATAGRAM = 65535
"""UDP's length field: a receive buffer this big holds any datagram (an oversized one is seen
and counted, not truncated)."""
MAX_WORKERS = 64
"""Ranks per job: a worker bitmap is one 64-bit register word in every backend."""
MAX_TOTAL_WORKERS = MAX_WORKERS * MAX_WORKERS
"""Workers of a hierarchical job (docs/protocol.md, "Hierarchical aggregation"): up to
``MAX_WORKERS`` leaf aggregators of ``MAX_WORKERS`` workers each."""
MAX_JOB_ID = 0xFFFF
"""The header's job field is 16 bits."""
MAX_POOL_SIZE = 0xFFFF
"""The header's slot field is 16 bits."""


def payload_room(mtu: int, tagged: bool = False) -> int:
    """Bytes left for the ncina payload in one IPv4 packet of ``mtu`` bytes (negative when not
    even the headers fit): IPv4, UDP, the ncina header and, for a keyed job, the tag."""
    return mtu - IPV4_UDP_HEADERS - HEADER_SIZE - (TAG_SIZE if tagged else 0)


MAX_K = payload_room(MAX_MTU)
"""9172: the largest chunk, an NC8 payload (one byte an element) of one largest-MTU packet. The
C engine has the same limit (``NCE_MAX_K``); the BMv2 program compiles fewer lanes
(``ncina.aggregator.backends.bmv2.gen``)."""
