"""The checks of ``ncina soak`` (``ncina.bench.soak``) that need no network, shared with its
tests: a rank's metrics file read as it grows, the ranks' digests per checkpoint, the drops the
stranger's datagrams are counted under, memory growth after warm-up, and each failed target.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ncina.common.jsonlines import read_new_events

# Drops an honest worker's packets can cause under loss and restarts; every other reason is
# one the stranger's datagrams (keyed job: parse, job lookup or tag) are counted under.
HONEST_REASONS = ("late", "stale_generation", "resend_limit")
RSS_TOLERANCE = 0.05  # flat memory: growth after warm-up within 5 %


class RankLog:
    """One rank's metrics file, read as it grows: steps, checkpoint digests, the end event."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.steps = 0
        self.digests: dict[str, str] = {}  # checkpoint ("epoch N", "end") -> parameters_sha256
        self.end: dict[str, Any] | None = None

    def poll(self) -> None:
        self.offset, events = read_new_events(self.path, self.offset)
        for event in events:
            if event["event"] == "step":
                self.steps = event["step"]
            elif event["event"] == "epoch":
                self.digests[f"epoch {event['epoch']}"] = event["parameters_sha256"]
            elif event["event"] == "end":
                self.digests["end"] = event["parameters_sha256"]
                self.end = event


def restarted_in_last_step(log: Path, steps: int) -> bool:
    """Whether a rank's log says it met a restart after its step ``steps - 1`` (in its last
    step: the kill aimed at the last bucket landed in its call)."""
    text = log.read_text(errors="replace")
    before = re.search(rf" step {steps - 1} loss ", text)
    return before is not None and "restarted; recovering" in text[before.end():]


def hostile_counted(document: dict[str, Any]) -> int:
    """Drops of every reason but the honest ones (``HONEST_REASONS``), all sections."""
    return sum(count for section in (document["global"], *document["jobs"].values())
               for reason, count in section["drops"].items() if reason not in HONEST_REASONS)


def changed(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    """Every count of two stats documents that grew, ``section.name`` (``jobs.1.drops.late``,
    ``bmv2.ignored``): what a stranger's round left that its drops and handshakes do not say."""

    def flat(value: Any, name: str) -> dict[str, int]:
        if isinstance(value, dict):
            return {k: v for key, item in value.items()
                    for k, v in flat(item, f"{name}.{key}").items()}  # fmt: skip
        return {name: value} if isinstance(value, int) and not isinstance(value, bool) else {}

    b = flat({k: v for k, v in before.items() if isinstance(v, dict)}, "")
    a = flat({k: v for k, v in after.items() if isinstance(v, dict)}, "")
    return {name[1:]: a[name] - b.get(name, 0) for name in a if a[name] > b.get(name, 0)}


def handshakes_of(document: dict[str, Any]) -> int:
    return sum(section["handshakes"] for section in document["jobs"].values())


def checkpoints(ranks: list[RankLog]) -> dict[str, list[str]]:
    """Per checkpoint every rank reached, the ranks' parameter digests in rank order."""
    names = [name for name in ranks[0].digests if all(name in r.digests for r in ranks)]
    return {name: [r.digests[name] for r in ranks] for name in names}


def rss_summary(series: dict[str, list[tuple[float, int]]], warmup_s: float) -> dict[str, Any]:
    """Per process: its samples (s since the soak began, KiB; a rank's from its first step) and
    its growth after warm-up (the largest sample over the first one ``warmup_s`` after its first
    sample, less 1; None with fewer than two samples after warm-up)."""
    out: dict[str, Any] = {}
    for name, samples in series.items():
        start = samples[0][0]
        judged = [kib for t, kib in samples if t - start >= warmup_s]
        growth = max(judged) / judged[0] - 1 if len(judged) >= 2 else None
        out[name] = {"samples": samples, "growth": None if growth is None else round(growth, 4)}
    return out


def judge(summary: dict[str, Any]) -> list[str]:
    """Each failed target, in a sentence."""
    failed = []
    if summary["hangs"]:
        failed.append(f"{len(summary['hangs'])} hang(s): {summary['hangs']}")
    failed += [f"failure: {f}" for f in summary["failures"]]
    if not summary["digests_equal"]:
        failed.append("the ranks' parameter digests differ at a checkpoint")
    if summary["unrecovered_restarts"]:
        failed.append(f"{summary['unrecovered_restarts']} restart(s) never recovered from")
    grown = {n: p["growth"] for n, p in summary["rss"].items()
             if p["growth"] is not None and p["growth"] > RSS_TOLERANCE}  # fmt: skip
    if grown:
        failed.append(f"memory grew more than {RSS_TOLERANCE:.0%} after warm-up: {grown}")
    hostile = summary["hostile"]
    if hostile["uncounted"] or hostile["forged_uncounted"]:
        failed.append(f"hostile datagrams not counted: {hostile['uncounted']} at the "
                      f"aggregator, {hostile['forged_uncounted']} forged results at the "
                      "workers")  # fmt: skip
    return failed


def drawn_generation(log: Path) -> int:
    """The generation an aggregator start names in its readiness line in ``log`` (every
    backend's says ``generation G``), or 0 when the line has none."""
    found = re.search(r"\bgeneration (\d+)\b", log.read_text(errors="replace"))
    return int(found.group(1)) if found else 0
