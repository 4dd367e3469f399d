"""``ncina aggregator --metrics-port PORT``: the stats document in Prometheus' text format.

Every backend publishes its stats document (:func:`ncina.aggregator.stats.publish`) every
``--stats-interval`` seconds while metrics are served (and on SIGUSR1 and at exit); the last one
published is what a scrape sees, so the endpoint and the ``--stats`` file always agree, on the
bmv2 backend too (its document comes from the switch's counters through its control plane).

One metric family per counter of the document, named ``ncina_<counter>_total`` (docs/protocol.md,
"Counters"), with the labels ``job`` (the job id, or ``global`` for the aggregator-wide section
and ``limits``/``faults``) and ``reason`` (the drop reason of ``ncina_drops_total``; empty for
the other counters). The I/O section of the socket and dpdk backends becomes
``ncina_<backend>_<counter>_total`` with ``job="global"`` (the dpdk backend's per-lane
counters, a list in the document, are not exported: their sums are). Prometheus renames a
target's own ``job`` label to ``exported_job`` unless the scrape config sets
``honor_labels: true`` (docs/deploy.md). One gauge, ``ncina_stats_time_seconds``, is the
document's ``time`` (Unix time its counters were read): a reader that also reads the ``--stats``
file knows from it whether the two are the same document.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

GLOBAL = "global"


class StatsCollector(Collector):
    """The counters of the last stats document published (none before the first)."""

    def __init__(self) -> None:
        self.document: Mapping[str, Any] | None = None

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        document = self.document
        if document is None:
            return
        families: dict[str, CounterMetricFamily] = {}

        def add(name: str, job: str, reason: str, value: Any) -> None:
            if isinstance(value, bool) or not isinstance(value, int | float):
                return
            family = families.get(name)
            if family is None:
                family = families[name] = CounterMetricFamily(
                    f"ncina_{name}", f"ncina aggregator counter {name} (docs/protocol.md)",
                    labels=["job", "reason"])  # fmt: skip
            family.add_metric([job, reason], value)

        def section(prefix: str, job: str, counters: Mapping[str, Any]) -> None:
            for name, value in counters.items():
                if name == "drops" and isinstance(value, Mapping):
                    for reason, count in value.items():
                        add(f"{prefix}drops", job, reason, count)
                else:
                    add(f"{prefix}{name}", job, "", value)

        section("", GLOBAL, document.get("global", {}))
        for job, counters in document.get("jobs", {}).items():
            section("", str(job), counters)
        for name in ("limits", "faults"):
            section("", GLOBAL, document.get(name) or {})
        backend = document.get("backend")
        io = document.get(backend) if isinstance(backend, str) else None
        if isinstance(io, Mapping):
            section(f"{backend}_", GLOBAL, io)
        yield from families.values()
        taken = document.get("time")
        if isinstance(taken, int | float):
            yield GaugeMetricFamily("ncina_stats_time_seconds",
                                    "Unix time the published stats document's counters were read",
                                    value=taken)  # fmt: skip


_collector: StatsCollector | None = None


def serve(port: int, host: str = "0.0.0.0") -> StatsCollector:
    """Serve the metrics on ``host:port`` (a daemon thread) from now on; returns the collector
    :func:`update` feeds. ``OSError`` when the port cannot be bound."""
    global _collector
    collector = StatsCollector()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    try:
        start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise OSError(f"cannot serve metrics on {host}:{port}: {exc.strerror}") from exc
    _collector = collector
    return collector


def serving() -> bool:
    """Whether metrics are served (the backends then publish every interval)."""
    return _collector is not None


def update(document: Mapping[str, Any]) -> None:
    """Make ``document`` what the next scrape sees (nothing when metrics are not served)."""
    if _collector is not None:
        _collector.document = document
