"""What the Tofino program's design (``p4/tofino/``, docs/tofino.md) does not do, in one place:
the twin's control plane refuses a job that needs it, with one sentence, and the cross-backend
tests skip a scenario that needs it with the same sentence as their reason.
"""

from __future__ import annotations

from ncina.aggregator.bmv2 import gen_tofino
from ncina.aggregator.jobs import JobConfig
from ncina.proto.header import Format

MAX_K = gen_tofino.MAX_K
"""Lanes per pass (no recirculation)."""
MAX_WORKERS = gen_tofino.MAX_WORKERS
"""Ranks per job: a round's contributors are one 32-bit register word."""
MAX_CODE = gen_tofino.MAX_CODE
"""Largest code the per-lane decode tables know (+-2^30)."""

LACKS = {
    "nc8": "the Tofino design returns int results only (NC8 results need the CRC-32 rounding "
    "word and a highest set bit per lane there, not built yet: docs/tofino.md)",
    "int32": "the Tofino design widens its 32-bit lanes to the wire's 64-bit int results: "
    "it returns no int32 results yet (docs/tofino.md)",
    "tag": "the Tofino design has no keyed hash: a tagged datagram is dropped as bad_tag",
    "restart": "the Tofino design keeps no job epochs: a hello never restarts a job",
    "joined": "the Tofino design keeps no record of the ranks' hellos: a restart that draws the "
    "same generation is not detected (docs/protocol.md, Generations and notices)",
    "resend_limit": "the Tofino design keeps no per-rank resend budget (rule 2's resend_limit)",
    "transport": "the Tofino program checks no IPv4 header checksum, options or fragments "
    "beyond its parser's (ihl 5, offset 0, UDP), and answers frames from group sources",
    "claim": "the Tofino design lets a chunk newer than a slot version's claim it at once and "
    "identifies a chunk by its offset only (the reference refuses such non-conforming chunks "
    "as chunk_mismatch and keeps the held round: docs/tofino.md, Slots)",
    "wide_codes": "the Tofino design decodes codes up to 31 - ceil(log2 N) only, so that N "
    "workers' sums fit its 32-bit lanes",
    "k": f"the Tofino design holds at most {MAX_K} lanes per pass",
    "workers": f"the Tofino design holds at most {MAX_WORKERS} workers per job",
    "uplinks": "the Tofino design adds NC8 uplinks only",
}
"""Each feature the design lacks, and why: a refusal's or a skipped test's one sentence."""


def max_code(total_workers: int) -> int:
    """The largest code the twin's control plane lets a job of ``total_workers`` send: codes
    whose sums over every worker fit a signed 32-bit lane (``N * 2^(c - 1) <= 2^30``)."""
    return min(MAX_CODE, MAX_CODE - (total_workers - 1).bit_length())


def refusal(config: JobConfig, k: int) -> str | None:
    """Why the design cannot run ``config`` on a twin built for ``k`` lanes, or None."""
    job = f"job {config.job}"
    if config.result_format == Format.INT32:
        return f"{job} asks for int32 results: {LACKS['int32']}"
    if config.result_format != Format.INT:
        return f"{job} asks for {config.result_format.name.lower()} results: {LACKS['nc8']}"
    if config.key is not None:
        return f"{job} has a key: {LACKS['tag']}"
    if config.uplink_format != Format.NC8:
        return f"{job} sends {config.uplink_format.name.lower()} uplinks: {LACKS['uplinks']}"
    if config.workers > MAX_WORKERS:
        return f"{job} has {config.workers} workers: {LACKS['workers']}"
    if max(k, config.k) > MAX_K:
        return f"K={max(k, config.k)}: {LACKS['k']}"
    return None
