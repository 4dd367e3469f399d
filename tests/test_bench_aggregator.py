"""``ncina bench aggregator``'s options, through its command, without root or a switch (runs
everywhere)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ncina.proto.profiles import TOFINO_MAX_K

from ncina.harness.load_figures import load_figures, put_ratios


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



def one_second(sent: int, received: int, rounds: int = 0) -> dict[str, Any]:
    """One measurement's figures of a 1-second load whose every reply completed a chunk."""
    st = SimpleNamespace(sent=sent, received=received, completed=received, send_errors=0,
                         retransmit_rounds=rounds, seconds=1.0)  # fmt: skip
    return load_figures(st, slots_completed=received // 4, k=TOFINO_MAX_K, lcores=1)


def test_the_twin_is_measured_at_its_k_beside_the_echo(tmp_path: Path) -> None:
    """``--profile tofino`` without ``--k`` measures the twin's job at the Tofino design's K
    (a job that breaks the design's worker limit is named for that alone, not for its K),
    what is given stays given (a K above the design's is named too); and its
    ``vs_forwarder`` is its completed work over the echo program's, while an echo that
    answered nothing leaves no ratio but the reason."""
    output = tmp_path / "aggregator.jsonl"
    default_k = bench_aggregator("--backend", "bmv2", "--p4-profile", "tofino", "--workers", "65",
                                 "--output", str(output))  # fmt: skip
    assert default_k.returncode == 1 and "at most 30 workers" in default_k.stderr
    assert "lanes per pass" not in default_k.stderr and "result" not in default_k.stderr
    given_k = bench_aggregator("--backend", "bmv2", "--profile", "tofino", "--workers", "65",
                               "--k", "64", "--output", str(output))  # fmt: skip
    assert given_k.returncode == 1
    assert given_k.stderr.endswith(f"K=64: the Tofino design holds at most {TOFINO_MAX_K} lanes "
                                   "per pass\n")
    assert not output.exists()
    figures = {"python": one_second(40_000, 40_000), "forward": one_second(90_000, 90_000),
               "bmv2": one_second(11_000, 11_000), "bmv2_forward": one_second(77_000, 77_000)}
    put_ratios(figures, "bmv2", (1,))
    assert figures["vs_forwarder"] == 0.143 and "vs_forwarder_refused" not in figures
    figures["bmv2_forward"] = one_second(5_117, 0, rounds=39)
    put_ratios(figures, "bmv2", (1,))
    assert figures["vs_forwarder"] is None
    assert figures["vs_forwarder_refused"] == "the baseline completed nothing"
    assert figures["vs_python"] == 0.275
