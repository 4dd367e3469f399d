"""Entries of the Reply control (p4/tofino/reply.p4): the job handshake's answer; and the
seed of a job of nc8 results (the twin's ``LaneSums.results``, the TNA build's egress
``Recompress.results``)."""

from __future__ import annotations

from ncina.aggregator.backends.bmv2.entries import Entry, InstalledJob
from ncina.proto.header import Format

ANSWERS_TABLE = "NcinaIngress.reply.answers"
ANSWER_ACTION = "NcinaIngress.reply.answer"
RESULTS_TABLE = "NcinaIngress.sums.results"
NC8_JOB_ACTION = "NcinaIngress.sums.nc8_job"


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


def result_entries(job: InstalledJob) -> list[Entry]:
    """A job of nc8 results: its index and the 64-bit seed of its results' rounding words
    (docs/protocol.md, "Re-compression"); none for int or int32 results."""
    if job.config.result_format != Format.NC8:
        return []
    return [Entry(RESULTS_TABLE, {"meta.job_index": str(job.index)}, NC8_JOB_ACTION,
                  {"job_seed": str(job.seed)})]  # fmt: skip
