"""The figures of repeated timed all-reduce runs (``ncina bench allreduce``, ``bench fabric``).

A run is a dict of its own values: ``wall_s`` and ``gloo_wall_s`` (the INA and gloo
all-reduce's wall times), ``cpu_s`` and ``gloo_cpu_s`` (the CPU-seconds each side spent:
``ncina.common.cpu``), ``exact`` and ``exact_mismatches`` (against
``ncina.harness.reference``), ``peak_rss`` and ``gloo_peak_rss`` (per rank, bytes),
``retx_fraction`` (:func:`retx_fraction` of its workers' stats) and optionally ``extra``
figures of the benchmark. The reported figure of a time is the lower median over the runs, a
measured value, never an average of two; a ratio is that of the medians, and
``<ratio>_spread`` gives the minimum, median and maximum of the runs' own ratios, so that a
figure from this noisy machine is never quoted without its spread.

A ratio against a baseline is of completed work (replies, completed slots, finished
all-reduces), and only of a baseline that did its work (``ncina.common.ratios``).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from ncina.common.ratios import put_ratio, ratio, refusal, spread


def medians(repeats: Sequence[dict[str, Any]], *, workers: int, elements: int) -> dict[str, Any]:
    """The figures every all-reduce benchmark reports, from its runs (``workers`` ranks of
    ``elements`` each): lower medians over the runs of the times, ratios and peak memory,
    ``exact`` over all runs, and every run's own values."""
    median = statistics.median_low
    wall = median(r["wall_s"] for r in repeats)
    gloo = median(r["gloo_wall_s"] for r in repeats)
    cpu = median(r["cpu_s"] for r in repeats)
    gloo_cpu = median(r["gloo_cpu_s"] for r in repeats)
    ranks = range(workers)
    figures = {
        "wall_s": round(wall, 6),
        "gloo_wall_s": round(gloo, 6),
        "vs_gloo_spread": spread(ratio(r["wall_s"], r["gloo_wall_s"]) for r in repeats),
        "cpu_s": round(cpu, 3),
        "gloo_cpu_s": round(gloo_cpu, 3),
        "cpu_vs_gloo_spread": spread(ratio(r["cpu_s"], r["gloo_cpu_s"]) for r in repeats),
        "cpu_ns_per_element": per_element_ns(cpu, workers, elements),
        "gloo_cpu_ns_per_element": per_element_ns(gloo_cpu, workers, elements),
        "elements_per_s": round(elements / wall),
        "exact": all(r["exact"] for r in repeats),
        "retx_fraction": median(r["retx_fraction"] for r in repeats),
        "retx_fraction_spread": spread(r["retx_fraction"] for r in repeats),
        "peak_rss": [median(r["peak_rss"][i] for r in repeats) for i in ranks],
        "gloo_peak_rss": [median(r["gloo_peak_rss"][i] for r in repeats) for i in ranks],
        "input_bytes": 4 * elements,
        "peak_rss_over_input": ratio(max(max(r["peak_rss"]) for r in repeats), 4 * elements),
        "runs": [run_values(r, elements) for r in repeats],
    }
    # gloo's all-reduce finished (a failed one raises): its time and CPU are the yardsticks
    put_ratio(figures, "vs_gloo", wall, gloo, refusal(gloo))
    put_ratio(figures, "cpu_vs_gloo", cpu, gloo_cpu, refusal(gloo_cpu))
    return figures


def faithful_bandwidths(
    rows: Sequence[dict[str, Any]], values: Sequence[int], threshold: float, key: str = "mtu"
) -> dict[str, float | None]:
    """Per value of the rows' ``key`` (the MTU, or the packet's K; a string key, as JSON has
    it), the highest ``bw_mbit`` among ``rows`` whose ``link_fraction`` reached ``threshold``
    (None: no row did): the fastest link a machine emulates with its own software out of the
    way."""
    return {
        str(value): max((r["bw_mbit"] for r in rows
                         if r[key] == value and r["link_fraction"] >= threshold), default=None)
        for value in values
    }  # fmt: skip


def ina_advantage(workers: int) -> dict[str, float]:
    """INA's two causes of fewer bytes on a worker's uplink than gloo's ring all-reduce of
    float32: ``compression``, 4 bytes of float32 over NC8's 1 an element (headers aside), and
    ``aggregation`` in the network, the 2 (N - 1) / N tensors a ring sends per worker over the
    one INA sends (the switch adds); ``bytes_ratio`` is their product (6 at N = 4) and
    ``ideal_vs_gloo`` its inverse, INA's time over gloo's when both fill their links."""
    compression = 4 / 1
    aggregation = 2 * (workers - 1) / workers
    return {"compression": compression, "aggregation": aggregation,
            "bytes_ratio": compression * aggregation,
            "ideal_vs_gloo": round(1 / (compression * aggregation), 4)}  # fmt: skip


def retx_fraction(stats: Iterable[dict[str, Any]]) -> float:
    """Retransmissions over packets sent, summed over workers' client stats: the share of the
    datagrams on the wire that were copies (0 when nothing was sent)."""
    retransmitted = sent = 0
    for one in stats:
        retransmitted += one["retransmissions"]
        sent += one["packets_sent"]
    return round(retransmitted / sent, 5) if sent else 0.0


def per_element_ns(cpu_s: float, workers: int, elements: int) -> float:
    """CPU nanoseconds per element each rank all-reduced (``workers`` ranks of ``elements``)."""
    return round(cpu_s * 1e9 / (workers * elements), 2)


def job_packets(workers: int, elements: int, k: int, retransmissions: int) -> int:
    """The datagrams an all-reduce job moved: each of the ``workers`` ranks sends every chunk of
    its ``elements`` (``k`` to a chunk) once and gets its result once (2 directions), plus the
    ``retransmissions`` (copies the ranks sent, all together). The aggregator's resent results
    and a tree's leaf-to-spine datagrams are not in it: it is the job's work in packets."""
    return 2 * workers * -(-elements // k) + retransmissions


def counted_packets(stats: dict[str, Any]) -> int:
    """:func:`job_packets` from the ranks' own counters (their client stats summed:
    ``packets_sent``, copies included, and ``retransmissions``), where the chunk count is not
    known beforehand (DDP's buckets): each first send up has its one result down."""
    return 2 * stats["packets_sent"] - stats["retransmissions"]


CPU_SPLIT = {"workers": "worker_cpu", "aggregator": "aggregator_cpu",
             "unattributed": "unattributed_s"}  # fmt: skip
"""The parts of a run's ``cpu_s`` (each CPU-second once, ``ncina.common.cpu``): its name in
``cpu_ns_per_packet_split`` and the run's key that holds it."""


def per_packet(repeats: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``cpu_ns_per_packet``: the run of median ``cpu_s``'s CPU over the datagrams it moved
    (``packets``: :func:`job_packets`), and ``cpu_ns_per_packet_split``, that CPU's parts
    (:data:`CPU_SPLIT`) per packet, which add up to it (rounding aside); ``packets`` of that
    run. A run is a dict with ``cpu_s``, ``packets`` and the keys of :data:`CPU_SPLIT`."""
    chosen = median_repeat(repeats, "cpu_s")
    packets = chosen["packets"]

    def ns(seconds: float) -> float | None:
        return round(seconds * 1e9 / packets, 1) if packets > 0 else None

    return {
        "packets": packets,
        "cpu_ns_per_packet": ns(chosen["cpu_s"]),
        "cpu_ns_per_packet_split": {name: ns(chosen[key]) for name, key in CPU_SPLIT.items()},
    }


def run_values(r: dict[str, Any], elements: int) -> dict[str, Any]:
    """One run's own values of the median figures (and its ``extra`` ones)."""
    return {
        "wall_s": round(r["wall_s"], 6),
        "gloo_wall_s": round(r["gloo_wall_s"], 6),
        "vs_gloo": ratio(r["wall_s"], r["gloo_wall_s"]),
        "cpu_s": round(r["cpu_s"], 3),
        "gloo_cpu_s": round(r["gloo_cpu_s"], 3),
        "cpu_vs_gloo": ratio(r["cpu_s"], r["gloo_cpu_s"]),
        "elements_per_s": round(elements / r["wall_s"]),
        "exact": r["exact"],
        "exact_mismatches": r["exact_mismatches"],
        "retx_fraction": r["retx_fraction"],
        "peak_rss": r["peak_rss"],
        "gloo_peak_rss": r["gloo_peak_rss"],
        **r.get("extra", {}),
    }


def median_repeat(repeats: Sequence[dict[str, Any]], key: str = "wall_s") -> dict[str, Any]:
    """The run of the lower-median ``key`` (by default the INA wall time)."""
    return sorted(repeats, key=lambda r: r[key])[(len(repeats) - 1) // 2]


def conditions(backend: str, mtu: int, loopback_mtu: int) -> dict[str, Any]:
    """The path and packet size each side of ``bench allreduce`` runs over, and what differs
    (``conditions_differ``, empty when nothing): gloo always runs on loopback, whose MTU
    (``loopback_mtu``, 65,536 by default) lets its TCP segments grow far beyond the ``mtu`` the
    INA datagrams are sized for; with the dpdk backend INA also goes through a veth and a
    bridge to the aggregator's namespace. ``bench fabric`` runs both over the same links."""
    ina_path = "veth and bridge" if backend == "dpdk" else "loopback"
    differ = []
    if ina_path != "loopback":
        differ.append(f"path: INA through a {ina_path}, gloo on loopback")
    if loopback_mtu != mtu:
        differ.append(f"mtu: INA's datagrams fit {mtu} bytes, gloo's TCP segments loopback's "
                      f"{loopback_mtu}")  # fmt: skip
    return {"ina_path": ina_path, "gloo_path": "loopback", "ina_mtu": mtu,
            "gloo_mtu": loopback_mtu, "conditions_differ": differ}  # fmt: skip
