"""``ncina bench aggregator``'s options, through its command, without root or a switch (runs
everywhere)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def bench_aggregator(*options: str) -> subprocess.CompletedProcess[str]:
    """``ncina bench aggregator OPTIONS`` in a fresh interpreter."""
    argv = [str(Path(sys.executable).with_name("ncina")), "bench", "aggregator", *options]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_the_tofino_profile_is_measured_on_bmv2_only(tmp_path: Path) -> None:
    """``--profile tofino`` (the job's profile; ``--p4-profile`` its deprecated name) is
    measured on the bmv2 backend only: any other backend is refused before anything is set up
    (nothing written), and the option takes the two profiles only."""
    usage = bench_aggregator("--help")
    assert usage.returncode == 0
    assert "--profile {default,tofino}" in usage.stdout
    output = tmp_path / "aggregator.jsonl"
    refused = bench_aggregator("--backend", "dpdk", "--p4-profile", "tofino", "--k", "12",
                               "--result", "int", "--output", str(output))  # fmt: skip
    assert refused.returncode == 1
    assert refused.stderr.splitlines()[-1] == (
        "ncina bench: error: --profile tofino is measured on the bmv2 backend only (the "
        "Tofino program's twin beside the echo program)")
    assert not output.exists()
    unknown = bench_aggregator("--backend", "bmv2", "--profile", "nope")
    assert unknown.returncode == 2
    assert "argument --profile: invalid choice: 'nope'" in unknown.stderr


def test_a_bad_job_is_refused_before_anything_is_set_up(tmp_path: Path) -> None:
    """The benchmark's job is validated as every command's is (JobSpec): more workers than one
    aggregator serves is named before the root and DPDK checks and before any output."""
    output = tmp_path / "aggregator.jsonl"
    refused = bench_aggregator("--workers", "65", "--output", str(output))
    assert refused.returncode == 1
    assert refused.stderr == (
        "ncina bench: error: invalid job:\n  workers must be in 1..64 (a worker bitmap is one "
        "64-bit register word in every backend), not 65\n"
    )
    assert not output.exists()
