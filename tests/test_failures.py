"""Faults: a worker that dies and an aggregator that restarts during an all-reduce.

The promise (docs/reliability.md): nobody hangs without a clear error and nothing partial is
returned. A killed worker makes the others fail after their deadline with an error naming its
rank (from the aggregator's notices); a restarted aggregator (a new generation) makes every
worker in the call fail at once; packets of an old generation are dropped and counted. The
mechanism is docs/protocol.md, "Generations and notices"; the end-to-end scenarios are
``ncina.harness.faults``'s (which ``ncina bench reliability`` runs too). The end-to-end tests run
on both worker data paths.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from ncina.aggregator.jobs import JobConfig
from ncina.aggregator.pipeline import Aggregator
from ncina.proto.header import HEADER, NOTICE, Header, flags_for
from ncina.worker.client import (
    DATA_PATH_ENV,
    DATA_PATHS,
    AggregatorRestartedError,
    AllreduceClient,
)
from ncina_testlib import start_aggregator, uplink

from ncina.harness.faults import JOB, allreduce_across_restart, allreduce_with_dead_worker

pytestmark = pytest.mark.timeout(120)

WORKERS = 4
K = 128
ELEMENTS = 200_000
CHUNKS = -(-ELEMENTS // K)


def inputs() -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    return [rng.standard_normal(ELEMENTS).astype(np.float32) for _ in range(WORKERS)]


# --- the aggregator's side, without sockets -----------------------------------------------------


def aggregator(generation: int) -> tuple[Aggregator, int]:
    agg = Aggregator(generation)
    config = JobConfig.create(job=JOB, workers=3, k=8, result_format="int", pool_size=4)
    agg.add_job(config)
    return agg, config.window.e_min


def packet(emin: int, rank: int, *, generation: int = 0, retx: bool = False) -> bytes:
    # 8 elements: a stale packet as long as its notice is answered (docs/protocol.md)
    return uplink(job=JOB, rank=rank, slot=1, offset=4, codes=[1] * 8, emin=emin,
                  flags=flags_for(0, retx=retx, generation=generation))  # fmt: skip


def address(rank: int) -> tuple[str, int]:
    return ("10.0.0.1", 5000 + rank)


def test_stale_generation_is_dropped_counted_and_answered_by_a_notice() -> None:
    agg, emin = aggregator(7)
    out = list(agg.handle(packet(emin, 0, generation=3), address(0)))
    stats = agg.jobs[JOB].stats
    assert stats.drops["stale_generation"] == 1 and stats.contributions == 0
    assert stats.notices_sent == stats.packets_out == 1
    [(datagram, destination)] = out
    assert destination == address(0) and len(datagram) == 16 + NOTICE.size
    header, payload = datagram[:16], datagram[16:]
    notice = Header._make(HEADER.unpack(header))
    assert notice.generation == 7 and notice.is_result and notice.count == 0
    assert NOTICE.unpack(payload) == (0,)  # no contributor
    # Unstamped and correctly stamped packets both count.
    assert not list(agg.handle(packet(emin, 0), address(0)))
    assert not list(agg.handle(packet(emin, 1, generation=7), address(1)))
    assert stats.contributions == 2


def test_a_duplicate_of_an_incomplete_slot_gets_the_contributors_bitmap() -> None:
    agg, emin = aggregator(2)
    agg.handle(packet(emin, 0), address(0))
    agg.handle(packet(emin, 2), address(2))
    [(datagram, destination)] = agg.handle(packet(emin, 0, retx=True), address(0))
    assert destination == address(0)
    assert NOTICE.unpack(datagram[16:]) == (0b101,)  # ranks 0 and 2 are in, rank 1 is missing
    results = list(agg.handle(packet(emin, 1), address(1)))
    assert len(results) == 3 and all(d[1] >> 3 == 2 for d, _ in results)  # stamped results


def test_generation_zero_keeps_the_old_protocol() -> None:
    agg, emin = aggregator(0)
    assert not list(agg.handle(packet(emin, 0, generation=3), address(0)))
    agg.handle(packet(emin, 0), address(0))
    assert not list(agg.handle(packet(emin, 0, retx=True), address(0)))
    stats = agg.jobs[JOB].stats
    assert stats.drops["bad_flags"] == 1 and stats.notices_sent == 0 and stats.duplicates == 1


# --- end to end ---------------------------------------------------------------------------------


@pytest.fixture(params=DATA_PATHS)
def data_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The workers' data path (through the environment, which worker processes inherit)."""
    monkeypatch.setenv(DATA_PATH_ENV, request.param)
    return str(request.param)


@pytest.mark.usefixtures("data_path")
def test_a_killed_worker_makes_the_others_fail_naming_its_rank(tmp_path: Path) -> None:
    deadline = 1.0
    began = time.monotonic()
    run = allreduce_with_dead_worker(inputs(), tmp_path, k=K, result="int", deadline=deadline,
                                     at=CHUNKS // 4)  # fmt: skip
    assert CHUNKS // 4 <= run.killed_at < CHUNKS  # killed mid-allreduce
    *survivors, killed = run.outcomes
    assert killed is None
    for rank, outcome in enumerate(survivors):
        assert isinstance(outcome, TimeoutError), outcome
        assert f"rank {rank})" in str(outcome)
        assert "the aggregator has nothing from rank(s) [3]" in str(outcome)
        # bounded by the deadline after the last progress (how long that took in wall-clock
        # time is the machine's business, not the test's)
        assert f"for {deadline:g} s" in str(outcome)
    assert run.seconds < time.monotonic() - began


@pytest.mark.usefixtures("data_path")
def test_an_aggregator_restart_fails_every_worker_at_once_without_a_result(tmp_path: Path) -> None:
    run = allreduce_across_restart(inputs(), tmp_path, k=K, result="int", deadline=30.0,
                                   at=CHUNKS // 4)  # fmt: skip
    assert CHUNKS // 4 <= run.killed_at < CHUNKS
    for outcome in run.outcomes:
        assert isinstance(outcome, AggregatorRestartedError), outcome
        assert "restarted (generation 1, now 2" in str(outcome)
    # Not a TimeoutError: each worker failed on the restart's first notice or result, without
    # waiting out the 30 s deadline (a wall-clock bound would measure the machine's load).


@pytest.mark.usefixtures("data_path")
def test_a_restart_between_calls_is_detected_on_the_next_call(tmp_path: Path) -> None:
    first = start_aggregator("python", tmp_path / "first", job=JOB, workers=2, k=K,
                             result="int", extra=["--generation", "4"])  # fmt: skip
    host, port = first.address
    x = np.ones(10 * K, dtype=np.float32)
    clients = [AllreduceClient(first.address, job=JOB, rank=r, workers=2, k=K,
                               result_format="int", deadline=30.0) for r in range(2)]  # fmt: skip
    try:
        with ThreadPoolExecutor(2) as pool:
            for out in pool.map(lambda c: c.allreduce(x, op="sum"), clients):
                np.testing.assert_array_equal(out, 2 * x)
        assert [c.generation for c in clients] == [4, 4]
        first.process.kill()
        first.process.wait()
        second = start_aggregator("python", tmp_path / "second", job=JOB, workers=2, k=K,
                                  result="int", listen=f"{host}:{port}",
                                  extra=["--generation", "9"])  # fmt: skip
        try:
            # at once, not after the 30 s deadline (that would be a TimeoutError)
            with pytest.raises(AggregatorRestartedError, match="generation 4, now 9"):
                clients[0].allreduce(x, op="sum")
            with pytest.raises(RuntimeError, match="unusable"):
                clients[0].allreduce(x, op="sum")
            stats = second.stats()["jobs"][str(JOB)]
            assert stats["drops"]["stale_generation"] >= 1
            assert stats["notices_sent"] >= 1 and stats["contributions"] == 0
        finally:
            second.stop()
    finally:
        for client in clients:
            client.close()
        first.stop()
