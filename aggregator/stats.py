"""Aggregator counters and their JSON form: the stats contract every backend writes.

The schema is documented in docs/protocol.md ("Counters"); the key sets below are that schema.
Counters are plain attributes of ``__slots__`` classes so the per-packet path increments them
without creating objects.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

from ncina.aggregator import metrics

SCHEMA = 1

# Drops counted under a job: everything wrong with a packet whose header names a configured job.
JOB_DROP_REASONS = (
    "bad_flags",
    "bad_format",
    "bad_count",
    "bad_length",
    "bad_tag",
    "non_member",
    "window_mismatch",
    "bad_slot",
    "bad_code",
    "bad_payload",
    "chunk_mismatch",
    "stale_generation",
    "late",
    "resend_limit",
)
# Drops counted aggregator-wide: packets that cannot be attributed to a configured job, and
# failures of the aggregator itself (``internal_error``: a bug, logged with its traceback).
GLOBAL_DROP_REASONS = (
    "truncated",
    "bad_version",
    "bad_format",
    "bad_count",
    "bad_length",
    "unknown_job",
    "internal_error",
)
# The job's plain counters, in the order of the JSON document (``drops`` follows them).
JOB_COUNTERS = (
    "packets_in",
    "bytes_in",
    "packets_out",
    "bytes_out",
    "contributions",
    "slots_completed",
    "results_sent",
    "results_resent",
    "duplicates",
    "retx_seen",
    "notices_sent",
    "handshakes",
)


class JobStats:
    """Counters of one job (meanings in docs/protocol.md, "Counters")."""

    __slots__ = (
        "bytes_in",
        "bytes_out",
        "contributions",
        "drops",
        "duplicates",
        "handshakes",
        "notices_sent",
        "packets_in",
        "packets_out",
        "results_resent",
        "results_sent",
        "retx_seen",
        "slots_completed",
    )

    def __init__(self) -> None:
        self.packets_in = 0
        self.bytes_in = 0
        self.packets_out = 0
        self.bytes_out = 0
        self.contributions = 0
        self.slots_completed = 0
        self.results_sent = 0
        self.results_resent = 0
        self.duplicates = 0
        self.retx_seen = 0
        self.notices_sent = 0
        self.handshakes = 0
        self.drops = dict.fromkeys(JOB_DROP_REASONS, 0)

    def to_json(self) -> dict[str, Any]:
        """The job's section of the stats document."""
        doc: dict[str, Any] = {name: getattr(self, name) for name in JOB_COUNTERS}
        doc["drops"] = dict(self.drops)
        return doc


class GlobalStats:
    """Aggregator-wide counters: packets no job can claim, and the aggregator's own failures."""

    __slots__ = ("bytes_in", "drops", "packets_in", "send_errors")

    def __init__(self) -> None:
        self.packets_in = 0
        self.bytes_in = 0
        self.send_errors = 0
        self.drops = dict.fromkeys(GLOBAL_DROP_REASONS, 0)

    def to_json(self) -> dict[str, Any]:
        """The ``global`` section of the stats document."""
        return {
            "packets_in": self.packets_in,
            "bytes_in": self.bytes_in,
            "send_errors": self.send_errors,
            "drops": dict(self.drops),
        }


class LimitStats:
    """What the memory caps refused (docs/protocol.md, "Counters": ``limits``):
    job files past ``--max-jobs``, and server-mode error-feedback residuals past
    ``--max-residual-elements``."""

    __slots__ = ("jobs_refused", "residuals_unkept")

    def __init__(self) -> None:
        self.jobs_refused = 0
        self.residuals_unkept = 0

    def to_json(self) -> dict[str, int]:
        """The ``limits`` section of the stats document."""
        return {"jobs_refused": self.jobs_refused, "residuals_unkept": self.residuals_unkept}


def count_drop(stats: JobStats | GlobalStats, reason: str, size: int) -> None:
    """Count a dropped datagram of ``size`` bytes under ``reason`` (and as received)."""
    stats.packets_in += 1
    stats.bytes_in += size
    stats.drops[reason] += 1


def snapshot(
    *,
    backend: str,
    started: float,
    global_stats: GlobalStats,
    jobs: Mapping[int, JobStats],
    faults: Mapping[str, int] | None = None,
    limits: LimitStats | None = None,
    taken: float | None = None,
) -> dict[str, Any]:
    """The whole stats document at this moment; ``started`` is the backend's start (Unix time).

    ``faults``: the emulated faults' counts, present only when fault injection is on;
    ``limits``: what the memory caps refused, from the backends that have them;
    ``taken``: when reading the counters began (default: now), for a backend whose reads take
    long enough for counts to change meanwhile: ``time`` must not be later than any read, as a
    reader trusts a document of a later ``time`` to hold every count made before that time
    (``ncina.aggregator.process.request_stats``).
    """
    document = {
        "schema": SCHEMA,
        "backend": backend,
        "started": started,
        "time": time.time() if taken is None else taken,
        "global": global_stats.to_json(),
        "jobs": {str(job): stats.to_json() for job, stats in sorted(jobs.items())},
    }
    if faults is not None:
        document["faults"] = dict(faults)
    if limits is not None:
        document["limits"] = limits.to_json()
    return document


def publish(
    document: Mapping[str, Any],
    path: str | os.PathLike[str] | None,
    log: TextIO,
    *,
    periodic: bool = False,
) -> None:
    """Write ``document`` to ``path`` atomically, or without a path print it as one JSON line on
    ``log`` (what ``ncina aggregator`` does with and without ``--stats``), unless ``periodic``
    (the every-interval write, which only the file gets); and make it what the metrics endpoint
    serves (``--metrics-port``, :mod:`ncina.aggregator.metrics`)."""
    metrics.update(document)
    if path is None:
        if not periodic:
            print(json.dumps(document), file=log, flush=True)
    else:
        write_atomically(path, document)


def write_or_say(write: Callable[[bool], None], log: TextIO, *, periodic: bool = False) -> None:
    """``write(periodic)`` (a backend's ``write_stats``), an ``OSError`` logged on ``log`` rather
    than raised: the aggregator goes on serving, and the next write may succeed."""
    try:
        write(periodic)
    except OSError as exc:
        print(f"ncina aggregator: cannot write stats: {exc}", file=log, flush=True)


def write_atomically(path: str | os.PathLike[str], document: Mapping[str, Any]) -> None:
    """Write ``document`` as JSON to ``path`` so that a reader sees the old or the new file, never
    a partial one (a temporary file in the same directory, then ``os.replace``)."""
    target = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as exc:
        raise OSError(f"cannot write stats to {target}: {exc.strerror}") from exc
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(document, f, indent=1)
            f.write("\n")
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise
