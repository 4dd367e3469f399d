"""Entries of the Reply control (p4/tofino/reply.p4): the job handshake's answer."""

from __future__ import annotations

from ncina.aggregator.backends.bmv2.entries import Entry, InstalledJob

ANSWERS_TABLE = "NcinaIngress.reply.answers"
ANSWER_ACTION = "NcinaIngress.reply.answer"


def answer_entry(job: InstalledJob) -> Entry:
    """The job's descriptor as the switch holds it (docs/protocol.md, "Job handshake")."""
    c = job.config
    params = {
        "mode": int(c.result_format),
        "e_max": c.window.e_max & 0xFF,
        "e_min": c.window.e_min & 0xFF,
        "workers": c.workers,
        "pool": c.pool_size,
        "k": c.k,
    }
    return Entry(ANSWERS_TABLE, {"hdr.nc.job": str(c.job)}, ANSWER_ACTION,
                 {name: str(value) for name, value in params.items()})  # fmt: skip
