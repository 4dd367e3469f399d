"""Entries of the Admission control (p4/tofino/admission.p4): the ``jobs`` table, two entries
per job (one per pool version), and the configured members in ``ranks`` and ``members``."""

from __future__ import annotations

import ipaddress

from ncina.aggregator.backends.bmv2.entries import Entry, InstalledJob
from ncina.aggregator.backends.bmv2.layout import JOB_EVENTS
from ncina.proto.profiles import tofino_max_code

JOBS_TABLE = "NcinaIngress.admission.jobs"
JOB_ACTION = "NcinaIngress.admission.set_job"
RANKS_TABLE = "NcinaIngress.admission.ranks"
MEMBERS_TABLE = "NcinaIngress.admission.members"


def job_entries(job: InstalledJob) -> list[Entry]:
    """The job's ``jobs`` entries: version ``v``'s slots from ``slot_base + v * pool``, each
    slot's pair of versions at ``slot_base / 2 + slot``, the window's codes cut to
    ``tofino_max_code`` (N workers' sums in 32 bits), replies' flags ``generation << 3 | 1``."""
    c = job.config
    params = {
        "index": job.index,
        "group": job.index + 1,
        "workers": c.workers,
        "k": c.k,
        "pool": c.pool_size,
        "pair_base": job.slot_base // 2,
        "emin": c.window.e_min & 0xFF,
        "code_offset": 127 - min(c.window.max_code, tofino_max_code(c.total)),
        "result_format": int(c.result_format),
        "generation": job.generation,
        "flags": job.generation << 3 | 1,
        "full": (1 << c.workers) - 1,
        "events": job.index * len(JOB_EVENTS),
    }
    return [
        Entry(JOBS_TABLE, {"hdr.nc.job": str(c.job), "pool": str(version)}, JOB_ACTION,
              {name: str(value) for name, value in
               {**params, "slot_base": job.slot_base + version * c.pool_size}.items()})
        for version in (0, 1)
    ]  # fmt: skip


def member_entries(job: InstalledJob) -> list[Entry]:
    """Each configured member: its rank has an address (``ranks``) and it is this one
    (``members``: job, rank, IPv4 address, UDP port)."""
    out = []
    for rank, (host, port) in sorted(job.config.members.items()):
        key = {"hdr.nc.job": str(job.config.job), "hdr.nc.rank": str(rank)}
        out.append(Entry(RANKS_TABLE, key, "NoAction"))
        out.append(Entry(MEMBERS_TABLE, {**key, "hdr.ipv4.src": str(ipaddress.IPv4Address(host)),
                                         "hdr.udp.src_port": str(port)}, "NoAction"))  # fmt: skip
    return out
