"""End to end: AllreduceClient workers and the ``ncina allreduce`` CLI against the real Python
aggregator process on loopback.

Four workers (threads, one client each) all-reduce 1,000,000 elements. Inputs made of in-window
powers of two whose per-element sums are powers of two must come back bit-exact in both result
formats; random inputs must show the error statistics Natural Compression predicts
(``ncina.proto.nc_bounds`` has the derivation; summarised at ``test_random``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
from ncina.proto.descriptor import JOB_DATAGRAM_SIZE
from ncina.proto.header import NOTICE
from ncina.proto.nc_bounds import bounds_from_inputs
from ncina.worker.client import AllreduceClient
from ncina_testlib import start_aggregator

from ncina.harness.aggregators import RunningAggregator

JOB = 11
WORKERS = 4
ELEMENTS = 1_000_000
# Largest K whose int result frame fits a 1500-byte MTU is 181; nc8 results use the default.
K = {"nc8": 256, "int": 128}

pytestmark = pytest.mark.timeout(120)


class Job(NamedTuple):
    """A running aggregator for a 4-worker job and the job's result format."""

    aggregator: RunningAggregator
    result: str


@pytest.fixture(params=["nc8", "int"])
def job(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Job]:
    result = request.param
    agg = start_aggregator(
        "python", tmp_path, job=JOB, workers=WORKERS, k=K[result], result=result,
        extra=["--seed", "5"],
    )
    try:
        yield Job(agg, result)
    finally:
        assert agg.stop() == 0, agg.log()


def allreduce_all(
    job: Job, calls: list[tuple[list[np.ndarray], str]]
) -> tuple[list[list[np.ndarray]], list[dict[str, int]]]:
    """Run ``calls`` (per call: one input per rank, and the op) on one client per rank, each in
    its own thread; return the results (per call, per rank) and each client's stats."""

    def worker(rank: int) -> tuple[list[np.ndarray], dict[str, int]]:
        with AllreduceClient(
            job.aggregator.address, job=JOB, rank=rank, workers=WORKERS, k=K[job.result],
            result_format=job.result, seed=100 + rank, deadline=30.0,
        ) as client:
            outputs = [client.allreduce(inputs[rank], op=op) for inputs, op in calls]
            return outputs, client.stats

    with ThreadPoolExecutor(WORKERS) as pool:
        done = list(pool.map(worker, range(WORKERS)))
    per_call = [[outputs[c] for outputs, _ in done] for c in range(len(calls))]
    return per_call, [stats for _, stats in done]


def check_aggregator_clean(job: Job, calls: int, elements: int) -> None:
    """The aggregator completed every slot once per chunk, and the agreement's (the clients
    make it after their handshake), and dropped nothing."""
    counters = job.aggregator.stats()["jobs"][str(JOB)]
    chunks = -(-elements // K[job.result])
    assert counters["slots_completed"] == calls * chunks + 1
    assert not any(counters["drops"].values()), counters["drops"]


def test_powers_of_two_are_exact(job: Job) -> None:
    rng = np.random.default_rng(7)
    sign = rng.choice([-1.0, 1.0], ELEMENTS)
    exponent = rng.integers(-45, 7, ELEMENTS)  # sums up to 2**8, inside the window [-50, 10]
    power = np.ldexp(sign, exponent).astype(np.float32)
    power[rng.random(ELEMENTS) < 0.05] = 0.0
    # Call 1: every worker sends the same power of two; the sum 4 * 2^e = 2^(e+2) is a power of
    # two, the mean is the input. Call 2: workers send 2^(e+1), 2^(e+1), -2^e, -2^e in an order
    # that rotates with the element index; the sum is 2^(e+1).
    same = [power] * WORKERS
    pattern = np.array([2.0, 2.0, -1.0, -1.0], dtype=np.float32)
    rotation = np.arange(ELEMENTS) % WORKERS
    mixed = [pattern[(rotation + rank) % WORKERS] * power for rank in range(WORKERS)]
    results, stats = allreduce_all(job, [(same, "mean"), (mixed, "sum")])
    for output in results[0]:
        assert output.dtype == np.float32
        np.testing.assert_array_equal(output, power)
    for output in results[1]:
        np.testing.assert_array_equal(output, 2 * power)
    assert all(s["saturated"] == 0 for s in stats)
    check_aggregator_clean(job, calls=2, elements=ELEMENTS)


def test_random_inputs_match_the_nc_error_model(job: Job) -> None:
    """Error statistics of the mean of standard normal inputs.

    Uplink: each worker rounds x to a neighbouring power of two without bias, with variance
    exactly (2^(e+1) - |x|)(|x| - 2^e) <= x^2 / 8 for |x| in [2^e, 2^(e+1)); independent across
    workers, so the integer sum T is unbiased with variance V_up = the sum of those. ``int``
    results deliver T exactly: E[(result - mean)^2] = V_up / N^2. ``nc8`` results re-round T
    the same way (conditional variance <= T^2 / 8), so by total variance the expected squared
    error lies in [V_up, V_up + (E[T]^2 + V_up) / 8] / N^2. The sample mean over 10^6 independent
    elements has a relative standard deviation of well under 1 % (bounded errors), so 3 % margins
    are far beyond chance with the fixed seeds; unbiasedness is checked at 6 standard errors.
    """
    rng = np.random.default_rng(8)
    inputs = [rng.standard_normal(ELEMENTS, dtype=np.float32) for _ in range(WORKERS)]
    results, _ = allreduce_all(job, [(inputs, "mean")])
    output = results[0][0]
    for other in results[0][1:]:
        np.testing.assert_array_equal(other, output)  # every worker gets the same result
    stacked = np.stack(inputs)
    exact = stacked.astype(np.float64).mean(axis=0)
    model = bounds_from_inputs(stacked, job.result)
    error = output.astype(np.float64) - exact
    mse = float(np.mean(error * error))
    low, high = float(np.mean(model.var_low)), float(np.mean(model.var_high))
    if job.result == "int":
        assert low == high
        assert abs(mse / low - 1) < 0.03, (mse, low)
    else:
        assert 0.97 * low <= mse <= 1.03 * high, (low, mse, high)
        assert mse > 1.1 * low  # the downlink re-compression does add error
    assert abs(float(np.mean(error))) < 6 * (mse / ELEMENTS) ** 0.5
    assert np.all(np.abs(error) <= model.max_error * (1 + 1e-6))
    check_aggregator_clean(job, calls=1, elements=ELEMENTS)


def ncina(*arguments: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "ncina.cli", *arguments],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def test_cli_two_workers(tmp_path: Path) -> None:
    agg = start_aggregator("python", tmp_path / "agg", job=JOB, workers=2, k=64, result="nc8")
    try:
        rng = np.random.default_rng(9)
        power = np.ldexp(rng.choice([-1.0, 1.0], (300, 7)), rng.integers(-30, 5, (300, 7)))
        np.save(tmp_path / "x0.npy", power.astype(np.float32))
        np.save(tmp_path / "x1.npy", power)  # float64: cast with a note
        host, port = agg.address
        procs = [
            ncina(
                "allreduce", "--aggregator", f"{host}:{port}", "--job", str(JOB),
                "--rank", str(rank), "--workers", "2", "--k", "64",
                "--input", str(tmp_path / f"x{rank}.npy"),
                "--output", str(tmp_path / f"y{rank}.npy"),
                "--op", "sum", "--seed", str(rank), "--stats", str(tmp_path / f"s{rank}.json"),
            )
            for rank in range(2)
        ]
        outputs = [proc.communicate(timeout=60) for proc in procs]
    finally:
        assert agg.stop() == 0, agg.log()
    for rank, (proc, (_, stderr)) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, stderr
        assert f"rank {rank}: 2100 elements" in stderr and "retransmissions" in stderr
        y = np.load(tmp_path / f"y{rank}.npy")
        assert y.dtype == np.float32 and y.shape == (300, 7)
        np.testing.assert_array_equal(y, 2 * power)
        stats = json.loads((tmp_path / f"s{rank}.json").read_text())
        assert stats["packets_received"] >= -(-2100 // 64)
    assert "casting" in outputs[1][1] and "float64" in outputs[1][1]
    assert "casting" not in outputs[0][1]


def test_cli_rejects_integer_input(tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.arange(10))
    proc = ncina(
        "allreduce", "--aggregator", "127.0.0.1:9", "--job", "1", "--rank", "0",
        "--workers", "1", "--k", "64", "--input", str(tmp_path / "x.npy"),
        "--output", str(tmp_path / "y.npy"),
    )
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "expected a float array" in stderr
    assert not (tmp_path / "y.npy").exists()


@pytest.mark.parametrize("backend", ["python", "socket"])
def test_cli_int32_sums_are_exact_on_both_data_paths(tmp_path: Path, backend: str) -> None:
    """``ncina allreduce --result int32``, rank 0 on the C data path and rank 1 on the Python
    one, against the reference aggregator and the C engine. Two workers, e_max 10: the int32
    window is 2^-19..2^10 (span 29), so both ranks at 2^10 sum to 2^30 units of 2^-19, the
    most positive sum the admission allows (0x40000000 on the wire), at -2^10 to the most
    negative; with in-window powers of two every sum is exact."""
    agg = start_aggregator(backend, tmp_path / "agg", job=JOB, workers=2, k=64, result="int32")
    rng = np.random.default_rng(12)
    x = np.ldexp(rng.choice([-1.0, 1.0], (2, 1000)), rng.integers(-19, 11, (2, 1000)))
    x[:, :4] = [[1024, -1024, 2.0**-19, 0], [1024, -1024, -(2.0**-18), 0]]  # the extremes
    try:
        host, port = agg.address
        procs = []
        for rank, path in enumerate(("c", "python")):
            np.save(tmp_path / f"x{rank}.npy", x[rank].astype(np.float32))
            procs.append(ncina(
                "allreduce", "--aggregator", f"{host}:{port}", "--job", str(JOB),
                "--rank", str(rank), "--workers", "2", "--k", "64", "--result", "int32",
                "--data-path", path, "--input", str(tmp_path / f"x{rank}.npy"),
                "--output", str(tmp_path / f"y{rank}.npy"), "--op", "sum", "--seed", str(rank),
            ))  # fmt: skip
        outputs = [proc.communicate(timeout=60) for proc in procs]
        counters = agg.stats()["jobs"][str(JOB)]
    finally:
        assert agg.stop() == 0, agg.log()
    for proc, (_, stderr) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, stderr
    exact = x.sum(axis=0).astype(np.float32)
    assert list(exact[:4]) == [2048.0, -2048.0, -(2.0**-19), 0.0]
    for rank in range(2):
        np.testing.assert_array_equal(np.load(tmp_path / f"y{rank}.npy"), exact)
    # 16 chunks of at most 64 elements (15 of 64, one of 40), and the agreement's one of 2
    # (the clients make it after their handshake), each result 16 + 4 * count bytes, to both
    # workers; besides them the handshake answers (JOB_DATAGRAM_SIZE), a notice (24) for each
    # retransmission that found its slot waiting for the other rank, and any result sent again
    answers = counters["handshakes"] * JOB_DATAGRAM_SIZE + counters["notices_sent"] * (
        16 + NOTICE.size)
    again = counters["bytes_out"] - 2 * (17 * 16 + 4 * 1002) - answers
    resent = counters["results_resent"]
    assert resent * (16 + 4 * 40) <= again <= resent * (16 + 4 * 64), counters
    assert not any(counters["drops"].values()), counters["drops"]


def test_cli_refuses_a_k_above_its_own_mtu_before_reading_input(tmp_path: Path) -> None:
    """A worker's datagrams must fit its own links: K 8956 (an MTU-9000 aggregator's default)
    at the worker's default MTU 1500 is refused by the job's validation (JobSpec), naming the
    largest K there and the options that fix it, before the input is read (it does not exist)."""
    proc = ncina(
        "allreduce", "--aggregator", "127.0.0.1:9", "--job", "1", "--rank", "0",
        "--workers", "2", "--k", "8956", "--input", str(tmp_path / "missing.npy"),
        "--output", str(tmp_path / "y.npy"),
    )
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert stderr == (
        "ncina allreduce: error: invalid job:\n  k=8956 nc8 elements take 8956 payload bytes, "
        "more than a datagram has at MTU 1500; the largest k there is 1456: give a smaller "
        "--k, or the --mtu that every link of the job carries\n"
    )
