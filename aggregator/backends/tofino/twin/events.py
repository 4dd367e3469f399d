"""The counters of the Events control (p4/twin/events.p4) and egress's ``job_sent``: one
counter per event kind, each indexed as ``ncina.aggregator.backends.bmv2.layout`` numbers the
events; added up at each index they are the default program's ``job_events``, so
``ncina.aggregator.backends.bmv2.entries`` turns them into the stats document."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ncina.aggregator.backends.bmv2.entries import Counts

JOB_COUNTERS = (
    "NcinaIngress.events.job_in",
    "NcinaIngress.events.job_events",
    "NcinaIngress.events.job_more",
    "NcinaIngress.events.job_retx",
    "NcinaEgress.rewrite.job_sent",
)
GLOBAL_COUNTER = "NcinaIngress.events.global_events"


def add(readings: Iterable[Counts]) -> Counts:
    """Packets and bytes of several counters added up at each index."""
    total: dict[int, tuple[int, int]] = {}
    for counts in readings:
        for index, (packets, frame_bytes) in counts.items():
            before = total.get(index, (0, 0))
            total[index] = (before[0] + packets, before[1] + frame_bytes)
    return total


def job_counts(readings: Mapping[str, Counts]) -> Counts:
    """Every job event's packets and bytes (``readings``: a counter's name -> its readings,
    ``JOB_COUNTERS`` among them, read together)."""
    return add(readings[name] for name in JOB_COUNTERS)
