"""Entries of NcinaIngress's ``local_address`` and of the Arp and Forward controls
(p4/tofino/switching.p4): the aggregator's address, its ARP answers, L2 forwarding."""

from __future__ import annotations

from collections.abc import Mapping

from ncina.aggregator.backends.bmv2.entries import Entry

LOCAL_TABLE = "NcinaIngress.local_address"
LOCAL_ACTION = "NcinaIngress.aggregator"
ARP_TABLE = "NcinaIngress.arp.requests"
ARP_ACTION = "NcinaIngress.arp.answer"
L2_TABLE = "NcinaIngress.forward.l2"
L2_ACTION = "NcinaIngress.forward.to_port"
ARP_REQUEST = 1


def local_entry(ip: str, port: int, mac: str, generation: int) -> Entry:
    """The aggregator's address: datagrams to its UDP ``port`` are aggregated; a handshake
    answer's flags are RESULT and the switch's ``generation``."""
    return Entry(LOCAL_TABLE, {"hdr.ipv4.dst": ip}, LOCAL_ACTION,
                 {"mac": mac, "port": str(port), "flags": str(generation << 3 | 1)})  # fmt: skip


def arp_entry(ip: str, mac: str) -> Entry:
    """An ARP request for the aggregator's address is answered with its MAC address."""
    return Entry(ARP_TABLE, {"hdr.arp.tpa": ip, "hdr.arp.op": str(ARP_REQUEST)}, ARP_ACTION,
                 {"mac": mac})  # fmt: skip


def l2_entries(hosts: Mapping[str, int]) -> list[Entry]:
    """Known hosts: MAC address -> switch port (others are flooded)."""
    return [Entry(L2_TABLE, {"hdr.eth.dst": mac}, L2_ACTION, {"port": str(port)})
            for mac, port in sorted(hosts.items())]  # fmt: skip
