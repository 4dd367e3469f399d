"""The control plane of the Tofino program's design, driving its v1model twin ``p4/twin/`` on
BMv2 (``ncina aggregator --backend bmv2 --profile tofino``, docs/tofino.md): what the TNA
program's contract ("What the control plane must install") asks, one module per P4 control it
programs (``admission``, ``reply``, ``switching``, ``events``), the members it learns from the
switch's digests (``learning``: egress ``member_addresses`` among them, also for a configured
member, whose MAC address a job does not name), and the design's limits in one place
(``limits``). The entries are plain data (``ncina.aggregator.backends.bmv2.entries``'
``Entry`` and ``Group``), pushed by ``ncina.aggregator.backends.bmv2.control``.
"""

from __future__ import annotations

from collections.abc import Mapping

from ncina.aggregator.backends.bmv2.entries import (
    Entry,
    Group,
    InstalledJob,
    flood_group,
    job_group,
)
from ncina.aggregator.backends.tofino.twin import admission, reply, switching


def entries(job: InstalledJob, local: tuple[str, int, str]) -> list[Entry]:
    """Every table entry for one job on a switch whose address is ``local`` (IPv4 address, UDP
    port, MAC address), in the order to install them: ARP, the job's two ``jobs`` entries, its
    configured members, its handshake answer and result lengths, and the aggregator's address
    last. Until that one is in, the switch takes nothing addressed to it: a hello that came
    between the ``jobs`` entries and the answer was answered with the missing job's all-zero
    descriptor, which the worker refuses as a mismatch (2 of 44 restarts in a 15-minute soak)."""
    ip, port, mac = local
    return [
        switching.arp_entry(ip, mac),
        *admission.job_entries(job),
        *admission.member_entries(job),
        reply.answer_entry(job),
        *reply.result_entries(job),
        switching.local_entry(ip, port, mac, job.generation),
    ]


def groups(job: InstalledJob, rank_ports: Mapping[int, int], ports: list[int]) -> list[Group]:
    """The job's multicast group (one replica per rank, instance = rank) and the flood group."""
    return [job_group(job, rank_ports), flood_group(ports)]
