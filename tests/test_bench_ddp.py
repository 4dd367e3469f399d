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
    ina: float, gloo: float, comm: float | None = 4.0, backend: float | None = None
) -> dict[str, Any]:
    """What ``ncina topo``'s runner returns for a training run (results.json), in part;
    ``backend``: the samples/s of the ncina backend's run (``--torch-backend``), if any."""
    results: dict[str, Any] = {
        "runs": {
            "ina": {"samples_per_s": ina, "comm_total_s": comm, "exposed_comm_s": 1.0,
                    "exposed_comm_fraction": 0.25, "final_accuracy": 90.0,
                    "fabric": {"packets_sent": 1000, "retransmissions": int(ina)}},
            "gloo": {"samples_per_s": gloo, "comm_total_s": None, "exposed_comm_s": 3.0,
                     "exposed_comm_fraction": None, "final_accuracy": 91.0},
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
    assert line["speedup"] == pytest.approx(line["ina_samples_per_s"] / line["gloo_samples_per_s"])
    assert 0 <= line["exposed_comm_fraction"] <= 1
    assert line["backend_over_hook"] == pytest.approx(
        line["backend_samples_per_s"] / line["ina_samples_per_s"])
    (run,) = line["runs"]
    assert (Path(run["out"]) / "results.json").is_file()
