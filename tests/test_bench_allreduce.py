"""``ncina bench allreduce``: its options, the reference model's ``exact`` check (fed right and
wrong sums, ``ncina.harness.reference``), the median figures (``ncina.harness.figures``), the
worker processes' error path, and one tiny real run on loopback against gloo. The benchmark
itself is run through its command, as a user runs it. No timing assertions: speed is what the
benchmark reports."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ncina.aggregator import backends
from ncina.proto import nc8
from ncina.proto.header import Format, largest_k
from ncina.proto.job import default_k
from ncina.proto.wire import MAX_K
from ncina_testlib import code_values

from ncina.cli import build_parser, main
from ncina.common.ratios import ratio
from ncina.harness.figures import medians, retx_fraction
from ncina.harness.reference import (
    Reference,
    build_reference,
    client_seed,
    exact_mismatches,
    sent_codes,
    worker_input,
)

pytestmark = pytest.mark.timeout(120)


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "allreduce", *argv])


SEED = 0  # bench allreduce's default --seed
WINDOW_MAX = 10  # and --window-max


def small(workers: int = 3, elements: int = 5000) -> Reference:
    """The reference model of a small run with the benchmark's default seed and window."""
    return build_reference(workers=workers, elements=elements, seed=SEED, window_max=WINDOW_MAX)


# --- options ---------------------------------------------------------------------------------


def test_the_backend_choices_are_the_aggregators_but_bmv2(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert parse().backend == "python"
    assert parse("--backend", "dpdk").backend == "dpdk"
    with pytest.raises(SystemExit):
        parse("--backend", "bmv2")
    assert parse("--backend", "socket").backend == "socket"
    with pytest.raises(SystemExit):
        parse("--backend", "x")
    # A backend the aggregator gains becomes a choice with nothing else to do.
    x = dataclasses.replace(backends.get("socket"), name="x")
    monkeypatch.setattr(backends, "BACKENDS", (*backends.BACKENDS, x))
    assert parse("--backend", "x").backend == "x"


@pytest.mark.parametrize(
    ("mtu", "result", "k"),
    [
        (1500, "nc8", min(1500 - 20 - 8 - 16, MAX_K)),  # nc8 both ways: one byte per element
        (1500, "int", (1500 - 20 - 8 - 16) // 8),  # the result's 8 bytes decide
        (9000, "int", min((9000 - 44) // 8, MAX_K)),
        (600, "int", (600 - 44) // 8),
    ],
)
def test_the_default_k_is_the_largest_that_fits_the_mtu(mtu: int, result: str, k: int) -> None:
    """The aggregator's default K, which the benchmark takes without ``--k`` (the tiny runs
    below check that it does, and that an explicit ``--k`` is kept)."""
    assert default_k(mtu, result) == k == min(largest_k(mtu, Format[result.upper()]), MAX_K)


def test_an_mtu_too_small_for_one_element_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "allreduce.jsonl"
    with pytest.raises(SystemExit) as exited:  # refused by the parser, as every command's --mtu
        main(["bench", "allreduce", "--mtu", "44", "--output", str(output)])
    assert exited.value.code == 2
    assert "argument --mtu: --mtu must be in 68..9216" in capsys.readouterr().err
    assert not output.exists()


@pytest.mark.parametrize(
    "argv",
    [("--workers", "0"), ("--repeat", "0"), ("--elements", "-5"), ("--k", "x"), ("--mtu", "0")],
)
def test_bad_numbers_are_rejected_by_the_parser(argv: tuple[str, ...]) -> None:
    with pytest.raises(SystemExit):
        parse(*argv)


# --- the exact check ---------------------------------------------------------------------------


def nc8_result(sums: np.ndarray, window: nc8.Window, workers: int, seed: int = 3) -> np.ndarray:
    """The mean a worker computes from an aggregator's nc8 re-compression of ``sums``."""
    codes = nc8.int_to_codes(sums, np.random.default_rng(seed))
    return nc8.decode(codes, window) / np.float32(workers)


def test_the_reference_sums_are_the_sums_of_the_codes_the_workers_send() -> None:
    ref = small(workers=3, elements=2000)
    window = nc8.Window.for_job(3, WINDOW_MAX)
    expected = np.zeros(2000, dtype=np.int64)
    for rank in range(3):
        # A client draws one key for the warm-up all-reduce, then one for the tensor.
        rng = np.random.default_rng(client_seed(SEED, rank))
        nc8.encode(np.zeros(1, dtype=np.float32), window, rng)
        codes = nc8.encode(worker_input(SEED, rank, 2000), window, rng).codes
        expected += np.array(code_values(codes.tolist()), dtype=np.int64)
    np.testing.assert_array_equal(ref.sums, expected)
    assert ref.inputs.shape == (3, 2000)


def test_nc8_results_pass_and_a_wrong_sum_is_caught() -> None:
    ref = small(workers=3)
    good = nc8_result(ref.sums, ref.window, 3)
    assert exact_mismatches(good, ref.sums, ref.window, 3, "nc8") == 0
    # Another draw of the aggregator's rounding is just as right.
    other = nc8_result(ref.sums, ref.window, 3, seed=99)
    assert not np.array_equal(other, good)
    assert exact_mismatches(other, ref.sums, ref.window, 3, "nc8") == 0
    # One element summed wrong (four times too big: outside its two roundings).
    i = int(np.flatnonzero(np.abs(ref.sums) >= 4)[0])
    wrong = ref.sums.copy()
    wrong[i] *= 4
    bad = nc8_result(wrong, ref.window, 3)
    assert exact_mismatches(bad, ref.sums, ref.window, 3, "nc8") == 1
    # A worker's contribution missing from every element.
    codes = sent_codes(SEED, 2, ref.inputs[2], ref.window)
    missing = ref.sums - nc8.codes_to_int(codes)
    lost = nc8_result(missing, ref.window, 3)
    assert exact_mismatches(lost, ref.sums, ref.window, 3, "nc8") > ref.sums.size // 10


def test_int_results_must_be_the_float_of_the_exact_sum() -> None:
    ref = small(workers=3)
    good = nc8.ints_to_float(ref.sums, ref.window) / np.float32(3)
    assert exact_mismatches(good, ref.sums, ref.window, 3, "int") == 0
    codes = sent_codes(SEED, 0, ref.inputs[0], ref.window)
    i = int(np.flatnonzero(codes & 0x7F)[0])
    wrong = ref.sums.copy()
    wrong[i] += nc8.codes_to_int(codes)[i]  # rank 0 counted twice in one element
    bad = nc8.ints_to_float(wrong, ref.window) / np.float32(3)
    assert exact_mismatches(bad, ref.sums, ref.window, 3, "int") == 1
    # An nc8 rounding is not an exact int result.
    rounded = nc8_result(ref.sums, ref.window, 3)
    assert exact_mismatches(rounded, ref.sums, ref.window, 3, "int") > 0


def test_the_roundings_are_exact_at_powers_of_two_and_beyond_float64() -> None:
    """Sums around powers of two, and above 2**53 where float64 cannot tell S from S + 1."""
    workers = 4
    window = nc8.Window.for_job(workers)
    sums = [0, 1, -1, 2, 3, -3, 7, 8, 2**53 - 1, 2**53 + 1, -(2**53 + 1), 2**62 - 1, -(2**62)]
    array = np.array(sums, dtype=np.int64)

    def codes(shift: int) -> np.ndarray:
        out = []
        for s in sums:
            h = abs(s).bit_length() - 1  # 2**h <= |s| < 2**(h + 1)
            out.append(0 if s == 0 else (h + 1 + shift) | (0x80 if s < 0 else 0))
        return np.array(out, dtype=np.uint8)

    def mean(c: np.ndarray) -> np.ndarray:
        return nc8.decode(c, window) / np.float32(workers)

    for shift in (0, 1):  # 2**h and 2**(h + 1)
        assert exact_mismatches(mean(codes(shift)), array, window, workers, "nc8") == 0
    nonzero = sum(1 for s in sums if s)
    for shift in (-1, 2):  # one power too small or too big (too small where 2**64 would be)
        c = np.where((codes(shift) & 0x7F) > 64, codes(-1), codes(shift)).astype(np.uint8)
        c[array == 0] = 0
        assert exact_mismatches(mean(c), array, window, workers, "nc8") == nonzero
    flipped = codes(0) ^ np.where(array != 0, 0x80, 0).astype(np.uint8)  # the wrong sign
    assert exact_mismatches(mean(flipped), array, window, workers, "nc8") == nonzero
    with pytest.raises(ValueError, match="13 sums"):
        exact_mismatches(np.zeros(5, np.float32), array, window, workers, "nc8")


# --- figures -----------------------------------------------------------------------------------


def repeat(wall: float, gloo: float, exact: bool = True, rss: int = 100, cpu: float = 1.0,
           gloo_cpu: float = 1.0, retx: float = 0.0) -> dict[str, object]:  # fmt: skip
    return {"wall_s": wall, "gloo_wall_s": gloo, "exact": exact,
            "exact_mismatches": 0 if exact else 7, "peak_rss": [rss, rss + 1],
            "gloo_peak_rss": [2 * rss, 2 * rss], "cpu_s": cpu, "gloo_cpu_s": gloo_cpu,
            "retx_fraction": retx}  # fmt: skip


def test_figures_are_lower_medians_and_their_ratio_with_every_run_kept() -> None:
    runs = [repeat(3.0, 0.5, rss=300), repeat(1.0, 0.4, rss=100), repeat(2.0, 0.6, rss=200)]
    figures = medians(runs, workers=2, elements=1000)
    assert (figures["wall_s"], figures["gloo_wall_s"]) == (2.0, 0.5)
    assert figures["vs_gloo"] == 4.0  # the ratio of the medians, not the median ratio (5.0)
    assert figures["elements_per_s"] == 500
    assert figures["exact"] is True
    assert figures["peak_rss"] == [200, 201] and figures["gloo_peak_rss"] == [400, 400]
    assert figures["input_bytes"] == 4000
    assert figures["peak_rss_over_input"] == 0.0752  # the largest of any run: 301 / 4000
    assert [r["vs_gloo"] for r in figures["runs"]] == [6.0, 2.5, 3.33]
    assert [r["wall_s"] for r in figures["runs"]] == [3.0, 1.0, 2.0]
    assert figures["vs_gloo_spread"] == {"min": 2.5, "median": 3.33, "max": 6.0}
    # An even count takes the lower of the middle two: a measured value, never an average.
    assert medians(runs[:2], workers=2, elements=1000)["wall_s"] == 1.0
    # One inexact run makes the whole benchmark inexact.
    runs[0] = repeat(3.0, 0.5, exact=False)
    figures = medians(runs, workers=2, elements=1000)
    assert figures["exact"] is False and figures["runs"][0]["exact_mismatches"] == 7
    assert ratio(1.0, 0.0) is None  # no ratio of a baseline of nothing (issue 40)


def test_cpu_figures_are_medians_their_ratio_its_spread_and_per_element() -> None:
    runs = [repeat(1.0, 1.0, cpu=4.0, gloo_cpu=2.0), repeat(1.0, 1.0, cpu=1.0, gloo_cpu=2.0),
            repeat(1.0, 1.0, cpu=3.0, gloo_cpu=1.0)]  # fmt: skip
    figures = medians(runs, workers=2, elements=1000)
    assert (figures["cpu_s"], figures["gloo_cpu_s"]) == (3.0, 2.0)
    assert figures["cpu_vs_gloo"] == 1.5
    assert figures["cpu_vs_gloo_spread"] == {"min": 0.5, "median": 2.0, "max": 3.0}
    assert figures["cpu_ns_per_element"] == 1.5e6  # 3 s over 2 ranks of 1000 elements
    assert figures["gloo_cpu_ns_per_element"] == 1e6
    assert [r["cpu_vs_gloo"] for r in figures["runs"]] == [2.0, 0.5, 3.0]


def test_retx_fraction_is_copies_over_packets_sent_with_its_median_and_spread() -> None:
    workers = [{"packets_sent": 900, "retransmissions": 9}, {"packets_sent": 100,
                                                              "retransmissions": 1}]  # fmt: skip
    assert retx_fraction(workers) == 0.01  # 10 of 1000, summed over the workers
    assert retx_fraction([]) == 0.0
    runs = [repeat(1.0, 1.0, retx=0.02), repeat(1.0, 1.0, retx=0.0), repeat(1.0, 1.0, retx=0.5)]
    figures = medians(runs, workers=2, elements=1000)
    assert figures["retx_fraction"] == 0.02
    assert figures["retx_fraction_spread"] == {"min": 0.0, "median": 0.02, "max": 0.5}
    assert [r["retx_fraction"] for r in figures["runs"]] == [0.02, 0.0, 0.5]


def test_cpu_per_packet_is_the_median_cpu_runs_split_over_the_datagrams_it_moved() -> None:
    """Issue 36: packets are every rank's chunks up and results down, plus the copies."""
    from ncina.harness.figures import job_packets, per_packet

    # 2 ranks of 1000 elements at K 300: 4 chunks each way each (the last of 100), 3 copies
    assert job_packets(2, 1000, 300, 3) == 2 * 2 * 4 + 3 == 19
    assert job_packets(4, 10_000_000, 64, 0) == 2 * 4 * 156_250

    def run(cpu: float, packets: int) -> dict[str, float]:
        return {"cpu_s": cpu, "packets": packets, "worker_cpu": cpu / 2,
                "aggregator_cpu": cpu * 3 / 8, "unattributed_s": cpu / 8}  # fmt: skip

    runs = [run(4.0, 1000), run(2.0, 400), run(8.0, 100)]
    figures = per_packet(runs)  # the run of median cpu_s (4.0), over its own 1000 packets
    assert figures["packets"] == 1000
    assert figures["cpu_ns_per_packet"] == 4e6
    assert figures["cpu_ns_per_packet_split"] == {
        "workers": 2e6, "aggregator": 1.5e6, "unattributed": 0.5e6}
    assert sum(figures["cpu_ns_per_packet_split"].values()) == figures["cpu_ns_per_packet"]
    nothing = per_packet([run(1.0, 0)])  # no datagram moved: no figure, not a division error
    assert nothing["cpu_ns_per_packet"] is None
    assert set(nothing["cpu_ns_per_packet_split"].values()) == {None}


def test_cpu_time_of_a_process_is_read_from_proc() -> None:
    from ncina.common import cpu

    def work() -> int:  # a fixed amount of work, some hundred milliseconds of CPU
        return sum(i * i for i in range(3_000_000))

    result, usage = cpu.measure(work, [os.getpid()])
    assert result == sum(i * i for i in range(3_000_000))
    assert usage.processes_s > 0
    assert cpu.process_cpu_s(2**22 + 1) == 0.0  # above pid_max: no such process


def test_a_process_cpu_time_holds_its_childrens() -> None:
    """BMv2's simple_switch_grpc runs as its aggregator process's child (issue 40: its CPU was
    missing from aggregator_cpu_s): a parent that only waits is charged its live child's
    work."""
    from ncina.common import cpu

    child = ("import sys, time\nwhile time.process_time() < 0.3: pass\n"
             "print('done', flush=True); sys.stdin.read()")  # fmt: skip
    parent = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', "
         f"{child!r}])"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert parent.stdout is not None and parent.stdout.readline() == "done\n"
        assert cpu.process_cpu_s(parent.pid) >= 0.3 - 2 / cpu.TICK
    finally:
        parent.communicate("")


def snap(t: float, busy: float, **tasks: float) -> dict[str, Any]:
    return {"t": t, "busy": busy, "tasks": {key.replace("_", "/"): v for key, v in tasks.items()}}


def test_cpu_no_process_was_charged_is_busy_time_less_every_process() -> None:
    """Issue 40: packet work in a process's context is in its time and in /proc/stat's
    softirq on this kernel; only busy time less every process's counts it once."""
    from ncina.common import cpu

    before = snap(1.0, 100.0, p1_5=3.0, p2_7=1.0, p3_9=2.0)
    # p1 worked 0.5 s and reaped p2 (1.2 s at its exit) and p3 (2.1 s): their times are in
    # p1's children's; p3's PID was reused (start time 11: a new process, all of its 0.25 s in
    # the window); p4 is new. The processes did 0.5 + 0.2 + 0.1 + 0.25 + 0.5 s.
    after = snap(2.0, 102.0, p1_5=3.0 + 0.5 + 1.2 + 2.1, p3_11=0.25, p4_12=0.5)
    assert cpu.unattributed_s(before, after) == pytest.approx(2.0 - 1.55)
    assert cpu.unattributed_s(before, snap(2.0, 100.5, p1_5=9.0)) == 0.0  # ticks apart
    # From the earliest snapshot before a call to the latest after one.
    reports = [{"machine_at": [before, after]},
               {"machine_at": [snap(1.5, 100.2), snap(3.0, 102.0, p1_5=6.8, p3_11=0.25,
                                                          p4_12=0.5)]}]  # fmt: skip
    assert cpu.window_unattributed_s(reports) == pytest.approx(2.0 - 1.55)


def test_cpu_seconds_of_a_short_run_are_at_most_the_machines_busy_time() -> None:
    """A child that sends UDP datagrams to itself on loopback for 0.4 CPU-seconds (softirq
    work in its own context, in its time and, on this kernel, in /proc/stat's softirq too): its
    CPU plus
    what no process was charged is at least its own time and at most what the whole machine
    was busy (within two ticks per CPU and counter), whatever else runs."""
    from ncina.common import cpu

    code = ("import socket, sys, time\n"
            "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(('127.0.0.1', 0))\n"
            "while time.process_time() < 0.4:\n"
            "    s.sendto(bytes(1400), s.getsockname()); s.recv(2048)\n"
            "print('done', flush=True); sys.stdin.read()\n")  # fmt: skip
    before = cpu.snapshot()
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline() == "done\n"
        after = cpu.snapshot()  # the child still alive: its time is its own
        child_s = cpu.process_cpu_s(child.pid)
    finally:
        child.communicate("")
    busy = after["busy"] - before["busy"]
    total = child_s + cpu.unattributed_s(before, after)
    assert child_s >= 0.4 - 2 / cpu.TICK  # /proc counts in ticks
    assert child_s <= total <= busy + 2 * 2 * (os.cpu_count() or 1) / cpu.TICK


# --- worker processes --------------------------------------------------------------------------


def test_a_failing_worker_is_reported_with_its_rank_and_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "allreduce.jsonl"
    # An initial RTO of 0: every worker's client refuses it before anything is sent.
    status = main(["bench", "allreduce", "--workers", "2", "--elements", "10", "--repeat", "1",
                   "--timeout", "0", "--output", str(output)])  # fmt: skip
    assert status == 1
    assert re.search(r"worker \d exited with status 1: ValueError: need 0 < min_timeout",
                     capsys.readouterr().err)  # fmt: skip
    assert not output.exists()


@pytest.mark.parametrize(("result", "k"), [("nc8", None), ("int", 100)])
def test_a_tiny_run_against_gloo_is_exact_and_complete(
    tmp_path: Path, result: str, k: int | None
) -> None:
    """Without ``--k`` the run takes the aggregator's default K for the MTU, with it that K."""
    output = tmp_path / "allreduce.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "ncina.cli", "bench", "allreduce", "--workers", "2",
         "--elements", "20000", "--repeat", "1", "--backend", "python", "--result", result,
         *(["--k", str(k)] if k else []), "--output", str(output)],
        capture_output=True, text=True, timeout=100, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(proc.stdout)
    assert json.loads(output.read_text()) == figures
    assert figures["exact"] is True and figures["results_identical_across_workers"] is True
    assert figures["k"] == (k or default_k(1500, result)) and figures["mtu"] == 1500
    assert figures["wall_s"] > 0 and figures["gloo_wall_s"] > 0
    # (the times are rounded to microseconds, the ratio to three digits)
    assert figures["vs_gloo"] == pytest.approx(figures["wall_s"] / figures["gloo_wall_s"], 0.01)
    assert figures["elements_per_s"] == pytest.approx(20000 / figures["wall_s"], 0.01)
    assert len(figures["peak_rss"]) == 2 and all(r > 4 * 20000 for r in figures["peak_rss"])
    assert len(figures["gloo_peak_rss"]) == 2
    [run] = figures["runs"]
    assert run["exact"] is True and run["exact_mismatches"] == 0
    # 20000 / K chunks per worker, one for the warm-up and one for the agreement after the
    # handshake, each added once (a busy machine may add retransmissions to the packets, never
    # to the contributions).
    chunks = -(-20000 // figures["k"]) + 2
    assert figures["aggregator_slots_completed"] == chunks
    assert figures["aggregator_contributions"] == 2 * chunks
    assert figures["aggregator_packets_in"] >= 2 * chunks
    # Issue 36: CPU per datagram of the timed call (its chunks up and down, and any copies)
    assert figures["packets"] == 2 * 2 * (chunks - 2) + figures["retransmissions"]
    rounding = 0.0005 * 1e9 / figures["packets"]  # cpu_s is given to the millisecond
    assert figures["cpu_ns_per_packet"] == pytest.approx(
        figures["cpu_s"] * 1e9 / figures["packets"], abs=rounding + 0.1)
    split = figures["cpu_ns_per_packet_split"]
    assert set(split) == {"workers", "aggregator", "unattributed"}
    assert sum(split.values()) == pytest.approx(figures["cpu_ns_per_packet"], rel=0.01, abs=1)
    assert figures["within_bounds"] is True


def test_the_json_says_where_gloo_and_ina_ran_differently() -> None:
    """Issue 40: on loopback gloo's TCP uses lo's 64 KiB MTU while INA's K is sized for 1,500,
    and with --backend dpdk INA goes through a veth and a bridge while gloo stays on lo."""
    from ncina.harness.figures import conditions

    socket_run = conditions("socket", 1500, 65536)
    assert (socket_run["ina_path"], socket_run["gloo_path"]) == ("loopback", "loopback")
    assert socket_run["conditions_differ"] == [
        "mtu: INA's datagrams fit 1500 bytes, gloo's TCP segments loopback's 65536"]
    dpdk_run = conditions("dpdk", 1500, 65536)
    assert dpdk_run["conditions_differ"][0] == (
        "path: INA through a veth and bridge, gloo on loopback")
    assert len(dpdk_run["conditions_differ"]) == 2
    assert conditions("python", 1500, 1500)["conditions_differ"] == []
