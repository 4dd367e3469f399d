"""The HTB class that shapes one end of a Mininet link (``TCIntf``'s, with ``bw``): what it sent.

The count is HTB's, not the interface's (``/sys/class/net/*/statistics``): with the links'
checksum offloads on a UDP GSO run or a TCP TSO segment crosses the veth and the bridge as one
buffer, which the interfaces count as one frame with its headers once; HTB counts it as its
segments (``gso_segs``) and every segment's bytes, headers included (``qdisc_pkt_len``), with the
offloads on or off. ``ncina bench fabric`` reads it from outside (``ncina.harness.links``),
``ncina topo``'s workers from inside their hosts (:class:`LinkCounters`).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

HTB_CLASS = "5:1"
"""The class Mininet's ``TCIntf`` shapes a link's end with (``bw``): everything it sends."""
_SENT = re.compile(r"Sent (\d+) bytes (\d+) pkt")


def htb_command(iface: str) -> list[str]:
    """The ``tc`` command that shows interface ``iface``'s HTB class and its counters."""
    return ["tc", "-s", "class", "show", "dev", iface, "classid", HTB_CLASS]


def parse_sent(out: str) -> tuple[int, int] | None:
    """The bytes and frames an HTB class sent, from ``tc -s class show``'s output ``out``;
    None when it shows no class."""
    found = _SENT.search(out)
    return None if found is None else (int(found[1]), int(found[2]))


def htb_sent_here(iface: str) -> tuple[int, int] | None:
    """The bytes and frames (each GSO or TSO segment counted) interface ``iface`` of this
    process's network namespace (a Mininet host's: ``ncina train``) has sent through its HTB
    class; None when it has no HTB class (an unshaped link) or there is no ``tc``."""
    try:
        proc = subprocess.run(htb_command(iface), capture_output=True, text=True, check=False)
    except FileNotFoundError:
        return None
    return parse_sent(proc.stdout)


class LinkCounters:
    """What a worker's interface has sent and received since construction (zeros when no
    interface is given), as ``tx_bytes``, ``rx_bytes``, ``tx_packets``, ``rx_packets``.

    Sent: its HTB class's count (:func:`htb_sent_here`: every datagram of a UDP GSO run and
    every segment of a TCP TSO one, with its headers) on a shaped link (``ncina topo``'s worker
    links), the interface's own counters on an unshaped one. Received: the interface's counters
    (``/sys/class/net/IF/statistics``), which count a run that crossed the fabric whole (the
    links' offloads on) as one frame with its headers once: no HTB class sees a worker's
    downlink from inside its host."""

    COUNTERS = ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")

    def __init__(self, iface: str | None) -> None:
        self.iface = iface
        self.htb = iface is not None and htb_sent_here(iface) is not None
        self.base = self._read()

    def _read(self) -> dict[str, int]:
        if self.iface is None:
            return {}
        stats = Path("/sys/class/net", self.iface, "statistics")
        now = {k: int((stats / k).read_text()) for k in self.COUNTERS}
        if self.htb:
            sent = htb_sent_here(self.iface)
            if sent is None:
                raise RuntimeError(f"{self.iface}: its HTB class {HTB_CLASS} is gone")
            now["tx_bytes"], now["tx_packets"] = sent
        return now

    def delta(self) -> dict[str, int]:
        """Each counter's growth since construction."""
        now = self._read()
        return {k: now[k] - self.base[k] for k in now}
