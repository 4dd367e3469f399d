"""Every benchmark's ratios are of completed work, and refuse a dead baseline (issue 40).

Each benchmark's ratio code is fed a baseline that answered nothing, retransmitted or failed
(no root: the functions that compute the figures, with the counters such a run leaves): the
ratio is None and ``<ratio>_refused`` says why. The dead forwarder is issue 36's: replies 0,
39 retransmission rounds, 5,117 packets/s sent, printed as ``vs_noop_forwarder`` 42.6.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from ncina.topo import report

from ncina.common.ratios import put_ratio, refusal
from ncina.harness.ddp_figures import ddp_figures
from ncina.harness.faults import Run, vs_lossless
from ncina.harness.figures import medians
from ncina.harness.load_figures import load_figures, median_run, put_work_ratio

K = 64


def load(sent: int, received: int, completed: int, rounds: int = 0) -> dict[str, Any]:
    """bench aggregator's figures of a 1-second load (the generator's counters)."""
    st = SimpleNamespace(sent=sent, received=received, completed=completed, send_errors=0,
                         retransmit_rounds=rounds, seconds=1.0)  # fmt: skip
    return load_figures(st, slots_completed=completed // 4, k=K, lcores=1)


AGGREGATOR = load(201_000, 201_000, 200_000)
DEAD_FORWARDER = load(5_117, 0, 0, rounds=39)


def test_work_is_what_came_back_not_what_was_sent() -> None:
    assert DEAD_FORWARDER["packets_per_s"] == 5_117
    assert DEAD_FORWARDER["completed_per_s"] == 0 and DEAD_FORWARDER["elements_per_s"] == 0
    assert AGGREGATOR["elements_per_s"] == 200_000 * K


@pytest.mark.parametrize(
    ("baseline", "reason"),
    [
        (DEAD_FORWARDER, "the baseline completed nothing"),
        (load(250_000, 250_000, 249_000, rounds=1), "the baseline retransmitted (1)"),
        ({"lcores": 1, "error": "RuntimeError: no readiness line"},
         "the baseline failed: RuntimeError: no readiness line"),
    ],
    ids=["answered-nothing", "retransmitted", "failed"],
)  # fmt: skip
def test_bench_aggregator_refuses_a_dead_baseline(baseline: dict[str, Any], reason: str) -> None:
    figures: dict[str, Any] = {}
    for name in ("vs_noop_forwarder", "vs_forwarder", "forwarder_lcores_scaling"):
        put_work_ratio(figures, name, AGGREGATOR, baseline)
        assert figures[name] is None
        assert figures[f"{name}_refused"] == reason


def test_bench_aggregator_ratio_of_a_live_baseline_is_of_completed_work() -> None:
    figures: dict[str, Any] = {}
    forwarder = load(400_000, 180_000, 160_000)  # sends more than it gets answered
    put_work_ratio(figures, "vs_noop_forwarder", AGGREGATOR, forwarder)
    assert figures == {"vs_noop_forwarder": 1.25}  # 200k / 160k, not 201k / 400k
    put_work_ratio(figures, "vs_python", {"lcores": 1, "error": "x"}, forwarder)
    assert figures["vs_python"] is None
    assert figures["vs_python_refused"] == "the measured run failed: x"


def test_bench_aggregator_median_run_is_by_completed_work_and_a_failure_shows() -> None:
    runs = [load(9_000, 100, 100, rounds=5), load(1_000, 900, 900), load(2_000, 500, 500)]
    median = median_run(runs)
    assert median["completed_per_s"] == 500
    assert median["completed_per_s_runs"] == [100, 900, 500]
    failed = median_run([runs[0], {"lcores": 1, "error": "boom"}])
    assert failed["error"] == "boom" and failed["failed_runs"] == 1


def allreduce_run(gloo_wall_s: float, gloo_cpu_s: float) -> dict[str, Any]:
    return {"wall_s": 0.2, "gloo_wall_s": gloo_wall_s, "cpu_s": 0.5, "gloo_cpu_s": gloo_cpu_s,
            "exact": True, "exact_mismatches": 0, "retx_fraction": 0.0, "peak_rss": [1],
            "gloo_peak_rss": [1]}  # fmt: skip


def test_bench_allreduce_and_fabric_refuse_a_gloo_that_did_nothing() -> None:
    dead = medians([allreduce_run(0.0, 0.0)], workers=1, elements=10)
    assert dead["vs_gloo"] is None and dead["cpu_vs_gloo"] is None
    assert dead["vs_gloo_refused"] == dead["cpu_vs_gloo_refused"] == (
        "the baseline completed nothing")
    assert dead["vs_gloo_spread"] is None
    live = medians([allreduce_run(0.1, 0.25)], workers=1, elements=10)
    assert (live["vs_gloo"], live["cpu_vs_gloo"]) == (2.0, 2.0)
    assert "vs_gloo_refused" not in live


def summary(samples_per_s: float, train_s: float, cpu_s: float = 1.0) -> dict[str, Any]:
    return {"bytes_per_worker": 1e6, "train_s": train_s, "samples_per_s": samples_per_s,
            "final_accuracy": 50.0, "cpu_s": cpu_s}  # fmt: skip


def test_topo_report_refuses_a_baseline_that_trained_nothing() -> None:
    comparison = report.compare({"ina": summary(100.0, 2.0), "gloo": summary(0.0, 0.0)})
    assert comparison["speedup"] is None and comparison["time_ratio"] is None
    assert comparison["speedup_refused"] == "the baseline completed nothing"


def test_topo_report_gives_every_repeat_and_one_window() -> None:
    """``--repeat 3``: each ratio's median and spread over all repeats (not the first's), and
    speedup the inverse of time_ratio (one window, ``train_s``)."""
    repeats = {"ina": [summary(300.0, 1.0), summary(200.0, 1.5), summary(100.0, 3.0)],
               "gloo": [summary(100.0, 3.0)] * 3}  # fmt: skip
    comparisons = report.compare_repeats(repeats)
    assert [c["speedup"] for c in comparisons] == [3.0, 2.0, 1.0]
    assert all(c["speedup"] == pytest.approx(1 / c["time_ratio"], rel=2e-3) for c in comparisons)
    got = report.summarize_comparisons(comparisons)
    assert got["speedup"] == 2.0
    assert got["speedup_spread"] == {"min": 1.0, "median": 2.0, "max": 3.0}
    assert got["time_ratio_spread"] == {"min": 0.333, "median": 0.5, "max": 1.0}
    dead = report.summarize_comparisons(report.compare_repeats(
        {"ina": [summary(1.0, 1.0)], "gloo": [summary(0.0, 0.0)]}))  # fmt: skip
    assert dead["speedup"] is None and dead["speedup_refused"] == "the baseline completed nothing"


def test_exposed_communication_is_not_capped_and_above_one_is_an_error() -> None:
    """The run that hid 0.083 s exposed of 0.064 s communication behind a fraction of 1.0."""
    over = report.exposure(0.083, 0.064)
    assert over["exposed_comm_fraction"] == pytest.approx(0.083 / 0.064)
    assert "measurement error" in over["exposed_comm_error"]
    assert "exposed_comm_error" not in report.exposure(0.03, 0.064)


def test_bench_ddp_refuses_a_gloo_run_of_no_cpu_and_carries_the_exposure_error() -> None:
    epochs = [[0.0, 0, 10.0, 2.3]]
    ina = {"samples_per_s": 10.0, "comm_total_s": 0.064, "exposed_comm_s": 0.083,
           "exposed_comm_fraction": 1.3, "exposed_comm_error": "measurement error: ...",
           "curve": {"epochs": epochs}, "final_test_loss": 2.0, "cpu_s": 3.0,
           "parameters": 10, "steps": 2}  # fmt: skip
    gloo = {"samples_per_s": 5.0, "final_test_loss": 2.1, "cpu_s": 0.0}
    got = ddp_figures({"runs": {"ina": ina, "gloo": gloo}, "comparison": {"speedup": 2.0},
                       "config": {"workers": 2}})  # fmt: skip
    assert got["cpu_vs_gloo"] is None and got["cpu_vs_gloo_refused"]
    assert got["exposed_comm_error"] == "measurement error: ..."


def test_bench_reliability_refuses_a_lossless_run_that_retransmitted() -> None:
    def lossless(retransmissions: int) -> Run:
        return Run([np.zeros(1)], [{"retransmissions": retransmissions}], {}, 0.5)

    assert vs_lossless(1.0, lossless(0)) == {"time_vs_lossless": 2.0}
    refused = vs_lossless(1.0, lossless(3))
    assert refused == {"time_vs_lossless": None,
                       "time_vs_lossless_refused": "the baseline retransmitted (3)"}


def test_put_ratio_refuses_a_baseline_of_nothing_even_unasked() -> None:
    figures: dict[str, Any] = {}
    put_ratio(figures, "x", 1.0, 0.0, None)
    assert figures == {"x": None, "x_refused": "the baseline completed nothing"}
    assert refusal(float("nan")) == "the baseline completed nothing"


def test_topo_report_compares_the_tofino_profile_with_the_same_baseline() -> None:
    """``make topo PROFILE=tofino``: the profile's run gets its own ratios against the gloo run
    the default profile's are against; on BMv2 (the twin only) it has them alone."""
    tofino = summary(150.0, 2.0) | {"bytes_per_worker": 3e6, "final_accuracy": 49.0}
    runs = {"ina": summary(300.0, 1.0), "tofino": tofino, "gloo": summary(100.0, 3.0)}
    both = report.compare(runs)
    assert (both["speedup"], both["tofino_speedup"]) == (3.0, 1.5)
    assert (both["bytes_ratio"], both["tofino_bytes_ratio"]) == (1.0, 3.0)
    assert both["tofino_accuracy_delta"] == -1.0
    alone = report.compare({"tofino": tofino, "gloo": summary(100.0, 3.0)})
    assert alone == {"tofino_bytes_ratio": 3.0, "tofino_speedup": 1.5,
                     "tofino_accuracy_delta": -1.0}  # fmt: skip
    assert report.LABELS["tofino"] == "INA tofino"
