"""The figures ``ncina bench ddp`` reports of one topology run (``ncina.topo.report``'s
``results.json`` content): INA's and gloo's training rates, the exchange's cost, the losses and
the CPU time, each ratio refused against a baseline that did no work.
"""

from __future__ import annotations

from typing import Any

from ncina.common.ratios import put_ratio, refusal
from ncina.harness.figures import counted_packets, per_element_ns, retx_fraction

DDP_CPU_SPLIT = {"workers": "rank_cpu_s", "aggregator": "aggregator_cpu_s",
                 "unattributed": "unattributed_s"}  # fmt: skip
"""``cpu_ns_per_packet_split``'s parts: the INA run's keys of ``cpu_s``'s parts."""


def ddp_figures(results: dict[str, Any]) -> dict[str, Any]:
    """The benchmark's fields from one topology run's ``results.json`` content."""
    ina, gloo = results["runs"]["ina"], results["runs"]["gloo"]
    backend = results["runs"].get("ncina")
    cpu_s, gloo_cpu_s = ina.get("cpu_s"), gloo.get("cpu_s")
    measured = cpu_s is not None and gloo_cpu_s is not None
    # Every rank all-reduces each parameter's gradient once a step.
    elements = results["config"]["workers"] * ina["parameters"] * ina["steps"] if measured else 0
    figures: dict[str, Any] = {
        "ina_samples_per_s": ina["samples_per_s"],
        "gloo_samples_per_s": gloo["samples_per_s"],
        "speedup": results["comparison"].get("speedup"),
        "comm_total_s": ina["comm_total_s"],
        "exposed_comm_s": ina["exposed_comm_s"],
        "exposed_comm_fraction": ina["exposed_comm_fraction"],
        "initial_test_loss": ina["curve"]["epochs"][0][3],
        "ina_test_loss": ina["final_test_loss"],
        "gloo_test_loss": gloo["final_test_loss"],
        "ina_accuracy": ina.get("final_accuracy"),
        "gloo_accuracy": gloo.get("final_accuracy"),
        "cpu_s": cpu_s,
        "gloo_cpu_s": gloo_cpu_s,
        "cpu_ns_per_element": per_element_ns(cpu_s, 1, elements) if measured else None,
        "gloo_cpu_ns_per_element": per_element_ns(gloo_cpu_s, 1, elements) if measured else None,
        "backend_samples_per_s": backend["samples_per_s"] if backend else None,
        "backend_accuracy": backend["final_accuracy"] if backend else None,
        "backend_over_hook": results["comparison"].get("backend_over_hook"),
        "retx_fraction": retx_fraction([ina["fabric"]]) if ina.get("fabric") else None,
    }
    figures |= per_packet(ina, cpu_s if measured else None)
    if "exposed_comm_error" in ina:  # exposed_comm_fraction above 1: not a figure to quote
        figures["exposed_comm_error"] = ina["exposed_comm_error"]
    if measured:
        put_ratio(figures, "cpu_vs_gloo", cpu_s, gloo_cpu_s, refusal(gloo_cpu_s))
    else:
        figures["cpu_vs_gloo"] = None
    return figures


def per_packet(ina: dict[str, Any], cpu_s: float | None) -> dict[str, Any]:
    """``packets`` the INA training run's ranks moved (``counted_packets`` of their summed
    client stats), ``cpu_s`` over them in ns and its parts (:data:`DDP_CPU_SPLIT`) over them;
    None where a count or a CPU time is missing."""
    packets = counted_packets(ina["fabric"]) if ina.get("fabric") else None
    if cpu_s is None or not packets or any(ina.get(k) is None for k in DDP_CPU_SPLIT.values()):
        return {"packets": packets, "cpu_ns_per_packet": None, "cpu_ns_per_packet_split": None}
    return {"packets": packets, "cpu_ns_per_packet": round(cpu_s * 1e9 / packets, 1),
            "cpu_ns_per_packet_split": {name: round(ina[key] * 1e9 / packets, 1)
                                        for name, key in DDP_CPU_SPLIT.items()}}  # fmt: skip
