"""Hierarchical (leaf-spine) aggregation with real processes on loopback (python backend).

A spine (``--uplink int``, ``--workers L``) and ``L`` leaves (``--upstream``, ``--workers W``),
every one with ``--total-workers N = L * W``, and ``N`` ``AllreduceClient`` workers (threads)
with ``total_workers=N``: int results must be the exact sum over all ``N`` workers, and nc8
results the bytes a one-level aggregator of the same seed sends for the same inputs, with and
without emulated loss on every aggregator (docs/protocol.md, "Hierarchical aggregation").
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ncina.proto import nc8
from ncina.proto.descriptor import JobMismatchError
from ncina.worker.client import AllreduceClient
from ncina_testlib import (
    RunningAggregator,
    counters,
    launch_aggregator,
    powers_of_two,
    start_aggregator,
)

from ncina import cli

JOB = 23
K = 64  # int frames of 64 elements fit MTU 1500 (the largest is 182)
POOL = 8
SEED = 77
# Three calls per worker: sizes that use every slot several times, and a short last chunk.
SIZES = (1000, 3 * POOL * K + 5, 130)

pytestmark = pytest.mark.timeout(120)

LOSS = ["--drop-up", "0.05", "--drop-down", "0.05", "--duplicate", "0.05", "--reorder", "0.05"]


class Tree:
    """A running spine and its leaves for one job."""

    def __init__(self, spine: RunningAggregator, leaves: list[RunningAggregator], width: int):
        self.spine = spine
        self.leaves = leaves
        self.width = width  # workers per leaf

    @property
    def total(self) -> int:
        return len(self.leaves) * self.width

    def worker_site(self, g: int) -> tuple[tuple[str, int], int]:
        """The aggregator address and local rank of global worker ``g``."""
        return self.leaves[g // self.width].address, g % self.width

    def stop(self) -> None:
        for running in [*self.leaves, self.spine]:
            assert running.stop() == 0, running.log()


def start_tree(
    workdir: Path, leaves: int, width: int, result: str, *, spine_extra: Sequence[str] = (),
    leaf_extra: Sequence[str] = (),
) -> Tree:  # fmt: skip
    total = leaves * width
    spine = start_aggregator(
        "python", workdir / "spine", job=JOB, workers=leaves, k=K, result=result,
        extra=["--uplink", "int", "--total-workers", str(total), "--seed", str(SEED),
               "--pool-size", str(POOL), *spine_extra],
    )  # fmt: skip
    host, port = spine.address
    running: list[RunningAggregator] = []
    try:
        for r in range(leaves):
            extra = [
                "--total-workers", str(total), "--upstream", f"{host}:{port}",
                "--upstream-rank", str(r), "--pool-size", str(POOL),
                *[a.replace("SEED", str(100 + r)) for a in leaf_extra],
            ]  # fmt: skip
            running.append(start_aggregator("python", workdir / f"leaf{r}", job=JOB,
                                            workers=width, k=K, result=result, extra=extra))
    except BaseException:
        for leaf in running:
            leaf.stop()
        spine.stop()
        raise
    return Tree(spine, running, width)


@pytest.fixture
def trees(tmp_path: Path) -> Iterator[list[Tree]]:
    """The trees a test starts, stopped (and checked to exit cleanly) at its end."""
    started: list[Tree] = []
    yield started
    for tree in started:
        tree.stop()


def inputs(total: int, kind: str) -> list[list[np.ndarray]]:
    """Per call, one float32 input per worker: in-window powers of two (NC8 encodes them
    exactly) or normal random values (stochastically rounded by each worker's own seed)."""
    calls = []
    for c, n in enumerate(SIZES):
        if kind == "powers":
            calls.append([powers_of_two(n, seed=1000 * c + g) for g in range(total)])
        else:
            rng = np.random.default_rng(c)
            calls.append([rng.normal(size=n).astype(np.float32) for _ in range(total)])
    return calls


def run_workers(
    sites: Sequence[tuple[tuple[str, int], int]], *, workers: int, total: int, result: str,
    calls: list[list[np.ndarray]],
) -> list[list[np.ndarray]]:  # fmt: skip
    """Global worker ``g`` runs at ``sites[g]`` (aggregator address, local rank) in its own
    thread and all-reduces (sum) every call's input ``g``; returns results per call, per
    worker. Worker ``g``'s random stream is seeded with ``g`` whatever the topology."""
    out: list[list[Any]] = [[None] * total for _ in calls]
    errors: list[BaseException] = []

    def work(g: int) -> None:
        address, rank = sites[g]
        try:
            with AllreduceClient(
                address, job=JOB, rank=rank, workers=workers, total_workers=total, k=K,
                pool_size=POOL, result_format=result, seed=g, deadline=30.0,
            ) as client:  # fmt: skip
                for c, call in enumerate(calls):
                    out[c][g] = client.allreduce(call[g], op="sum")
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(g,)) for g in range(total)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def one_level(workdir: Path, total: int, result: str, calls: list[list[np.ndarray]]) -> list:
    """The results of a one-level python aggregator of ``total`` workers, same seed."""
    agg = start_aggregator(
        "python", workdir / "flat", job=JOB, workers=total, k=K, result=result,
        extra=["--seed", str(SEED), "--pool-size", str(POOL)],
    )
    try:
        return run_workers([(agg.address, g) for g in range(total)], workers=total,
                           total=total, result=result, calls=calls)  # fmt: skip
    finally:
        assert agg.stop() == 0, agg.log()


def exact_sums(total: int, calls: list[list[np.ndarray]]) -> list[np.ndarray]:
    """Per call, the exact sum of the workers' powers of two as an int result decodes it."""
    window = nc8.Window.for_job(total)
    out = []
    for call in calls:
        ints = sum(np.ldexp(x.astype(np.float64), -window.e_min).astype(np.int64) for x in call)
        out.append(nc8.ints_to_float(ints, window))
    return out


def check_accounting(tree: Tree) -> None:
    """Every leaf's and the spine's counters add up (docs/protocol.md, "Counters"), every leaf
    sent each of its completed slots up once, and no aggregator hit an internal error."""
    for running in [*tree.leaves, tree.spine]:
        doc = running.stats()
        flat = counters(doc, JOB)
        job = doc["jobs"][str(JOB)]
        up = doc.get("upstream", {"resent": 0})
        assert job["packets_in"] == (
            job["contributions"] + job["duplicates"] + job["results_resent"]
            + job["handshakes"] + sum(job["drops"].values()) + up["resent"]
        ), doc
        assert flat["global.drops.internal_error"] == 0, running.log()
        if running is not tree.spine:
            assert up["sent"] == job["slots_completed"], doc
            assert up["results"] * tree.width == job["results_sent"], doc


@pytest.mark.parametrize(("leaves", "width"), [(2, 2), (2, 4)])
def test_hierarchical_int_results_are_the_exact_sum(
    tmp_path: Path, trees: list[Tree], leaves: int, width: int
) -> None:
    tree = start_tree(tmp_path, leaves, width, "int")
    trees.append(tree)
    calls = inputs(tree.total, "powers")
    got = run_workers([tree.worker_site(g) for g in range(tree.total)], workers=width,
                      total=tree.total, result="int", calls=calls)  # fmt: skip
    for c, want in enumerate(exact_sums(tree.total, calls)):
        for g in range(tree.total):
            assert got[c][g].tobytes() == want.tobytes(), (c, g)
    check_accounting(tree)
    spine = tree.spine.stats()["jobs"][str(JOB)]
    chunks = sum(-(-n // K) for n in SIZES)
    assert spine["slots_completed"] == chunks
    assert spine["contributions"] == chunks * leaves


def test_hierarchical_nc8_results_equal_one_level(tmp_path: Path, trees: list[Tree]) -> None:
    tree = start_tree(tmp_path, 2, 2, "nc8")
    trees.append(tree)
    calls = inputs(tree.total, "normal")
    got = run_workers([tree.worker_site(g) for g in range(tree.total)], workers=2,
                      total=tree.total, result="nc8", calls=calls)  # fmt: skip
    want = one_level(tmp_path, tree.total, "nc8", calls)
    for c in range(len(calls)):
        for g in range(tree.total):
            assert got[c][g].tobytes() == want[c][g].tobytes(), (c, g)
    check_accounting(tree)


@pytest.mark.parametrize("result", ["int", "nc8"])
def test_hierarchical_results_survive_loss(
    tmp_path: Path, trees: list[Tree], result: str
) -> None:
    """Seeded drops both ways, duplicates and reordering on every leaf and on the spine: every
    call completes with the same results as without loss."""
    tree = start_tree(
        tmp_path, 2, 2, result,
        spine_extra=[*LOSS, "--fault-seed", "9"], leaf_extra=[*LOSS, "--fault-seed", "SEED"],
    )  # fmt: skip
    trees.append(tree)
    calls = inputs(tree.total, "powers" if result == "int" else "normal")
    got = run_workers([tree.worker_site(g) for g in range(tree.total)], workers=2,
                      total=tree.total, result=result, calls=calls)  # fmt: skip
    want = (
        [[s] * tree.total for s in exact_sums(tree.total, calls)]
        if result == "int"
        else one_level(tmp_path, tree.total, result, calls)
    )
    for c in range(len(calls)):
        for g in range(tree.total):
            assert got[c][g].tobytes() == want[c][g].tobytes(), (c, g)
    check_accounting(tree)
    faults = [running.stats()["faults"] for running in [*tree.leaves, tree.spine]]
    assert all(f["dropped_up"] and f["dropped_down"] for f in faults), faults


@pytest.mark.parametrize(
    ("spine_options", "named"),
    [
        (["--workers", "3", "--uplink", "int", "--total-workers", "6"], "workers: leaf 2, spine 3"),
        (["--workers", "2", "--uplink", "int", "--total-workers", "8"],
         "window e_min (total workers): leaf -50, spine -49"),
        (["--workers", "2"], "uplink: leaf int partial sums (leaves), spine nc8 codes (workers)"),
        (["--workers", "2", "--uplink", "int", "--total-workers", "4", "--pool-size", "16"],
         "pool size: leaf 8, spine 16"),
    ],
)  # fmt: skip
def test_hierarchical_handshake_mismatch_fails_fast(
    tmp_path: Path, spine_options: list[str], named: str
) -> None:
    """A leaf whose spine's job differs exits with status 1 before serving, the parameter
    named (it has the answer within one round trip, far inside its handshake timeout)."""
    workers = int(spine_options[1])
    spine = start_aggregator(
        "python", tmp_path / "spine", job=JOB, workers=workers, k=K, result="int",
        extra=["--pool-size", "8", *spine_options[2:]] if "--pool-size" not in spine_options
        else spine_options[2:],
    )  # fmt: skip
    try:
        host, port = spine.address
        leaf = launch_aggregator(
            "python", tmp_path / "leaf", job=JOB, workers=2, k=K, result="int",
            extra=["--total-workers", "4", "--upstream", f"{host}:{port}", "--upstream-rank",
                   "0", "--pool-size", "8", "--upstream-timeout", "30"],
        )  # fmt: skip
        assert leaf.process.wait(timeout=60) == 1, leaf.log()
        log = leaf.log()
        assert named in log, log
        assert "listening on" not in log
        assert spine.stats()["jobs"][str(JOB)]["handshakes"] >= 1
    finally:
        assert spine.stop() == 0, spine.log()


def test_hierarchical_worker_with_another_total_is_refused(
    tmp_path: Path, trees: list[Tree]
) -> None:
    """A worker that counts another total number of workers than its leaf (another window)
    fails its handshake naming it."""
    tree = start_tree(tmp_path, 2, 2, "int")
    trees.append(tree)
    named = r"window e_min \(total workers\): worker -49, aggregator -50"
    with (
        AllreduceClient(tree.leaves[0].address, job=JOB, rank=0, workers=2, total_workers=8,
                        k=K, pool_size=POOL, result_format="int") as client,
        pytest.raises(JobMismatchError, match=named),
    ):  # fmt: skip
        client.allreduce(np.ones(4, dtype=np.float32))


@pytest.mark.parametrize("backend", ["socket", "dpdk", "bmv2"])
@pytest.mark.parametrize(
    "options",
    [["--uplink", "int", "--total-workers", "4"],
     ["--upstream", "127.0.0.1:47000", "--upstream-rank", "0", "--total-workers", "4"]],
)  # fmt: skip
def test_hierarchical_options_refused_on_c_and_p4_backends(
    capsys: pytest.CaptureFixture[str], backend: str, options: list[str]
) -> None:
    status = cli.main(["aggregator", "--backend", backend, "--job", "1", "--workers", "2",
                       "--result", "int", *options])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert status == 1
    assert err == (
        "ncina aggregator: error: hierarchical aggregation (--upstream, --uplink int, "
        f"--total-workers) is a python backend feature: the {backend} data plane does not "
        "carry int partial sums yet"
    )


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        (["--mode", "server", "--compressor", "qsgd", "--uplink", "int"],
         "hierarchical aggregation is INA mode's: server mode sums floats"),
        (["--result", "int", "--total-workers", "4"],
         "--total-workers is for a leaf (--upstream) or a spine (--uplink int)"),
        (["--result", "int", "--upstream", "127.0.0.1:1"],
         "--upstream and --upstream-rank go together (a leaf needs both)"),
        (["--result", "int", "--uplink", "int", "--total-workers", "5"],
         "a spine's 5 total workers must be a multiple of its 2 leaves"),
        (["--result", "nc8", "--uplink", "int", "--total-workers", "4", "--k", "200"],
         "partial sums sent up as int: a result frame of k=200 int elements"),
    ],
)  # fmt: skip
def test_hierarchical_options_checked(
    capsys: pytest.CaptureFixture[str], options: list[str], reason: str
) -> None:
    status = cli.main(["aggregator", "--job", "1", "--workers", "2", "--listen", "127.0.0.1:0",
                       *options])  # fmt: skip
    assert status == 1
    assert reason in capsys.readouterr().err
