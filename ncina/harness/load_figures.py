"""The figures of an aggregator under the load generator (``ncina bench aggregator``): one
measurement's rates of completed work, the median of repeated ones, and a ratio of two
measurements' completed work that refuses a baseline which did none.
"""

from __future__ import annotations

from typing import Any

from ncina.common.ratios import put_ratio, refusal
from ncina.harness.figures import median_repeat


def load_figures(st: Any, *, slots_completed: int, k: int, lcores: int) -> dict[str, Any]:
    """One measurement's figures from the load generator's counters ``st`` (``struct
    ncd_gen_stats``) and the slots the aggregator completed meanwhile (a forwarder's count is
    whatever its stats say: none). Work is what came back answered: ``completed_per_s``, the
    chunks whose reply (a result, or a forwarder's echo) reached their rank, and
    ``elements_per_s``, K elements each; ``packets_per_s`` is the send rate, retransmitted
    copies included, which is no measure of work."""
    secs = st.seconds
    return {
        "lcores": lcores,
        "packets_per_s": round(st.sent / secs),
        "replies_per_s": round(st.received / secs),
        "completed_per_s": round(st.completed / secs),
        "elements_per_s": round(st.completed * k / secs),
        "slots_completed_per_s": round(slots_completed / secs),
        "retransmit_rounds": int(st.retransmit_rounds),
        "send_errors": int(st.send_errors),
    }


def put_work_ratio(
    figures: dict[str, Any], name: str, measured: dict[str, Any], baseline: dict[str, Any]
) -> None:
    """``figures[name]``: the ``measured`` run's completed work over the ``baseline``'s
    (``completed_per_s``, three significant digits: a BMv2 switch runs at a few thousandths of
    the others), or None and ``<name>_refused`` when the baseline failed, completed nothing or
    retransmitted, or the measured run failed (``ncina.common.ratios.put_ratio``)."""
    work = baseline.get("completed_per_s", 0)
    refused = refusal(work, retransmissions=baseline.get("retransmit_rounds", 0),
                      error=baseline.get("error"))  # fmt: skip
    if refused is None and "error" in measured:
        refused = f"the measured run failed: {measured['error']}"
    put_ratio(figures, name, measured.get("completed_per_s", 0), work, refused)


def median_run(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median completed work (``completed_per_s``, the lower middle of an even
    count), with every run's completed and sent rates; a failed run makes the whole figure
    that of a failure (``error``: the first run's that failed, ``failed_runs``: how many)."""
    failed = [r for r in results if "error" in r]
    if failed:
        return {**failed[0], "failed_runs": len(failed)}
    return {**median_repeat(results, "completed_per_s"),
            "completed_per_s_runs": [r["completed_per_s"] for r in results],
            "packets_per_s_runs": [r["packets_per_s"] for r in results]}  # fmt: skip


def put_ratios(figures: dict[str, Any], backend: str, lcores: tuple[int, ...]) -> None:
    """The run's ratios into ``figures`` (which holds each kind's median run): the measured
    ``backend``'s completed work over the Python backend's, the no-op forwarder's and, for
    bmv2, the echo program's on the same switch (``vs_forwarder``); with several ``lcores``,
    each DPDK kind's scaling. A dead baseline's ratio is None and ``<ratio>_refused``."""
    forward = "socket_forward" if backend == "socket" else "forward"
    measured = figures[backend]
    figures["noop_forwarder"] = forward
    ratios = [("vs_python", "python"), ("vs_noop_forwarder", forward)]
    if backend == "bmv2":  # how close it comes to what BMv2 itself forwards
        ratios.append(("vs_forwarder", "bmv2_forward"))
    for name, other in ratios:
        put_work_ratio(figures, name, measured, figures[other])
    if len(lcores) > 1:
        first, last = lcores[0], lcores[-1]
        for kind, key in (("dpdk", "lcores_scaling"), ("forward", "forwarder_lcores_scaling")):
            put_work_ratio(figures, key, figures[f"{kind}_lcores{last}"], figures[kind])
        figures["lcores_scaling_of"] = f"{last} vs {first}"
