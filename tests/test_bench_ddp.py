"""``ncina bench ddp``: its fields from topology runs (the runs stubbed, the command real), and
one small real run (root)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ncina.cli import main

FIELDS = ("ina_samples_per_s", "gloo_samples_per_s", "speedup", "comm_total_s",
          "exposed_comm_s", "exposed_comm_fraction")  # fmt: skip
"""The figures ``bench ddp`` reports, medians over the runs and each run's own."""


def topology_results(
    ina: float, gloo: float, comm: float | None = 4.0, backend: float | None = None,
    cpu: tuple[float | None, float] = (20.0, 40.0), losses: tuple[float, float] = (0.5, 0.6),
) -> dict[str, Any]:  # fmt: skip
    """What ``ncina topo``'s runner returns for a training run (results.json), in part: 2
    workers, a model of 1000 parameters, 5 steps from a test loss of 2.3; ``backend``: the
    samples/s of the ncina backend's run (``--torch-backend``), if any; ``cpu``: each side's
    CPU-seconds; ``losses``: each side's final test loss."""
    results: dict[str, Any] = {
        "config": {"workers": 2},
        "runs": {
            "ina": {"samples_per_s": ina, "comm_total_s": comm, "exposed_comm_s": 1.0,
                    "exposed_comm_fraction": 0.25, "final_accuracy": 90.0,
                    "final_test_loss": losses[0], "curve": {"epochs": [[0.0, 0, 10.0, 2.3]]},
                    "parameters": 1000, "steps": 5, "cpu_s": cpu[0],
                    **({"rank_cpu_s": cpu[0] / 2, "aggregator_cpu_s": cpu[0] / 4,
                        "unattributed_s": cpu[0] / 4} if cpu[0] is not None else {}),
                    "fabric": {"packets_sent": 1000, "retransmissions": int(ina)}},
            "gloo": {"samples_per_s": gloo, "comm_total_s": None, "exposed_comm_s": 3.0,
                     "exposed_comm_fraction": None, "final_accuracy": 91.0,
                     "final_test_loss": losses[1], "cpu_s": cpu[1]},
        },
        "comparison": {"speedup": ina / gloo},
    }  # fmt: skip
    if backend is not None:
        results["runs"]["ncina"] = {"samples_per_s": backend, "final_accuracy": 89.0}
        results["comparison"]["backend_over_hook"] = backend / ina
    return results


def bench_ddp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
              results: list[dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    """The figures ``ncina bench ddp --repeat N`` writes when its N topology runs give
    ``results`` (no network is built)."""
    given = iter(results)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr("ncina.topo.runner.run_topology", lambda cfg: next(given))
    output = tmp_path / "ddp.jsonl"
    assert main(["bench", "ddp", "--model", "mlp", "--workers", "2", "--repeat",
                 str(len(results)), "--k", "256", "--pool-size", "16", "--workdir",
                 str(tmp_path / "runs"), "--output", str(output)]) == 0  # fmt: skip
    [line] = output.read_text().splitlines()
    return json.loads(line)


def test_fields_and_medians(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    line = bench_ddp(tmp_path, monkeypatch, [topology_results(30.0, 10.0),
                                             topology_results(20.0, 10.0),
                                             topology_results(50.0, 20.0)])  # fmt: skip
    first = line["runs"][0]
    assert {f: first[f] for f in FIELDS} == {
        "ina_samples_per_s": 30.0, "gloo_samples_per_s": 10.0, "speedup": 3.0,
        "comm_total_s": 4.0, "exposed_comm_s": 1.0, "exposed_comm_fraction": 0.25,
    }  # fmt: skip
    assert (line["ina_samples_per_s"], line["gloo_samples_per_s"], line["speedup"]) == (30, 10, 2.5)
    # Retransmissions over packets sent: 30, 20 and 50 of 1000.
    assert [run["retx_fraction"] for run in line["runs"]] == [0.03, 0.02, 0.05]
    assert line["retx_fraction"] == 0.03
    assert (line["repeat"], line["k"], line["pool_size"]) == (3, 256, 16)
    assert line["backend_samples_per_s"] is None and line["backend_over_hook"] is None


def test_cpu_fields_and_spreads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    line = bench_ddp(tmp_path, monkeypatch, [topology_results(30.0, 10.0, cpu=(20.0, 40.0)),
                                             topology_results(20.0, 10.0, cpu=(30.0, 40.0)),
                                             topology_results(50.0, 20.0, cpu=(10.0, 40.0))])
    first = line["runs"][0]
    # 20 CPU-seconds over 2 workers x 1000 gradient elements x 5 steps: 2 ms an element
    assert (first["cpu_s"], first["gloo_cpu_s"], first["cpu_vs_gloo"]) == (20.0, 40.0, 0.5)
    assert (first["cpu_ns_per_element"], first["gloo_cpu_ns_per_element"]) == (2e6, 4e6)
    assert (line["cpu_s"], line["gloo_cpu_s"], line["cpu_vs_gloo"]) == (20.0, 40.0, 0.5)
    assert line["cpu_vs_gloo_spread"] == {"min": 0.25, "median": 0.5, "max": 0.75}
    assert line["speedup_spread"] == {"min": 2.0, "median": 2.5, "max": 3.0}
    assert line["exposed_comm_fraction_spread"] == {"min": 0.25, "median": 0.25, "max": 0.25}
    # Issue 36: 1000 sent with 30 copies: 970 chunks up and their 970 results down, + 30
    assert first["packets"] == 2 * 1000 - 30 == 1970
    assert first["cpu_ns_per_packet"] == round(20.0 * 1e9 / 1970, 1)
    assert first["cpu_ns_per_packet_split"] == {
        "workers": round(10.0 * 1e9 / 1970, 1), "aggregator": round(5.0 * 1e9 / 1970, 1),
        "unattributed": round(5.0 * 1e9 / 1970, 1)}
    assert line["cpu_ns_per_packet"] == first["cpu_ns_per_packet"]  # the median run's (20 s)


def test_loss_and_accuracy_of_both_sides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    line = bench_ddp(tmp_path, monkeypatch, [topology_results(30.0, 10.0),
                                             topology_results(20.0, 10.0, losses=(0.7, 0.8))])
    assert (line["initial_test_loss"], line["ina_test_loss"], line["gloo_test_loss"]) == (
        2.3, 0.6, 0.7)  # fmt: skip
    assert (line["ina_accuracy"], line["gloo_accuracy"]) == (90.0, 91.0)
    assert line["loss_fell"] is True
    (tmp_path / "diverged").mkdir()
    line = bench_ddp(tmp_path / "diverged", monkeypatch,
                     [topology_results(30.0, 10.0, losses=(0.5, 2.4))])
    assert line["loss_fell"] is False  # gloo's run diverged


def test_a_run_without_cpu_times_has_no_cpu_figures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    line = bench_ddp(tmp_path, monkeypatch, [topology_results(30.0, 10.0, cpu=(None, 40.0))])
    assert line["cpu_s"] is None and line["cpu_vs_gloo"] is None
    assert line["cpu_vs_gloo_spread"] is None and line["cpu_ns_per_element"] is None
    assert line["cpu_ns_per_packet"] is None and line["runs"][0]["cpu_ns_per_packet_split"] is None


def test_the_backend_beside_the_hook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    line = bench_ddp(tmp_path, monkeypatch, [topology_results(30.0, 10.0, backend=15.0),
                                             topology_results(20.0, 10.0, backend=20.0)])
    assert (line["backend_samples_per_s"], line["backend_over_hook"]) == (17.5, 0.75)
    assert (line["ina_accuracy"], line["backend_accuracy"]) == (90.0, 89.0)


def test_a_field_missing_in_one_run_has_no_median(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    line = bench_ddp(tmp_path, monkeypatch, [topology_results(30.0, 10.0),
                                             topology_results(20.0, 10.0, comm=None)])
    assert line["comm_total_s"] is None and line["ina_samples_per_s"] == 25.0


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="Mininet needs root")
def test_a_small_real_run(tmp_path: Path) -> None:
    output = tmp_path / "ddp.jsonl"
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("ncina")), "bench", "ddp", "--model", "mlp",
         "--workers", "2",
         "--steps", "3", "--bw", "100", "--workdir", str(tmp_path / "runs"), "--output",
         str(output), "--torch-backend"],
        capture_output=True, text=True, timeout=600, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = json.loads(output.read_text())
    for field in FIELDS:
        assert line[field] is not None and line[field] >= 0, field
    assert line["speedup"] == pytest.approx(line["ina_samples_per_s"] / line["gloo_samples_per_s"],
                                            rel=5e-3)  # three significant digits
    # Not capped at 1: above it, the run reports a measurement error instead
    assert line["exposed_comm_fraction"] >= 0
    assert (line["exposed_comm_fraction"] > 1) == ("exposed_comm_error" in line)
    assert line["cpu_s"] > 0 and line["gloo_cpu_s"] > 0
    assert line["cpu_vs_gloo"] == pytest.approx(line["cpu_s"] / line["gloo_cpu_s"], rel=1e-2)
    assert line["backend_over_hook"] == pytest.approx(
        line["backend_samples_per_s"] / line["ina_samples_per_s"], rel=5e-3)
    (run,) = line["runs"]
    assert (Path(run["out"]) / "results.json").is_file()
