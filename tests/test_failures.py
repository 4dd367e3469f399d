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

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ncina.aggregator.backends.python.handshake import job_descriptor
from ncina.aggregator.backends.python.pipeline import Aggregator
from ncina.aggregator.engine import Engine
from ncina.aggregator.jobs import JobConfig
from ncina.proto.descriptor import (
    FLAG_PROBE,
    OK,
    Descriptor,
    is_job_datagram,
    pack_job_datagram,
)
from ncina.proto.header import HEADER, NOTICE, Header, flags_for, pack
from ncina.worker.client import (
    DATA_PATH_ENV,
    DATA_PATHS,
    AggregatorRestartedError,
    AllreduceClient,
)
from ncina.worker.sharding import ShardedAllreduce
from ncina.worker.torch_hook import wait_between_calls
from ncina_testlib import engine_process, start_aggregator, uplink

from ncina.harness.faults import JOB, allreduce_across_restart, allreduce_with_dead_worker
from ncina.harness.reference import powers_of_two

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
    assert destination == address(0) and len(datagram) == HEADER.size  # a restart notice
    notice = Header._make(HEADER.unpack(datagram))
    assert notice.generation == 7 and notice.is_result and notice.count == 0
    # Unstamped packets count, and stamped ones of a rank that said hello to this start.
    assert not list(agg.handle(packet(emin, 0), address(0)))
    hello(agg, 1)
    assert not list(agg.handle(packet(emin, 1, generation=7), address(1)))
    assert stats.contributions == 2


def hello(agg: Aggregator, rank: int, *, probe: bool = False) -> Header:
    """Rank ``rank``'s hello (a ``probe``: one that does not join) to ``agg``; its answer's
    header."""
    mine = job_descriptor(agg.jobs[JOB].config)
    [(answer, destination)] = agg.handle(
        pack_job_datagram(mine, job=JOB, rank=rank, probe=probe), address(rank))
    assert destination == address(rank) and Descriptor.unpack(answer[HEADER.size:])[0] == OK
    return Header._make(HEADER.unpack_from(answer))


def test_a_restart_that_drew_the_same_generation_is_stale_until_the_ranks_hello() -> None:
    # The last soak's hang: a new start of the aggregator drew the generation of the one it
    # replaced, took the workers' stamped retransmissions as its own and sent no notice.
    agg, emin = aggregator(7)
    stats = agg.jobs[JOB].stats
    [(notice, destination)] = agg.handle(packet(emin, 0, generation=7), address(0))
    assert destination == address(0) and notice == pack(
        job=JOB, rank=0, slot=1, offset=4, count=0, emin=emin, fmt=1,
        flags=flags_for(0, result=True, generation=7))  # the restart notice, byte for byte
    assert stats.drops["stale_generation"] == 1 and stats.contributions == 0
    # A probe asks without joining: its answer says "not joined" (FLAG_PROBE) every time.
    assert hello(agg, 0, probe=True).flags & FLAG_PROBE
    assert hello(agg, 0, probe=True).flags & FLAG_PROBE
    assert len(agg.handle(packet(emin, 0, generation=7), address(0))) == 1
    assert stats.drops["stale_generation"] == 2
    # A hello joins rank 0 only; the answers to a hello, and to a joined rank's probe, are plain.
    assert not hello(agg, 0).flags & FLAG_PROBE and not hello(agg, 0, probe=True).flags & FLAG_PROBE
    assert hello(agg, 2, probe=True).flags & FLAG_PROBE
    assert not list(agg.handle(packet(emin, 0, generation=7), address(0)))
    assert len(agg.handle(packet(emin, 2, generation=7), address(2))) == 1
    assert stats.contributions == 1 and stats.drops["stale_generation"] == 3
    # A rank the job does not have joins nothing (and the answer is the job's descriptor).
    hello(agg, 64)
    assert agg.jobs[JOB].joined == 0b001


def test_a_hello_that_does_not_authenticate_joins_no_rank() -> None:
    agg = Aggregator(7)
    key = bytes(range(16))
    agg.add_job(JobConfig.create(job=JOB, workers=2, k=8, result_format="int", key=key))
    mine = job_descriptor(agg.jobs[JOB].config)
    agg.handle(pack_job_datagram(mine, job=JOB, rank=0), address(0))  # untagged: status 2
    agg.handle(pack_job_datagram(mine, job=JOB, rank=1, key=bytes(16)), address(1))  # other key
    assert agg.jobs[JOB].joined == 0
    agg.handle(pack_job_datagram(mine, job=JOB, rank=1, key=key), address(1))
    assert agg.jobs[JOB].joined == 0b10


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
    run = allreduce_with_dead_worker(inputs(), tmp_path, k=K, result="int", deadline=deadline,
                                     at=CHUNKS // 4)  # fmt: skip
    assert CHUNKS // 4 <= run.killed_at < CHUNKS  # killed mid-allreduce
    *survivors, killed = run.outcomes
    assert killed is None
    for rank, outcome in enumerate(survivors):
        assert isinstance(outcome, TimeoutError), outcome
        assert f"rank {rank})" in str(outcome)
        assert "the aggregator has nothing from rank(s) [3]" in str(outcome)
        assert f"for {deadline:g} s" in str(outcome)
    # Failed after the configured deadline without progress, not earlier: each survivor's last
    # result came after run.progress_after (slot `at` was incomplete then), so no survivor may
    # return before that + deadline. (The other side, how soon after, is the machine's
    # business: a wall-clock upper bound would measure the load, not the code.)
    assert len(run.ends) == len(survivors)
    for rank, end in enumerate(run.ends):
        assert end - run.progress_after >= deadline, (rank, end - run.progress_after)


@pytest.mark.usefixtures("data_path")
def test_an_aggregator_restart_fails_every_worker_at_once_without_a_result(tmp_path: Path) -> None:
    """With ``restart_retries=0`` a restart ends the call in every worker, at once."""
    run = allreduce_across_restart(inputs(), tmp_path, k=K, result="int", deadline=30.0,
                                   at=CHUNKS // 4)  # fmt: skip
    assert CHUNKS // 4 <= run.killed_at < CHUNKS
    for outcome in run.outcomes:
        assert isinstance(outcome, AggregatorRestartedError), outcome
        assert "restarted (generation 1, now 2" in str(outcome)
        assert "restart_retries is 0" in str(outcome)
    # Not a TimeoutError: each worker failed on the restart's first notice or result, without
    # waiting out the 30 s deadline (a wall-clock bound would measure the machine's load).


@pytest.mark.usefixtures("data_path")
def test_workers_recover_from_a_restart_mid_allreduce_with_the_exact_sum(tmp_path: Path) -> None:
    """The default: every worker redoes the call on the new aggregator (nobody had completed
    it) and returns the exact sum; the second aggregator added every contribution once."""
    xs = [powers_of_two(ELEMENTS, seed=rank) for rank in range(WORKERS)]
    run = allreduce_across_restart(xs, tmp_path, k=K, result="int", deadline=30.0,
                                   at=CHUNKS // 4, restart_retries=3)  # fmt: skip
    assert CHUNKS // 4 <= run.killed_at < CHUNKS
    want = np.sum(np.stack(xs).astype(np.float64), axis=0).astype(np.float32)
    for outcome in run.outcomes:
        assert isinstance(outcome, np.ndarray), outcome
        assert outcome.tobytes() == want.tobytes()
    assert run.recovery_s is not None and run.recovery_s > 0


@pytest.mark.usefixtures("data_path")
@pytest.mark.parametrize("backend", ["python", "socket"])
def test_workers_recover_from_a_restart_that_drew_the_same_generation(
    tmp_path: Path, backend: str
) -> None:
    # Issue 37: a new start that drew the generation of the one it replaced (1 in 15) took the
    # workers' retransmissions for its own and sent no notice; every worker waited for results
    # of slots the new start had only partly, and timed out at its deadline.
    xs = [powers_of_two(ELEMENTS, seed=rank) for rank in range(WORKERS)]
    run = allreduce_across_restart(xs, tmp_path, k=K, result="int", deadline=10.0,
                                   at=CHUNKS // 4, restart_retries=3, backend=backend,
                                   generations=(3, 3))  # fmt: skip
    want = np.sum(np.stack(xs).astype(np.float64), axis=0).astype(np.float32)
    for outcome in run.outcomes:
        assert isinstance(outcome, np.ndarray), outcome
        assert outcome.tobytes() == want.tobytes()


class HeldRelay(threading.Thread):
    """Forwards one worker's datagrams to the aggregator through a socket of its own, and the
    replies back unless ``hold`` is set (then they are dropped: the worker loses its results)."""

    def __init__(self, aggregator: tuple[str, int]) -> None:
        super().__init__(daemon=True)
        self.aggregator = aggregator
        self.front = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.back = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for sock in (self.front, self.back):
            sock.bind(("127.0.0.1", 0))
            sock.settimeout(0.02)
        self.hold = threading.Event()
        self.stopping = threading.Event()
        self.worker: tuple[str, int] | None = None

    def run(self) -> None:
        while not self.stopping.is_set():
            with contextlib.suppress(TimeoutError):
                data, self.worker = self.front.recvfrom(65535)
                self.back.sendto(data, self.aggregator)
            with contextlib.suppress(TimeoutError):
                data = self.back.recv(65535)
                if not self.hold.is_set() and self.worker is not None:
                    self.front.sendto(data, self.worker)

    def stop(self) -> None:
        self.stopping.set()
        self.join()
        self.front.close()
        self.back.close()


@pytest.mark.usefixtures("data_path")
@pytest.mark.parametrize("result", ["nc8", "int"])
def test_a_rank_that_completed_the_call_serves_it_to_a_rank_that_did_not(
    tmp_path: Path, result: str
) -> None:
    """Rank 0 completes call 1, rank 1 loses every result of it (a relay holds them back), then
    the aggregator restarts. Rank 0 learns it in call 2; the recovery finds rank 0 one call
    ahead, and rank 0 serves its sum of call 1 to rank 1: both return the same bits for call 1
    (with nc8 results a redo would not: the new aggregator rounds with other random bits), and
    both go on with call 2 in step."""
    job = {"job": JOB, "workers": 2, "k": K, "result": result}
    first = start_aggregator("python", tmp_path / "first", extra=["--generation", "3"], **job)
    host, port = first.address
    relay = HeldRelay(first.address)
    relay.start()
    rng = np.random.default_rng(8)
    calls = [rng.standard_normal(20 * K).astype(np.float32) for _ in range(3)]
    clients = [
        AllreduceClient(address, job=JOB, rank=rank, workers=2, k=K, result_format=result,
                        seed=rank, deadline=30.0, restart_retries=2)
        for rank, address in enumerate([first.address, relay.front.getsockname()])
    ]  # fmt: skip
    second = None
    try:
        with ThreadPoolExecutor(2) as pool:
            warm = [pool.submit(c.allreduce, calls[0]) for c in clients]
            assert warm[0].result().tobytes() == warm[1].result().tobytes()
            relay.hold.set()
            held = [pool.submit(c.allreduce, calls[1]) for c in clients]
            ahead = held[0].result()  # rank 0 has call 1; rank 1 re-sends into the relay
            assert not held[1].done()
            first.process.kill()
            first.process.wait()
            second = start_aggregator("python", tmp_path / "second", listen=f"{host}:{port}",
                                      extra=["--generation", "5"], **job)  # fmt: skip
            relay.hold.clear()
            after = pool.submit(clients[0].allreduce, calls[2])
            assert held[1].result().tobytes() == ahead.tobytes()
            behind_after = clients[1].allreduce(calls[2])
            assert after.result().tobytes() == behind_after.tobytes()
        assert [c.stats["restarts"] for c in clients] == [1, 1]
        assert [c.generation for c in clients] == [5, 5]
    finally:
        for client in clients:
            client.close()
        relay.stop()
        first.stop()
        if second is not None:
            second.stop()


@pytest.mark.usefixtures("data_path")
def test_a_restart_between_calls_is_detected_on_the_next_call(tmp_path: Path) -> None:
    first = start_aggregator("python", tmp_path / "first", job=JOB, workers=2, k=K,
                             result="int", extra=["--generation", "4"])  # fmt: skip
    host, port = first.address
    x = np.ones(10 * K, dtype=np.float32)
    clients = [AllreduceClient(first.address, job=JOB, rank=r, workers=2, k=K,
                               result_format="int", deadline=30.0, restart_retries=retries)
               for r, retries in enumerate([0, 1])]  # fmt: skip
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
            # Rank 0 does not recover (restart_retries=0): its call fails; rank 1 recovers
            # alone, waiting for rank 0 in the recovery's agreement until its deadline.
            # at once, not after the 30 s deadline (that would be a TimeoutError)
            with pytest.raises(AggregatorRestartedError, match="generation 4, now 9"):
                clients[0].allreduce(x, op="sum")
            with pytest.raises(RuntimeError, match="unusable"):
                clients[0].allreduce(x, op="sum")
            stats = second.stats()["jobs"][str(JOB)]
            assert stats["drops"]["stale_generation"] >= 1
            assert stats["notices_sent"] >= 1 and stats["contributions"] == 0
            clients[1].deadline = 0.5  # reaches the recovery and the data path: not 30 s
            with pytest.raises(TimeoutError, match=r"for 0\.5 s .*rank 1|rank 1.*for 0\.5 s"):
                clients[1].allreduce(x, op="sum")
            assert clients[1].stats["restarts"] == 1
        finally:
            second.stop()
    finally:
        for client in clients:
            client.close()
        first.stop()


def test_restart_retries_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="restart_retries must be 0 or more"):
        AllreduceClient(("127.0.0.1", 9), job=JOB, rank=0, workers=1, restart_retries=-1,
                        handshake_timeout=None)  # fmt: skip


# --- restarts at chosen datagrams (issue 38) -----------------------------------------------------


class Restartable(threading.Thread):
    """An in-process Python aggregator of one job on loopback that a test restarts at chosen
    datagrams: ``restart_at`` holds ``(predicate, generation)`` pairs, and before handling the
    first datagram for which the first pair's predicate holds, the aggregator is replaced by a
    new one of that generation (its slots and learned members lost, as a SIGKILL and a new
    start lose them) and the pair is used up."""

    def __init__(self, config: JobConfig, generation: int, engine: Engine | None = None) -> None:
        super().__init__(daemon=True)
        self.config = config
        self.engine = engine  # the C engine (the socket backend's, offline) instead of Python
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.02)
        self.address: tuple[str, int] = self.sock.getsockname()
        self.restart_at: list[tuple[object, int]] = []
        # A predicate of ``(reply, destination)``: the replies for which it holds are not sent
        # (lost on their downlink).
        self.drop_reply: object = None
        # A function of ``(reply, destination)``: a datagram to send to ``destination`` right
        # after the reply (a forged one), or None.
        self.after_reply: object = None
        self.stopping = threading.Event()
        self.restart(generation)

    def restart(self, generation: int) -> None:
        if self.engine is not None:
            self.engine.lib.nce_reset()
            self.engine.set_generation(generation)
            self.engine.add_job(self.config)
            return
        self.aggregator = Aggregator(generation)
        self.aggregator.add_job(self.config)

    def handle(self, data: bytes, source: tuple[str, int]) -> list[tuple[bytes, tuple[str, int]]]:
        if self.engine is not None:
            return engine_process(self.engine, data, source, "127.0.0.1")
        return list(self.aggregator.handle(data, source))

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                data, source = self.sock.recvfrom(65535)
            except TimeoutError:
                continue
            if self.restart_at and self.restart_at[0][0](data):  # type: ignore[operator]
                self.restart(self.restart_at.pop(0)[1])
            for reply, destination in self.handle(data, source):
                if self.drop_reply and self.drop_reply(reply, destination):  # type: ignore[operator]
                    continue
                self.sock.sendto(reply, destination)
                extra = self.after_reply and self.after_reply(reply, destination)  # type: ignore[operator]
                if extra:
                    self.sock.sendto(extra, destination)

    def stop(self) -> None:
        self.stopping.set()
        self.join()
        self.sock.close()


def is_chunk(datagram: bytes) -> bool:
    """Whether ``datagram`` is a worker's chunk, not a hello."""
    return len(datagram) >= HEADER.size and not is_job_datagram(datagram)


@contextlib.contextmanager
def restartable(workers: int, generation: int, key: bytes | None = None,
                backend: str = "python") -> Iterator[Restartable]:  # fmt: skip
    """A ``Restartable`` of the ``backend``'s slot engine: python, or socket (its C engine)."""
    config = JobConfig.create(job=JOB, workers=workers, k=K, result_format="int", key=key)
    engine = None
    if backend == "socket":
        from ncina.aggregator.backends.socket.binding import load

        engine = Engine(load())
    server = Restartable(config, generation, engine)
    server.start()
    try:
        yield server
    finally:
        server.stop()
        if engine is not None:
            engine.lib.nce_reset()
            engine.set_generation(0)


def clients_of(server: Restartable, workers: int, **options: object) -> list[AllreduceClient]:
    return [AllreduceClient(server.address, job=JOB, rank=rank, workers=workers, k=K,
                            result_format="int", deadline=4.0, key=server.config.key,
                            **options)  # type: ignore[arg-type]
            for rank in range(workers)]  # fmt: skip


def allreduce_all(clients: list[AllreduceClient], x: np.ndarray) -> list[np.ndarray]:
    with ThreadPoolExecutor(len(clients)) as pool:
        return list(pool.map(lambda c: c.allreduce(x, op="sum"), clients))


@pytest.mark.usefixtures("data_path")
@pytest.mark.parametrize(("elements", "key"), [(1, None), (7, None), (1, bytes(range(16)))])
def test_a_call_shorter_than_a_notice_learns_of_a_restart(elements: int, key: bytes | None) -> None:
    # Issue 38, case 3: a chunk of 1-7 elements is shorter than the old 24-byte notice (32
    # with a tag), so a stale one went unanswered and the call timed out with restarts=0.
    x = np.full(elements, 2.0, dtype=np.float32)
    with restartable(2, 3, key) as server:
        clients = clients_of(server, 2)
        try:
            assert [o.tolist() for o in allreduce_all(clients, x)] == [[4.0] * elements] * 2
            server.restart_at.append((is_chunk, 5))
            assert [o.tolist() for o in allreduce_all(clients, x)] == [[4.0] * elements] * 2
            assert [c.stats["restarts"] for c in clients] == [1, 1]
            assert [c.generation for c in clients] == [5, 5]
        finally:
            for client in clients:
                client.close()


@pytest.mark.usefixtures("data_path")
@pytest.mark.parametrize("backend", ["python", "socket"])
@pytest.mark.parametrize("key", [None, bytes(range(16))], ids=["unkeyed", "keyed"])
def test_a_restart_that_drew_the_same_generation_mid_call_is_recovered(
    key: bytes | None, backend: str
) -> None:
    # Issue 37: the new start drew generation 3 again; without the ranks' hello to it, their
    # stamped chunks are stale and answered by restart notices of generation 3, which the
    # workers take for a restart because they are about their outstanding chunk.
    x = np.full(20 * K, 2.0, dtype=np.float32)
    with restartable(2, 3, key, backend) as server:
        clients = clients_of(server, 2)
        try:
            assert [o.tolist() for o in allreduce_all(clients, x)] == [(2 * x).tolist()] * 2
            server.restart_at.append((is_chunk, 3))
            assert [o.tolist() for o in allreduce_all(clients, x)] == [(2 * x).tolist()] * 2
            assert [c.stats["restarts"] for c in clients] == [1, 1]
            assert [c.generation for c in clients] == [3, 3]
            assert [o.tolist() for o in allreduce_all(clients, x)] == [(2 * x).tolist()] * 2
        finally:
            for client in clients:
                client.close()


@pytest.mark.usefixtures("data_path")
@pytest.mark.parametrize("backend", ["python", "socket"])
@pytest.mark.parametrize("drawn", [5, 3])  # 3: the restart drew the same generation
def test_a_restart_between_two_ranks_handshakes_is_recovered(drawn: int, backend: str) -> None:
    # Issue 38, case 4: rank 0 is answered by generation 3, the aggregator restarts, rank 1 is
    # answered by the new start. Rank 0's recovery agreement and rank 1's first call met in
    # slot 0 at offset 0, one was dropped as chunk_mismatch, and both ranks timed out. Every
    # client now makes the recovery's agreement once after its handshake, where they meet.
    x = np.full(3 * K, 2.0, dtype=np.float32)

    def rank_1s_hello(datagram: bytes) -> bool:
        return is_job_datagram(datagram) and Header._make(HEADER.unpack_from(datagram)).rank == 1

    with restartable(2, 3, backend=backend) as server:
        server.restart_at.append((rank_1s_hello, drawn))
        first = AllreduceClient(server.address, job=JOB, rank=0, workers=2, k=K,
                                result_format="int", deadline=4.0)  # fmt: skip
        clients = [first]
        answered = threading.Event()  # rank 0's hello answered by generation 3 (not a sleep:
        # under load rank 1's hello could come first, and no rank would see a restart)
        server.after_reply = lambda _, to: answered.set() if to[1] == first.address[1] else None
        try:
            with ThreadPoolExecutor(1) as pool:
                ahead = pool.submit(first.allreduce, x, op="sum")
                assert answered.wait(30), "rank 0's hello was never answered"
                server.after_reply = None
                clients += clients_of(server, 2)[1:]
                behind = clients[1].allreduce(x, op="sum")
                assert ahead.result().tolist() == behind.tolist() == (2 * x).tolist()
            assert not server.restart_at
            assert [c.generation for c in clients] == [drawn, drawn]
            assert [c.stats["restarts"] for c in clients] == [1, 0]
            assert [o.tolist() for o in allreduce_all(clients, x)] == [(2 * x).tolist()] * 2
        finally:
            for client in clients:
                client.close()


@pytest.mark.usefixtures("data_path")
def test_a_restart_during_the_recoverys_agreement_starts_it_again() -> None:
    # Issue 38, case 3: the agreement call (one element per rank) is short too; a second
    # restart while it runs made both ranks time out (docs/reliability.md promises a new start).
    x = np.full(20 * K, 2.0, dtype=np.float32)

    in_agreement: set[int] = set()

    def agreement(datagram: bytes) -> bool:  # both ranks sent the recovery's first call
        if is_chunk(datagram) and (datagram[1] >> 3) & 0xF == 5:
            in_agreement.add(Header._make(HEADER.unpack_from(datagram)).rank)
        return len(in_agreement) == 2

    with restartable(2, 3) as server:
        clients = clients_of(server, 2, restart_retries=2)
        try:
            assert [o.tolist() for o in allreduce_all(clients, x)] == [(2 * x).tolist()] * 2
            server.restart_at += [(is_chunk, 5), (agreement, 7)]
            assert [o.tolist() for o in allreduce_all(clients, x)] == [(2 * x).tolist()] * 2
            assert [c.stats["restarts"] for c in clients] == [2, 2]
            assert [c.generation for c in clients] == [7, 7]
        finally:
            for client in clients:
                client.close()


class GlooStandIn:
    """A gloo ``Work`` that completes with ``future``."""

    def __init__(self, future: Future[np.ndarray]) -> None:
        self.future = future

    def is_completed(self) -> bool:
        return self.future.done()

    def wait(self) -> None:
        self.future.result()


@pytest.mark.usefixtures("data_path")
@pytest.mark.parametrize("drawn", [5, 3])  # 3: the restart drew the same generation
def test_a_rank_waiting_between_calls_joins_the_recovery_of_a_rank_behind(drawn: int) -> None:
    # Issue 38, case 5 (and the hang the soak found through the DDP hook's per-call agreement):
    # rank 0 completes a call, rank 1's result of it is lost, and the aggregator restarts. Rank
    # 1 recovers inside the call and needs rank 0 in the recovery's calls, but rank 0 waits
    # elsewhere (a gloo collective) and makes no INA call: without asking the aggregator
    # whether it restarted (recover_if_restarted), both wait until rank 1's deadline.
    x = np.full(3 * K, 2.0, dtype=np.float32)
    with restartable(2, 3) as server:
        clients = clients_of(server, 2, restart_retries=2)
        try:
            assert [o.tolist() for o in allreduce_all(clients, x)] == [(2 * x).tolist()] * 2
            assert not clients[0].recover_if_restarted()  # nothing restarted: nothing to do
            ahead_done = threading.Event()  # until rank 0 has its result, rank 1 gets none
            port1 = clients[1].address[1]
            server.drop_reply = lambda reply, to: to[1] == port1 and not ahead_done.is_set()
            server.restart_at.append(
                (lambda d: ahead_done.is_set() and is_chunk(d) and Header._make(
                    HEADER.unpack_from(d)).rank == 1, drawn))  # fmt: skip
            with ThreadPoolExecutor(1) as pool:
                behind = pool.submit(clients[1].allreduce, x, op="sum")
                ahead = clients[0].allreduce(x, op="sum")
                ahead_done.set()  # rank 1's next retransmission meets a restarted aggregator
                # Rank 0 waits in a "gloo collective" that completes once rank 1 is through,
                # as the DDP hook's agreement or ncina train's last barrier waits.
                wait_between_calls(GlooStandIn(behind), (clients[0],))
                assert behind.result().tolist() == ahead.tolist() == (2 * x).tolist()
            assert not server.restart_at
            assert [c.stats["restarts"] for c in clients] == [1, 1]
            assert [c.generation for c in clients] == [drawn, drawn]
            assert [o.tolist() for o in allreduce_all(clients, x)] == [(2 * x).tolist()] * 2
        finally:
            for client in clients:
                client.close()


@pytest.mark.usefixtures("data_path")
def test_a_forged_result_right_behind_a_calls_last_result_is_counted_as_bad_tag() -> None:
    # The soak's forged results that no worker counted: the C path read a burst of datagrams
    # (recvmmsg) and, once the call's last result was in, dropped the rest of the burst
    # uncounted; a forged result right behind the last result was in that rest.
    key = bytes(range(16))
    x = np.full(4 * K, 2.0, dtype=np.float32)
    calls = 12
    with restartable(2, 3, key) as server:
        clients = clients_of(server, 2)
        port0 = clients[0].address[1]
        forged: list[bytes] = []

        def forge(reply: bytes, to: tuple[str, int]) -> bytes | None:
            # Rank 0's results (not its notices: tagged, they are longer than HEADER + 8),
            # each once: what a loaded machine's timer re-sent is answered again, with a notice
            # or the stored result, and got forgeries of its own (52 and 56 of 48, issue 37).
            if (to[1] != port0 or is_job_datagram(reply) or reply in forged
                    or Header._make(HEADER.unpack_from(reply)).count == 0):  # fmt: skip
                return None
            forged.append(reply)
            return reply[:-1] + bytes([reply[-1] ^ 1])  # its tag no longer verifies

        try:
            allreduce_all(clients, x)
            before = clients[0].stats
            server.after_reply = forge
            for _ in range(calls):
                assert [o.tolist() for o in allreduce_all(clients, x)] == [(2 * x).tolist()] * 2
            server.after_reply = None
            allreduce_all(clients, x)  # reads what the last call left in the socket
            after = clients[0].stats
            assert len(forged) == calls * 4
            assert after["bad_tag"] - before["bad_tag"] == len(forged)
        finally:
            for client in clients:
                client.close()


def test_a_forged_result_met_while_asking_for_the_generation_is_counted_as_bad_tag() -> None:
    # The soak found forged results that no counter held: a keyed client waiting for a hello's
    # answer (a handshake, a recovery, a probe between calls) counted them only as ignored.
    key = bytes(range(16))
    x = np.full(K, 2.0, dtype=np.float32)
    with restartable(2, 3, key) as server:
        clients = clients_of(server, 2)
        try:
            allreduce_all(clients, x)
            before = clients[0].stats
            forged = pack(job=JOB, rank=0, slot=0, offset=0, count=1, emin=0,
                          flags=flags_for(0, result=True, generation=3), payload=b"\x40")
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as stranger:
                stranger.sendto(forged, ("127.0.0.1", clients[0].address[1]))
            time.sleep(0.05)
            assert not clients[0].recover_if_restarted()  # same generation: nothing to do
            after = clients[0].stats
            assert after["bad_tag"] - before["bad_tag"] == 1
            assert after["results_ignored"] - before["results_ignored"] == 1
        finally:
            for client in clients:
                client.close()


# --- DDP with buffers through a restart (issue 38, case 5) --------------------------------------

BUCKET = 4 * 8 + 8 + 2 * 8 + 8 + 1  # the parameters of ddp_rank's model: one bucket, one chunk
DDP_STEPS = 4
DDP_DEADLINE = 4.0
DDP_MODES = ("ncina", "hook")  # the ncina backend; the INA hook on a gloo group


def lose_a_ranks_result_of_step_2(server: Restartable) -> None:
    """Make ``server`` drop rank 0's result of step 2's bucket, and restart (generation 5) at
    rank 0's retransmission of it once rank 1 has it."""
    buckets: list[int] = []  # the offsets of the bucket's chunks, in order
    rank_1_has_it = threading.Event()

    def target(header: Header) -> bool:  # step 2's bucket
        return header.count == BUCKET and buckets[1:2] == [header.offset]

    def restart_now(datagram: bytes) -> bool:
        if not is_chunk(datagram):
            return False
        header = Header._make(HEADER.unpack_from(datagram))
        if header.count == BUCKET and header.offset not in buckets:
            buckets.append(header.offset)
        return rank_1_has_it.is_set() and header.rank == 0 and target(header)

    def lost(reply: bytes, to: tuple[str, int]) -> bool:  # until the restart
        header = Header._make(HEADER.unpack_from(reply))
        if not server.restart_at or not header.is_result or not target(header):
            return False
        if header.rank == 1:
            rank_1_has_it.set()
        return header.rank == 0

    server.restart_at.append((restart_now, 5))
    server.drop_reply = lost


def test_ddp_broadcasting_buffers_recovers_a_restart_that_lost_a_ranks_last_result(
    tmp_path: Path,
) -> None:
    # Issue 38, case 5: rank 1 has step 2's bucket, rank 0's result of it is lost, and the
    # aggregator restarts. Rank 0 recovers inside the call and needs rank 1 in the recovery's
    # calls, but rank 1 has gone on to step 3's forward, where DDP broadcasts the BatchNorm
    # buffers from rank 0 through gloo: before, nothing asked the aggregator there, so rank 0
    # gave up at its deadline (both modes failed). On the ncina backend (the broadcast is its
    # delegated gloo one) and with the DDP hook on a gloo group (gloo's own), one after the
    # other in the same two rank processes (torch's import and start-up paid once).
    with restartable(2, 3) as first, restartable(2, 3) as second:
        servers = dict(zip(DDP_MODES, (first, second), strict=True))
        for server in servers.values():
            lose_a_ranks_result_of_step_2(server)
        spec = {"aggregators": {m: list(s.address) for m, s in servers.items()},
                "rendezvous": str(tmp_path / "rendezvous")}  # fmt: skip
        procs = [subprocess.Popen([sys.executable, __file__, json.dumps(
            {**spec, "rank": rank, "out": str(tmp_path / f"{rank}.json")})],
            env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"}) for rank in range(2)]  # fmt: skip
        try:
            assert [p.wait(timeout=60) for p in procs] == [0, 0]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        assert not first.restart_at and not second.restart_at
    ranks = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]
    for mode in DDP_MODES:
        assert [r[mode]["restarts"] for r in ranks] == [1, 1], mode
        assert ranks[0][mode]["parameters"] == ranks[1][mode]["parameters"], mode  # same bits


def ddp_rank(spec: dict[str, Any]) -> None:
    """One rank of the DDP test above, in each of ``DDP_MODES``: a model with BatchNorm
    (buffers, broadcast before every forward), ``DDP_STEPS`` steps, its gradients through the
    mode's aggregator; writes, per mode, the restarts its client counted and its parameters'
    bytes."""
    import gc
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from ncina.worker.torch_backend import NcinaOptions
    from ncina.worker.torch_hook import InaHookState, ina_hook
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    rank = spec["rank"]
    seen = {}
    for mode in DDP_MODES:
        address = tuple(spec["aggregators"][mode])
        join = {"init_method": f"file://{spec['rendezvous']}-{mode}", "rank": rank,
                "world_size": 2, "timeout": timedelta(seconds=30)}  # fmt: skip
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
        state = None
        if mode == "ncina":
            dist.init_process_group("ncina", pg_options=NcinaOptions(
                aggregators=[address], job=JOB, k=K, result_format="int", deadline=DDP_DEADLINE,
                exact_below=0), **join)  # fmt: skip
            ddp = DistributedDataParallel(model)
            fabric = dist.distributed_c10d._get_default_group().state.fabric
        else:
            dist.init_process_group("gloo", **join)
            ddp = DistributedDataParallel(model)
            fabric = ShardedAllreduce([AllreduceClient(
                address, job=JOB, rank=rank, workers=2, k=K, result_format="int",
                deadline=DDP_DEADLINE)])  # fmt: skip
            state = InaHookState(fabric)
            ddp.register_comm_hook(state, ina_hook)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        generator = torch.Generator().manual_seed(rank)
        for _ in range(DDP_STEPS):
            optimizer.zero_grad()
            ddp(torch.randn(16, 4, generator=generator)).square().mean().backward()
            optimizer.step()
        seen[mode] = {"restarts": fabric.clients[0].stats["restarts"],
                      "parameters": [p.detach().numpy().tobytes().hex()
                                     for p in model.parameters()]}  # fmt: skip
        if state is not None:
            state.close()
            fabric.close()
        del ddp
        gc.collect()  # DDP's reducer before the process group (as ncina.worker.training's
        dist.destroy_process_group()  # release_ddp, whose module's imports cost seconds)
    Path(spec["out"]).write_text(json.dumps(seen))


if __name__ == "__main__":
    ddp_rank(json.loads(sys.argv[1]))
