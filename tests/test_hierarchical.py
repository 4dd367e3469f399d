"""Hierarchical (leaf-spine) aggregation with real processes.

A spine (``--uplink int``, ``--workers L``) and ``L`` leaves (``--upstream``, ``--workers W``),
every one with ``--total-workers N = L * W``, and ``N`` ``AllreduceClient`` workers (threads)
with ``total_workers=N``: int results must be the exact sum over all ``N`` workers, and nc8
results the bytes a one-level aggregator of the same seed sends for the same inputs, with and
without emulated loss on every aggregator (docs/protocol.md, "Hierarchical aggregation").

The leaves and the spine run on python and on the C engine (``LEAVES``, ``SPINES``): socket on
loopback, dpdk in its namespace (the others and the workers then listen on the host's address on
the tests' bridge; a dpdk leaf resolves its spine's MAC by ARP). The fault options are python's:
under loss, a C spine's python leaves drop, duplicate and reorder, and socket and dpdk leaves
have a lossy python spine.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ncina.aggregator.backends.python.pipeline import Aggregator
from ncina.aggregator.hierarchy import LeafAggregator, SpineSlots, Upstream
from ncina.aggregator.jobs import JobConfig
from ncina.proto import nc8
from ncina.proto.descriptor import JobMismatchError
from ncina.worker.client import AllreduceClient
from ncina_testlib import (
    counters,
    dissect,
    exact_sums,
    launch_aggregator,
    start_aggregator,
    uplink,
    window_e_min,
    worker_host,
)

from ncina import cli
from ncina.harness.aggregators import RunningAggregator
from ncina.harness.reference import powers_of_two

JOB = 23
K = 64  # int frames of 64 elements fit MTU 1500 (the largest is 182)
POOL = 8
SEED = 77
# Three calls per worker: sizes that use every slot several times, and a short last chunk.
SIZES = (1000, 3 * POOL * K + 5, 130)

pytestmark = pytest.mark.timeout(120)

LOSS = ["--drop-up", "0.05", "--drop-down", "0.05", "--duplicate", "0.05", "--reorder", "0.05"]
# Besides the random loss, a fixed pattern: the 7th, 14th, ... datagram from and to each peer
# (aggregator/backends/python/faults.py), so that every peer of a lossy aggregator loses some, by
# construction.
DROP_EVERY = ["--drop-every", "7"]
SPINES = ["python", "socket", "dpdk"]  # the backends that serve as a spine
LEAVES = ["python", "socket", "dpdk"]  # the backends that serve as a leaf


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
    leaf_extra: Sequence[str] = (), spine_backend: str = "python", leaf_backend: str = "python",
) -> Tree:  # fmt: skip
    """A spine on ``spine_backend`` and ``leaves`` leaves on ``leaf_backend`` of ``width``
    workers each, each listening where the other can reach it (``worker_host``: a dpdk spine or
    leaf in its namespace on the tests' bridge, the other on the bridge's host address)."""
    total = leaves * width
    spine = start_aggregator(
        spine_backend, workdir / "spine", job=JOB, workers=leaves, k=K, result=result,
        extra=["--uplink", "int", "--total-workers", str(total), "--seed", str(SEED),
               "--pool-size", str(POOL), *spine_extra],
        listen=f"{worker_host(leaf_backend)}:0",
    )  # fmt: skip
    host, port = spine.address
    listen = f"{worker_host(spine_backend)}:0"
    running: list[RunningAggregator] = []
    try:
        for r in range(leaves):
            extra = [
                "--total-workers", str(total), "--upstream", f"{host}:{port}",
                "--upstream-rank", str(r), "--pool-size", str(POOL),
                *[a.replace("SEED", str(100 + r)) for a in leaf_extra],
            ]  # fmt: skip
            running.append(start_aggregator(leaf_backend, workdir / f"leaf{r}", job=JOB,
                                            workers=width, k=K, result=result, extra=extra,
                                            listen=listen))  # fmt: skip
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
    calls: list[list[np.ndarray]], key: bytes | None = None, data_path: str = "c",
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
                pool_size=POOL, result_format=result, seed=g, deadline=30.0, key=key,
                data_path=data_path,
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


def exact_float_sums(total: int, calls: list[list[np.ndarray]]) -> list[np.ndarray]:
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
            assert up["packets_in"] == (
                up["results"] + up["late"] + up["notices"] + up["handshakes"]
                + sum(up["drops"].values())
            ), doc
            assert up["packets_out"] == up["sent"] + up["resent"] + up["hellos"], doc
            if "dpdk" in doc:  # each datagram went up in a frame, or waited for the spine's MAC
                io = doc["dpdk"]
                assert up["packets_out"] == io["uplink_frames"] + io["uplink_no_mac"], doc
                # The first hello found no MAC: an ARP request instead; its reply was learned.
                assert io["uplink_no_mac"] >= 1 and io["arp_requests"] >= 1, doc
                assert io["spine_mac_learned"] >= 1 and io["uplink_frames"] >= 1, doc


@pytest.mark.parametrize(
    ("leaves", "width", "keyed", "data_path", "spine", "leaf"),
    [
        (2, 2, False, "c", "python", "python"), (2, 4, False, "c", "python", "python"),
        (2, 2, True, "c", "python", "python"), (2, 2, False, "python", "python", "python"),
        (2, 2, False, "c", "socket", "python"), (2, 4, False, "c", "socket", "python"),
        (2, 2, True, "c", "socket", "python"), (2, 2, True, "c", "dpdk", "python"),
        (2, 2, False, "c", "python", "socket"), (2, 2, True, "c", "python", "socket"),
        (2, 4, False, "c", "socket", "socket"), (3, 2, True, "c", "socket", "socket"),
        (2, 2, False, "c", "python", "dpdk"), (2, 2, True, "c", "socket", "dpdk"),
        (2, 2, True, "c", "dpdk", "dpdk"),
    ],
)  # fmt: skip
def test_hierarchical_int_results_are_the_exact_sum(
    tmp_path: Path, trees: list[Tree], leaves: int, width: int, keyed: bool, data_path: str,
    spine: str, leaf: str,
) -> None:  # fmt: skip
    """Keyed: every datagram of the tree tagged, the leaves' partial sums and the spine's
    results included (a leaf signs with the job's key, as a worker does). The workers' C data
    path and the Python reference loop alike; the spine and the leaves on python and on the C
    engine."""
    key = bytes(range(32)) if keyed else None
    key_option: list[str] = []
    if key is not None:
        (tmp_path / "job.key").write_text(key.hex())
        key_option = ["--key-file", str(tmp_path / "job.key")]
    tree = start_tree(tmp_path, leaves, width, "int", spine_extra=key_option,
                      leaf_extra=key_option, spine_backend=spine, leaf_backend=leaf)  # fmt: skip
    trees.append(tree)
    calls = inputs(tree.total, "powers")
    got = run_workers([tree.worker_site(g) for g in range(tree.total)], workers=width,
                      total=tree.total, result="int", calls=calls, key=key,
                      data_path=data_path)  # fmt: skip
    for c, want in enumerate(exact_float_sums(tree.total, calls)):
        for g in range(tree.total):
            assert got[c][g].tobytes() == want.tobytes(), (c, g)
    check_accounting(tree)
    served = tree.spine.stats()["jobs"][str(JOB)]
    chunks = sum(-(-n // K) for n in SIZES)
    assert served["slots_completed"] == chunks + 1  # + 1: the workers' first call (zeros)
    assert served["contributions"] == (chunks + 1) * leaves


@pytest.mark.parametrize(("spine", "leaf"), [("python", "socket"), ("socket", "python")])
def test_hierarchical_int32_results_are_the_exact_sum(
    tmp_path: Path, trees: list[Tree], spine: str, leaf: str
) -> None:
    """int32 results in a tree: the spine encodes the total (its window, like every member's,
    is the int32 window of all N workers: 2^-18..2^10 for 4), the leaves pass its 4-byte
    results down unchanged (partial sums still go up as int); on the reference and on the C
    engine, each in both roles. Powers of two from 2^-18: every sum exact."""
    tree = start_tree(tmp_path, 2, 2, "int32", spine_backend=spine, leaf_backend=leaf)
    trees.append(tree)
    calls = [[powers_of_two(n, seed=1000 * c + g, lowest=-18) for g in range(tree.total)]
             for c, n in enumerate(SIZES)]  # fmt: skip
    got = run_workers([tree.worker_site(g) for g in range(tree.total)], workers=2,
                      total=tree.total, result="int32", calls=calls)  # fmt: skip
    for c, want in enumerate(exact_float_sums(tree.total, calls)):
        for g in range(tree.total):
            assert got[c][g].tobytes() == want.tobytes(), (c, g)
    check_accounting(tree)
    for running in tree.leaves:  # the spine's results (the workers take int32 only), to both
        results = running.stats()["upstream"]["results"]
        assert running.stats()["jobs"][str(JOB)]["results_sent"] == 2 * results > 0


@pytest.mark.parametrize("leaf", LEAVES)
@pytest.mark.parametrize("spine", ["python", "socket"])
def test_hierarchical_a_new_set_of_workers_restarts_the_tree(
    tmp_path: Path, trees: list[Tree], spine: str, leaf: str
) -> None:
    """A second set of clients (offsets from 0 again) on the same leaves and spine: their hellos
    start the idle leaves afresh, and the leaves' hellos the idle spine, so every call completes
    exactly again (docs/protocol.md, "A new set of workers")."""
    quiet = ["--restart-idle", "0"]  # restart whenever idle (the default waits 10 s)
    tree = start_tree(tmp_path, 2, 2, "int", spine_backend=spine, leaf_backend=leaf,
                      spine_extra=quiet, leaf_extra=quiet)  # fmt: skip
    trees.append(tree)
    calls = inputs(tree.total, "powers")
    sites = [tree.worker_site(g) for g in range(tree.total)]
    want = exact_float_sums(tree.total, calls)
    for _ in range(2):
        got = run_workers(sites, workers=2, total=tree.total, result="int", calls=calls)
        for c in range(len(calls)):
            assert all(got[c][g].tobytes() == want[c].tobytes() for g in range(tree.total))
    check_accounting(tree)
    assert tree.spine.stats()["jobs"][str(JOB)]["slots_completed"] == 2 * (sum(
        -(-n // K) for n in SIZES
    ) + 1)  # + 1: the workers' first call (zeros, as a flat job's agreement)
    assert all(running.stats()["upstream"]["hellos"] >= 2 for running in tree.leaves)


@pytest.mark.parametrize(
    ("spine", "leaf"), [*((spine, "python") for spine in SPINES), ("python", "socket"),
                        ("socket", "socket"), ("socket", "dpdk")],
)  # fmt: skip
def test_hierarchical_nc8_results_equal_one_level(
    tmp_path: Path, trees: list[Tree], spine: str, leaf: str
) -> None:
    """The spine's re-compressed results are the bytes of a one-level python aggregator of the
    same seed, whichever backends the spine and the leaves run on."""
    tree = start_tree(tmp_path, 2, 2, "nc8", spine_backend=spine, leaf_backend=leaf)
    trees.append(tree)
    calls = inputs(tree.total, "normal")
    got = run_workers([tree.worker_site(g) for g in range(tree.total)], workers=2,
                      total=tree.total, result="nc8", calls=calls)  # fmt: skip
    want = one_level(tmp_path, tree.total, "nc8", calls)
    for c in range(len(calls)):
        for g in range(tree.total):
            assert got[c][g].tobytes() == want[c][g].tobytes(), (c, g)
    check_accounting(tree)


@pytest.mark.parametrize(
    ("spine", "leaf"),
    [("python", "python"), ("socket", "python"), ("python", "socket"), ("python", "dpdk")],
)
@pytest.mark.parametrize("result", ["int", "nc8"])
def test_hierarchical_results_survive_loss(
    tmp_path: Path, trees: list[Tree], result: str, spine: str, leaf: str
) -> None:
    """Seeded drops both ways, duplicates and reordering on every python leaf and on a python
    spine (the C backends have no fault options: a C spine's python leaves' faults hit the
    traffic both ways, and socket leaves lose partial sums and results at their lossy python
    spine): every call completes with the same results as without loss.

    The recovery paths are asserted where they follow from the fixed drop pattern, not from
    the random loss: a lossy python spine drops every leaf's 7th uplink datagram, a partial sum
    (a leaf sends its spine one hello, answered at once, then partial sums), which the spine
    never sees, so every C leaf must re-send one; python leaves drop the 7th, 14th, ... datagram
    from their C spine, mostly results (the rest are notices) of a slot the leaf waits for,
    whose workers' retransmissions make the leaf re-send its partial sum and the C spine answer
    it from its stored result."""
    faulty = spine == "python"
    tree = start_tree(
        tmp_path, 2, 2, result, spine_backend=spine, leaf_backend=leaf,
        spine_extra=[*LOSS, *DROP_EVERY, "--fault-seed", "9"] if faulty else [],
        leaf_extra=[*LOSS, *DROP_EVERY, "--fault-seed", "SEED"] if leaf == "python" else [],
    )  # fmt: skip
    trees.append(tree)
    calls = inputs(tree.total, "powers" if result == "int" else "normal")
    got = run_workers([tree.worker_site(g) for g in range(tree.total)], workers=2,
                      total=tree.total, result=result, calls=calls)  # fmt: skip
    want = (
        [[s] * tree.total for s in exact_float_sums(tree.total, calls)]
        if result == "int"
        else one_level(tmp_path, tree.total, result, calls)
    )
    for c in range(len(calls)):
        for g in range(tree.total):
            assert got[c][g].tobytes() == want[c][g].tobytes(), (c, g)
    check_accounting(tree)
    lossy = [*(tree.leaves if leaf == "python" else []), *([tree.spine] if faulty else [])]
    faults = [running.stats()["faults"] for running in lossy]
    assert all(f["dropped_up"] and f["dropped_down"] for f in faults), faults
    if leaf in ("socket", "dpdk"):  # every leaf re-sent the partial sum its spine dropped
        ups = [running.stats()["upstream"] for running in tree.leaves]
        assert all(up["resent"] for up in ups), ups
    if not faulty:  # the leaves' lost results reached the C spine as retransmissions
        served = tree.spine.stats()["jobs"][str(JOB)]
        assert served["retx_seen"] and served["results_resent"], served


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
@pytest.mark.parametrize("leaf_backend", LEAVES)
@pytest.mark.parametrize("backend", ["python", "socket"])
def test_hierarchical_handshake_mismatch_fails_fast(
    tmp_path: Path, spine_options: list[str], named: str, backend: str, leaf_backend: str
) -> None:
    """A leaf whose spine's job differs exits with status 1 before serving, the parameter
    named (it has the answer within one round trip, far inside its handshake timeout); the C
    engine's answer carries the uplink and the window of its total workers as python's."""
    workers = int(spine_options[1])
    spine = start_aggregator(
        backend, tmp_path / "spine", job=JOB, workers=workers, k=K, result="int",
        extra=["--pool-size", "8", *spine_options[2:]] if "--pool-size" not in spine_options
        else spine_options[2:], listen=f"{worker_host(leaf_backend)}:0",
    )  # fmt: skip
    try:
        host, port = spine.address
        leaf = launch_aggregator(
            leaf_backend, tmp_path / "leaf", job=JOB, workers=2, k=K, result="int",
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


LEAF_OPTIONS = ["--upstream", "127.0.0.1:47000", "--upstream-rank", "0", "--total-workers", "4"]


def test_hierarchical_dpdk_leaf_needs_its_own_address(capsys: pytest.CaptureFixture[str]) -> None:
    """A dpdk leaf sends from its --listen address (no kernel picks one): 0.0.0.0 is refused
    before EAL starts."""
    binding = pytest.importorskip("ncina.aggregator.backends.dpdk.binding")
    if binding.missing() is not None:
        pytest.skip(f"dpdk backend: {binding.missing()}")
    status = cli.main(["aggregator", "--backend", "dpdk", "--iface", "lo", "--job", "1",
                       "--workers", "2", "--result", "int", *LEAF_OPTIONS])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert status == 1
    assert err == (
        "ncina aggregator: error: a dpdk leaf (--upstream) needs --listen with its own IPv4 "
        "address: its partial sums and ARP requests come from it, the spine's results go to it"
    )


@pytest.mark.parametrize("options", [["--uplink", "int", "--total-workers", "4"], LEAF_OPTIONS])
def test_hierarchical_options_refused_on_bmv2(
    capsys: pytest.CaptureFixture[str], options: list[str]
) -> None:
    status = cli.main(["aggregator", "--backend", "bmv2", "--job", "1", "--workers", "2",
                       "--result", "int", *options])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert status == 1
    assert err == (
        "ncina aggregator: error: hierarchical aggregation (--upstream, --uplink int, "
        "--total-workers) is not available on bmv2: the P4 program does not carry int "
        "partial sums"
    )


def test_hierarchical_c_spine_checks_its_leaves_int_frames(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A socket spine refuses, as a python one, a K whose int partial sums exceed the MTU."""
    status = cli.main(["aggregator", "--backend", "socket", "--job", "1", "--workers", "2",
                       "--listen", "127.0.0.1:0", "--result", "nc8", "--uplink", "int",
                       "--total-workers", "4", "--k", "200"])  # fmt: skip
    assert status == 1
    assert "k=200 int elements take 1600 payload bytes, more than a datagram has at MTU 1500" in (
        capsys.readouterr().err
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
         "k=200 int elements take 1600 payload bytes, more than a datagram has at MTU 1500"),
    ],
)  # fmt: skip
def test_hierarchical_options_checked(
    capsys: pytest.CaptureFixture[str], options: list[str], reason: str
) -> None:
    status = cli.main(["aggregator", "--job", "1", "--workers", "2", "--listen", "127.0.0.1:0",
                       *options])  # fmt: skip
    assert status == 1
    assert reason in capsys.readouterr().err


# ---- the leaf's and the spine's logic, datagram by datagram (no sockets) ----

SPINE = ("10.0.1.1", 47000)
LEAF_GENERATION, SPINE_GENERATION = 3, 5


def worker_address(rank: int) -> tuple[str, int]:
    return (f"10.0.0.{rank + 1}", 5000 + rank)


def leaf_logic(result: str = "nc8") -> LeafAggregator:
    """A leaf of 2 workers (4 in total) at rank 1 of ``SPINE``, after its handshake."""
    leaf = LeafAggregator(Upstream(SPINE, 1), LEAF_GENERATION)
    leaf.add_leaf(JobConfig.create(job=JOB, workers=2, k=8, result_format=result,
                                   pool_size=POOL, total_workers=4))  # fmt: skip
    leaf.upstream.generation = SPINE_GENERATION
    return leaf


def test_hierarchical_leaf_sends_the_exact_partial_sum_up_and_the_spine_result_down() -> None:
    leaf = leaf_logic()
    emin = window_e_min(4)
    codes = [[0x01, 0x82, 0x10, 0x00, 0x3D, 0xBD, 0x05, 0x3D], [0x01, 0x02, 0x90, 0x00,
             0x3D, 0x3D, 0x85, 0x01]]  # fmt: skip
    slot, offset = 2, 2 + 2 * POOL  # the slot's third use: version 0
    sent = [list(leaf.handle(uplink(job=JOB, rank=r, slot=slot, offset=offset, codes=c,
                                    emin=emin), worker_address(r)))
            for r, c in enumerate(codes)]  # fmt: skip
    assert sent[0] == []
    sums = exact_sums(codes)
    up = struct.pack("!BBBbHHHHI", 1, SPINE_GENERATION << 3, 1, emin, JOB, 1, slot, 8, offset)
    up += b"".join(struct.pack("!q", s) for s in sums)
    assert sent[1] == [(up, SPINE)]  # the exact sum, once, to the spine, as rank 1
    # A worker's retransmission while the leaf waits: the same partial sum again, RETX set.
    retx = uplink(job=JOB, rank=0, slot=slot, offset=offset, codes=codes[0], emin=emin, retx=True)
    again = bytearray(up)
    again[1] |= 0x02
    assert list(leaf.handle(retx, worker_address(0))) == [(bytes(again), SPINE)]
    # The spine's result (its generation, the leaf's rank there) goes to both workers.
    result_codes = bytes(range(0x30, 0x38))
    result = struct.pack("!BBBbHHHHI", 1, 0x01 | SPINE_GENERATION << 3, 0, emin, JOB, 1, slot, 8,
                         offset) + result_codes  # fmt: skip
    down = list(leaf.handle(result, SPINE))
    assert [(dissect(d)[0]["rank"], d[1] >> 3, dissect(d)[1], to) for d, to in down] == [
        (r, LEAF_GENERATION, result_codes, worker_address(r)) for r in range(2)
    ]
    # The same result again is late; a worker's retransmission now gets the stored result.
    assert list(leaf.handle(result, SPINE)) == []
    assert list(leaf.handle(retx, worker_address(0))) == [down[0]]
    stats = leaf.upstream.stats.to_json()
    assert {k: stats[k] for k in ("sent", "resent", "results", "late")} == {
        "sent": 1, "resent": 1, "results": 1, "late": 1,
    }
    job = leaf.jobs[JOB].stats
    assert (job.slots_completed, job.results_sent, job.results_resent) == (1, 2, 1)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"generation": 6}, "stale_generation"),
        ({"rank": 0}, "non_member"),
        ({"fmt": 1}, "bad_length"),  # 8 bytes of nc8 codes are no 8 int elements
        ({"emin": 0}, "window_mismatch"),
        ({"slot": POOL}, "bad_slot"),
        ({"flags": 0}, "bad_flags"),
        ({"job": JOB + 1}, "unknown_job"),
        ({"offset": 2}, None),  # another chunk: late
    ],
)  # fmt: skip
def test_hierarchical_leaf_drops_a_wrong_spine_result_and_keeps_waiting(
    change: dict[str, int], reason: str | None
) -> None:
    leaf = leaf_logic()
    emin = window_e_min(4)
    slot, offset = 2, 2 + 2 * POOL
    for r in range(2):
        leaf.handle(uplink(job=JOB, rank=r, slot=slot, offset=offset, codes=[1] * 8, emin=emin),
                    worker_address(r))  # fmt: skip
    fields = {"flags": 0x01 | SPINE_GENERATION << 3, "fmt": 0, "emin": emin, "job": JOB,
              "rank": 1, "slot": slot, "offset": offset, **change}  # fmt: skip
    if "generation" in fields:
        fields["flags"] = 0x01 | fields.pop("generation") << 3
    header = struct.pack("!BBBbHHHHI", 1, fields["flags"], fields["fmt"], fields["emin"],
                         fields["job"], fields["rank"], fields["slot"], 8, fields["offset"])
    assert list(leaf.handle(header + bytes(8), SPINE)) == []
    stats = leaf.upstream.stats.to_json()
    assert stats["late"] == (reason is None)
    assert sum(stats["drops"].values()) == (reason is not None)
    if reason is not None:
        assert stats["drops"][reason] == 1
    assert leaf.leaf is not None and leaf.leaf.waiting(0, slot)


def test_hierarchical_spine_drops_partial_sums_beyond_what_its_leaves_can_sum() -> None:
    """A spine of 2 leaves and 4 workers takes partial sums up to 2 * 2**span in magnitude
    (two workers' largest codes), so that no two of them overflow."""
    config = JobConfig.create(job=JOB, workers=2, k=2, result_format="int", pool_size=POOL,
                              total_workers=4, uplink_format="int")  # fmt: skip
    spine = Aggregator(1)
    slots = spine.install(SpineSlots(config))
    top = 2 << config.window.span
    emin = config.window.e_min

    def send(rank: int, slot: int, values: list[int]) -> list[tuple[bytes, tuple[str, int]]]:
        payload = b"".join(struct.pack("!q", v) for v in values)
        datagram = struct.pack("!BBBbHHHHI", 1, 0, 1, emin, JOB, rank, slot, 2, slot) + payload
        return list(spine.handle(datagram, worker_address(rank)))

    assert send(0, 0, [top + 1, 0]) == [] and send(0, 0, [0, -top - 1]) == []
    assert slots.stats.drops["bad_code"] == 2
    assert send(0, 0, [top, -top]) == []
    out = send(1, 0, [top, -top])
    assert [dissect(d)[1] for d, _ in out] == [struct.pack("!qq", 2 * top, -2 * top)] * 2


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(
            st.booleans(),  # from the spine (else from a worker)
            st.integers(0, 1), st.integers(0, 3), st.integers(0, 1),  # rank, slot, version
            st.integers(0, 40), st.integers(0, 255), st.integers(0, 40),  # one byte, a cut
        ),
        max_size=60,
    )
)
def test_hierarchical_leaf_fuzz_never_raises_and_counts_everything(items: list[Any]) -> None:
    """Mostly valid worker chunks and spine results with one byte replaced or the end cut: the
    leaf never raises, everything it sends goes to a worker or the spine, and both sides'
    counters account for every datagram."""
    leaf = leaf_logic("int")
    emin = window_e_min(4)
    from_workers = 0
    for from_spine, rank, slot, version, where, byte, cut in items:
        offset = slot + version * POOL  # each slot's use 0 or 1
        if from_spine:
            good = struct.pack("!BBBbHHHHI", 1, 0x01 | version << 2 | SPINE_GENERATION << 3, 1,
                               emin, JOB, 1, slot, 2, offset) + struct.pack("!qq", 3, -5)
        else:
            good = uplink(job=JOB, rank=rank, slot=slot, offset=offset, codes=[1, 0x83],
                          emin=emin, pool=version)  # fmt: skip
        datagram = bytearray(good[: len(good) - cut] if cut < 8 else good)
        if where < len(datagram):
            datagram[where] = byte
        source = SPINE if from_spine else worker_address(rank)
        from_workers += not from_spine
        for out, destination in leaf.handle(bytes(datagram), source):
            assert destination in {SPINE, worker_address(0), worker_address(1)}
            assert out[1] & 0x01 or destination == SPINE
    up = leaf.upstream.stats.to_json()
    job = leaf.jobs[JOB].stats.to_json()
    assert up["packets_in"] == len(items) - from_workers == (
        up["results"] + up["late"] + up["notices"] + up["handshakes"] + sum(up["drops"].values())
    )
    assert job["packets_in"] + leaf.stats.packets_in == from_workers
    assert job["packets_in"] == (
        job["contributions"] + job["duplicates"] + job["results_resent"] + job["handshakes"]
        + sum(job["drops"].values()) + up["resent"]
    )
    assert up["packets_out"] == up["sent"] + up["resent"] + up["hellos"]


# ---- a dpdk leaf's frames, offline (the C engine and the DPDK frame layer, no EAL) ----

LEAF_IP, LEAF_PORT, LEAF_MAC = "10.0.0.100", 47000, "02:00:00:00:0a:01"
SPINE_MAC = "02:00:00:00:0c:01"


def worker_mac(rank: int) -> str:
    return f"02:00:00:00:0b:{rank + 1:02x}"


@pytest.fixture
def dpdk_leaf() -> Iterator[Any]:
    """The DPDK extension's data plane as the leaf of ``leaf_logic`` (rank 1 of ``SPINE``, the
    spine's generation learned) at ``LEAF_IP``, with ARP requests at most once an hour (so a
    second one within the test is never due)."""
    binding = pytest.importorskip("ncina.aggregator.backends.dpdk.binding")
    reason = binding.missing()
    if reason is not None:
        pytest.skip(f"dpdk backend: {reason}")
    from ncina.aggregator.backends.dpdk.driver import DataPlane

    plane = DataPlane(binding.load())
    plane.reset()
    plane.set_mac(LEAF_MAC)
    plane.set_address((LEAF_IP, LEAF_PORT))
    plane.set_generation(LEAF_GENERATION)
    plane.set_spine(SPINE)
    plane.lib.ncd_set_arp_interval(0xFFFFFFFF)
    yield plane
    plane.set_spine(None)
    plane.lib.ncd_set_arp_interval(100_000)
    plane.reset()
    plane.set_generation(0)


def offline_frames(plane: Any, raw: bytes) -> list[bytes]:
    """Feed one frame to the offline data plane; the frames it sends."""
    ffi, lib = plane.ffi, plane.lib
    stride, slots = 2048, 8
    out = ffi.new(f"uint8_t[{stride * slots}]")
    lens = ffi.new(f"uint32_t[{slots}]")
    n = lib.ncd_process_frame(raw, len(raw), out, stride, slots, lens)
    assert n >= 0
    return [bytes(ffi.buffer(out)[i * stride : i * stride + lens[i]]) for i in range(n)]


def udp_frame(datagram: bytes, src: tuple[str, int], src_mac: str, dst_mac: str = LEAF_MAC,
              dst: tuple[str, int] = (LEAF_IP, LEAF_PORT)) -> bytes:  # fmt: skip
    """An Ethernet/IPv4/UDP frame as the data plane builds them (DF, TTL 64, id 0)."""
    from scapy.layers.inet import IP, UDP
    from scapy.layers.l2 import Ether
    from scapy.packet import Raw

    return bytes(Ether(src=src_mac, dst=dst_mac) / IP(src=src[0], dst=dst[0], flags="DF", id=0)
                 / UDP(sport=src[1], dport=dst[1]) / Raw(datagram))  # fmt: skip


def io_counters(plane: Any) -> dict[str, int]:
    c = plane.ffi.new("struct ncd_io *")
    plane.lib.ncd_io_stats(c)
    names = ("uplink_frames", "uplink_no_mac", "arp_requests", "spine_mac_learned")
    return {name: getattr(c, name) for name in names}


@pytest.mark.parametrize("learn_by", ["arp_reply", "arp_request"])
def test_hierarchical_dpdk_leaf_sends_up_once_it_knows_the_spines_mac(
    dpdk_leaf: Any, learn_by: str
) -> None:
    """A dpdk leaf's partial sums go up in frames to the spine's MAC, the datagrams the python
    leaf sends: before the MAC is known each is dropped and counted and an ARP request for the
    spine's address goes out instead (one per ARP interval); the MAC is learned from the
    spine's ARP reply, its ARP request, or any frame from its address; then the next
    retransmission's partial sums go up, and the spine's result comes down to both workers.
    (ARP only teaches the MAC, not a datagram claiming the spine's address: the next test.)"""
    from scapy.layers.l2 import ARP, Ether

    plane = dpdk_leaf
    reference = leaf_logic()
    plane.add_job(reference.leaf.config)
    plane.set_upstream(JOB, reference)
    emin = window_e_min(4)
    slot, offset = 2, 2 + 2 * POOL
    codes = [[0x01, 0x82, 0x10, 0x00, 0x3D, 0xBD, 0x05, 0x3D], [0x01, 0x02, 0x90, 0x00,
             0x3D, 0x3D, 0x85, 0x01]]  # fmt: skip

    def from_worker(rank: int, retx: bool = False) -> tuple[list[Any], list[bytes]]:
        datagram = uplink(job=JOB, rank=rank, slot=slot, offset=offset, codes=codes[rank],
                          emin=emin, retx=retx)  # fmt: skip
        want = list(reference.handle(datagram, worker_address(rank)))
        return want, offline_frames(plane, udp_frame(datagram, worker_address(rank),
                                                     worker_mac(rank)))  # fmt: skip

    assert from_worker(0) == ([], [])
    want, got = from_worker(1)  # the slot completes: its sum is due at the spine
    assert [to for _, to in want] == [SPINE]
    arp_request = Ether(src=LEAF_MAC, dst="ff:ff:ff:ff:ff:ff") / ARP(
        op=1, hwsrc=LEAF_MAC, psrc=LEAF_IP, hwdst="00:00:00:00:00:00", pdst=SPINE[0]
    )
    assert got == [bytes(arp_request)]
    want, got = from_worker(0, retx=True)  # resent by the python leaf; no ARP request due
    assert [to for _, to in want] == [SPINE] and got == []
    assert io_counters(plane) == {"uplink_frames": 0, "uplink_no_mac": 2, "arp_requests": 1,
                                  "spine_mac_learned": 0}  # fmt: skip

    if learn_by == "arp_reply":
        learned = offline_frames(plane, bytes(Ether(src=SPINE_MAC, dst=LEAF_MAC) / ARP(
            op=2, hwsrc=SPINE_MAC, psrc=SPINE[0], hwdst=LEAF_MAC, pdst=LEAF_IP)))  # fmt: skip
        assert learned == []
    elif learn_by == "arp_request":  # the spine asks for the leaf's MAC: answered, and learned
        learned = offline_frames(plane, bytes(Ether(src=SPINE_MAC, dst="ff:ff:ff:ff:ff:ff") / ARP(
            op=1, hwsrc=SPINE_MAC, psrc=SPINE[0], pdst=LEAF_IP)))  # fmt: skip
        assert [Ether(f)[ARP].op for f in learned] == [2]
        assert Ether(learned[0]).dst == SPINE_MAC
    else:  # a (truncated) datagram from the spine: dropped as the python leaf drops it
        assert list(reference.handle(b"\x01", SPINE)) == []
        assert offline_frames(plane, udp_frame(b"\x01", SPINE, SPINE_MAC)) == []
    assert plane.spine_mac == SPINE_MAC

    want, got = from_worker(1, retx=True)
    assert [to for _, to in want] == [SPINE]
    assert got == [udp_frame(want[0][0], (LEAF_IP, LEAF_PORT), LEAF_MAC, SPINE_MAC, SPINE)]
    assert io_counters(plane) == {"uplink_frames": 1, "uplink_no_mac": 2, "arp_requests": 1,
                                  "spine_mac_learned": 1}  # fmt: skip

    result = struct.pack("!BBBbHHHHI", 1, 0x01 | SPINE_GENERATION << 3, 0, emin, JOB, 1, slot,
                         8, offset) + bytes(range(0x30, 0x38))  # fmt: skip
    want = list(reference.handle(result, SPINE))
    got = offline_frames(plane, udp_frame(result, SPINE, SPINE_MAC))
    assert got == [udp_frame(d, (LEAF_IP, LEAF_PORT), LEAF_MAC, worker_mac(r), to)
                   for r, (d, to) in enumerate(want)]  # fmt: skip
    assert plane.upstream_stats().to_json() == reference.upstream.stats.to_json()
    assert plane.job_stats(JOB).to_json() == reference.jobs[JOB].stats.to_json()


def test_hierarchical_dpdk_leaf_learns_the_spines_mac_from_arp_only(dpdk_leaf: Any) -> None:
    """Issue 27, finding 6: a host on the link that sends any datagram claiming the spine's IP
    and port redirected the leaf's partial sums to its MAC (learned before any check). The leaf
    learns the spine's MAC from ARP only, as a host's stack does: such datagrams neither teach
    nor change it."""
    from scapy.layers.l2 import ARP, Ether

    plane = dpdk_leaf
    reference = leaf_logic()
    plane.add_job(reference.leaf.config)
    plane.set_upstream(JOB, reference)
    stranger = "02:00:00:00:66:66"
    offline_frames(plane, udp_frame(b"\x01", SPINE, stranger))
    assert plane.spine_mac is None
    offline_frames(plane, bytes(Ether(src=SPINE_MAC, dst=LEAF_MAC) / ARP(
        op=2, hwsrc=SPINE_MAC, psrc=SPINE[0], hwdst=LEAF_MAC, pdst=LEAF_IP)))  # fmt: skip
    assert plane.spine_mac == SPINE_MAC
    offline_frames(plane, udp_frame(b"\x01", SPINE, stranger))
    assert plane.spine_mac == SPINE_MAC
    assert io_counters(plane)["spine_mac_learned"] == 1


def test_a_worker_under_a_leaf_defaults_to_the_trees_k() -> None:
    """Without --k a worker takes the largest K for its result frames (1456 nc8 lanes at MTU
    1500); under a leaf (total > workers) the tree's K is the leaf's, the largest for int lanes
    (182), so the two meet at the handshake instead of failing it."""
    alone = AllreduceClient(("127.0.0.1", 9), job=JOB, rank=0, workers=2)
    leafed = AllreduceClient(("127.0.0.1", 9), job=JOB, rank=0, workers=2, total_workers=4)
    try:
        assert (alone.k, leafed.k) == (1456, 182)
    finally:
        alone.close()
        leafed.close()
