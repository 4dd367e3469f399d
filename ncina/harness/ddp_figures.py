"""The figures ``ncina bench ddp`` reports of one topology run (``ncina.topo.report``'s
``results.json`` content): INA's and gloo's training rates, the exchange's cost, the losses and
the CPU time, each ratio refused against a baseline that did no work.
"""

from __future__ import annotations

from typing import Any

from ncina.common.ratios import put_ratio, refusal
from ncina.harness.figures import per_element_ns, retx_fraction


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
    if "exposed_comm_error" in ina:  # exposed_comm_fraction above 1: not a figure to quote
        figures["exposed_comm_error"] = ina["exposed_comm_error"]
    if measured:
        put_ratio(figures, "cpu_vs_gloo", cpu_s, gloo_cpu_s, refusal(gloo_cpu_s))
    else:
        figures["cpu_vs_gloo"] = None
    return figures
