"""``ncina bench fabric``: its options and figures, and (as root) one tiny real run over a
Mininet star, and that it removes everything it made when a run fails."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from ncina.aggregator import cli as aggregator_cli

from ncina.bench import allreduce, fabric
from ncina.cli import build_parser, main

pytestmark = pytest.mark.timeout(120)


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "fabric", *argv])


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    args = parse()
    assert (args.workers, args.bw, args.elements, args.mtu, args.repeat) == (4, 100.0, 10**7,
                                                                           1500, 3)  # fmt: skip
    assert args.backend == "socket"  # the C aggregator, when it is an aggregator backend
    monkeypatch.setattr(aggregator_cli, "BACKENDS", ("python", "dpdk", "bmv2"))
    assert parse().backend == "python"
    assert parse("--backend", "dpdk", "--mtu", "9000").mtu == 9000


def test_link_fraction_counts_frames_against_the_link_rate() -> None:
    # 12.5 MB of frames in one second fill a 100 Mbit/s link.
    assert fabric.link_fraction(12_500_000, 1.0, 100.0) == 1.0
    assert fabric.link_fraction(1_250_000, 2.0, 10.0) == 0.5
    assert fabric.fractions([100, 0], [1_250_100, 625_000], 1.0, 10.0) == [1.0, 0.5]


def test_the_time_limit_grows_with_the_transfer_over_slow_links() -> None:
    args = argparse.Namespace(elements=10**7, bw=10.0, deadline=30.0)
    assert fabric.time_limit(args) == 3 * 2 * 32 * 10**7 / 10e6 + 30.0
    args.bw = 10_000.0
    assert fabric.time_limit(args) == fabric.MIN_TIME_LIMIT


def test_without_root_it_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(RuntimeError, match="needs root"):
        fabric.check_arguments(parse())


def test_bad_bandwidth_and_dpdk_jumbo_frames_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    with pytest.raises(ValueError, match="--bw must be positive"):
        fabric.check_arguments(parse("--bw", "0"))
    args = parse("--backend", "dpdk", "--mtu", "9000")
    from ncina.aggregator.dpdk import binding

    if binding.missing():
        pytest.skip(f"dpdk: {binding.missing()}")
    with pytest.raises(ValueError, match="MTU 1500"):
        fabric.check_arguments(args)


root = pytest.mark.skipif(os.geteuid() != 0, reason="Mininet needs root")


def links(prefix: str) -> list[str]:
    """Interfaces of this namespace whose names start with ``prefix``."""
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    names = [line.split(": ")[1].split("@")[0] for line in out.splitlines()]
    return [n for n in names if n.startswith(prefix)]


@pytest.mark.root
@root
def test_a_tiny_run_over_mininet(tmp_path: Path) -> None:
    output = tmp_path / "fabric.jsonl"
    status = main(["bench", "fabric", "--workers", "2", "--elements", "20000", "--repeat", "1",
                   "--backend", "python", "--bw", "100", "--workdir", str(tmp_path),
                   "--output", str(output)])  # fmt: skip
    assert status == 0
    assert links(f"b{os.getpid() % 100000}") == []
    figures = json.loads(output.read_text())
    assert figures["benchmark"] == "fabric"
    assert figures["exact"] is True
    for key in ("link_fraction", "gloo_link_fraction", "wall_s", "gloo_wall_s", "vs_gloo"):
        assert figures[key] > 0, key
    assert (figures["bw_mbit"], figures["workers"], figures["elements"]) == (100.0, 2, 20000)
    assert (figures["backend"], figures["k"], figures["mtu"]) == ("python", 1456, 1500)
    [run] = figures["runs"]
    # Every uplink carried at least its chunks' frames: 14 chunks of 1456 (the last of 1072)
    # NC8 codes behind Ethernet, IPv4, UDP and the ncina header.
    frames = 13 * (1456 + 58) + (1072 + 58)
    assert all(b >= frames for b in run["uplink_bytes"]), run["uplink_bytes"]
    assert (tmp_path / "run0" / "aggregator.log").exists()


@pytest.mark.root
@root
def test_a_failed_run_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[subprocess.Popen[bytes]] = []

    def failing(args: Any, net: Any, topo: Any, procs: Any, *rest: Any) -> dict[str, Any]:
        host = net.get(topo.worker_names[0])
        started.append(procs.start(host, ["sleep", "600"], tmp_path / "sleep.log"))
        raise KeyboardInterrupt  # as Ctrl-C would, mid-run

    monkeypatch.setattr(fabric, "one_repeat", failing)
    monkeypatch.setattr(allreduce, "reference", lambda args: None)
    args = parse("--workers", "2", "--elements", "10", "--repeat", "1", "--backend", "python")
    prefix = f"b{os.getpid() % 100000}"
    with pytest.raises(KeyboardInterrupt):
        fabric.run(args)
    assert links(prefix) == []
    assert started and started[0].poll() is not None  # stopped by its PID
