"""The links of a Mininet fabric as a benchmark measures them (``ncina bench fabric``): the
sending end of each worker's uplink, the frames and bytes its tc HTB class sent, and the share
of the link's bandwidth the bytes counted over a run took; and how long an all-reduce may take
on such links. ``ncina topo``'s workers count their bytes the same way
(``ncina.common.htb.LinkCounters``).

The count is HTB's, not the interfaces' (``/sys/class/net/*/statistics``): with the links'
checksum offloads on (``ncina bench fabric --offloads``) a UDP GSO run or a TCP TSO segment
crosses the veth and the bridge as one buffer, which the interfaces count as one frame with its
headers once; HTB counts it as its segments (``gso_segs``) and every segment's bytes, headers
included (``qdisc_pkt_len``), with the offloads on or off.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from ncina.common.htb import htb_command, parse_sent
from ncina.proto.wire import ETH_IPV4_UDP_NCINA_HEADERS

MIN_TIME_LIMIT = 120.0  # seconds one all-reduce may take at least (see time_limit)


def uplinks(net: Any, topo: Any) -> list[Any]:
    """The worker's end of each worker's link, in rank order: its HTB class counts what the
    worker put on its uplink."""
    return [net.get(name).defaultIntf() for name in topo.worker_names]


def htb_sent(intf: Any) -> tuple[int, int]:
    """The bytes and frames the shaped interface ``intf`` (a Mininet ``Intf``) has sent through
    its HTB class, each GSO or TSO segment counted: read in the interface's node."""
    out = intf.node.cmd(" ".join(htb_command(intf.name)))
    sent = parse_sent(out)
    if sent is None:
        raise RuntimeError(f"{intf}: no HTB class (an unshaped link?): {out!r}")
    return sent


def sent_bytes(intfs: list[Any]) -> list[int]:
    """Per interface, the bytes its HTB class has sent (:func:`htb_sent`)."""
    return [htb_sent(intf)[0] for intf in intfs]


def fractions(before: list[int], after: list[int], seconds: float, bw: float) -> list[float]:
    """Per worker, the link fraction of the bytes counted between ``before`` and ``after``."""
    return [round(link_fraction(a - b, seconds, bw), 4) for b, a in zip(before, after, strict=True)]


def link_fraction(frame_bytes: int, seconds: float, bw_mbit: float) -> float:
    """The share of a ``bw_mbit`` Mbit/s link that ``frame_bytes`` bytes of frames in
    ``seconds`` take."""
    return frame_bytes * 8 / seconds / (bw_mbit * 1e6)


def useful_frame_bytes(elements: int, k: int) -> int:
    """The bytes of the frames that carry a worker's ``elements`` once, in chunks of ``k``: one
    NC8 byte an element, each chunk behind Ethernet, IPv4, UDP and the ncina header (no tag:
    the benchmarks' jobs are unkeyed). What a worker's uplink carries without a copy (10M
    elements at K 1456: 6,868 frames of 1,514 bytes and one of 250); copies are on the wire
    but do no work."""
    return elements + -(-elements // k) * ETH_IPV4_UDP_NCINA_HEADERS


def time_limit(elements: int, bw_mbit: float, deadline: float) -> float:
    """Seconds one all-reduce of ``elements`` float32 per worker may take on links of
    ``bw_mbit`` Mbit/s whose workers give up after ``deadline`` seconds without progress: three
    times what gloo's ring needs on the links (each worker sends about twice its tensor), plus
    the deadline, and at least ``MIN_TIME_LIMIT``."""
    return max(MIN_TIME_LIMIT, 3 * 2 * 32 * elements / (bw_mbit * 1e6) + deadline)


def ina_link_figures(
    before: list[int], after: list[int], wall_s: float, args: argparse.Namespace
) -> dict[str, Any]:
    """``link_fraction`` (useful bytes: every chunk once) and ``wire_fraction`` (everything
    the workers' uplinks carried, copies included: the mean of ``wire_fractions``) of one INA
    all-reduce from the uplinks' sent bytes ``before`` and ``after`` (:func:`sent_bytes`)."""
    wire = fractions(before, after, wall_s, args.bw)
    useful = link_fraction(useful_frame_bytes(args.elements, args.k), wall_s, args.bw)
    return {"link_fraction": round(useful, 4), "wire_fraction": round(statistics.mean(wire), 4),
            "wire_fractions": wire}  # fmt: skip
