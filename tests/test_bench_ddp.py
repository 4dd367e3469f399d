"""``ncina bench ddp``: its fields from a topology run, and one small real run (root)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ncina.bench import ddp


def test_fields_and_medians() -> None:
    runs = []
    for ina, gloo in ((30.0, 10.0), (20.0, 10.0), (50.0, 20.0)):
        results = {
            "runs": {
                "ina": {"samples_per_s": ina, "comm_total_s": 4.0, "exposed_comm_s": 1.0,
                        "exposed_comm_fraction": 0.25},
                "gloo": {"samples_per_s": gloo, "comm_total_s": None, "exposed_comm_s": 3.0,
                         "exposed_comm_fraction": None},
            },
            "comparison": {"speedup": ina / gloo},
        }  # fmt: skip
        runs.append(ddp.figures(results))
    assert runs[0] == {"ina_samples_per_s": 30.0, "gloo_samples_per_s": 10.0, "speedup": 3.0,
                       "comm_total_s": 4.0, "exposed_comm_s": 1.0,
                       "exposed_comm_fraction": 0.25}  # fmt: skip
    med = ddp.medians(runs)
    assert (med["ina_samples_per_s"], med["gloo_samples_per_s"], med["speedup"]) == (30, 10, 2.5)
    runs[1]["comm_total_s"] = None
    assert ddp.medians(runs)["comm_total_s"] is None


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="Mininet needs root")
def test_a_small_real_run(tmp_path: Path) -> None:
    output = tmp_path / "ddp.jsonl"
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("ncina")), "bench", "ddp", "--model", "mlp",
         "--workers", "2",
         "--steps", "3", "--bw", "100", "--workdir", str(tmp_path / "runs"), "--output",
         str(output)],
        capture_output=True, text=True, timeout=600, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = json.loads(output.read_text())
    for field in ddp.FIELDS:
        assert line[field] is not None and line[field] >= 0, field
    assert line["speedup"] == pytest.approx(line["ina_samples_per_s"] / line["gloo_samples_per_s"])
    assert 0 <= line["exposed_comm_fraction"] <= 1
    (run,) = line["runs"]
    assert (Path(run["out"]) / "results.json").is_file()
