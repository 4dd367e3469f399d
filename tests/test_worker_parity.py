"""The worker's C data path against the Python reference: the same datagrams and the same results.

Each scenario runs one job twice against the Python aggregator backend, once with every worker on
``data_path="python"`` and once on ``"c"``, same seeds, same aggregator generation; a relay in the
test (one UDP socket pair per rank) records every uplink datagram on its way. The results must be
bit-identical, and so must the datagrams: per rank and (slot, pool version, offset, flags), every
copy a run sent has the same bytes as the other run's. Timing decides how often a chunk is re-sent
and whether a retransmission of the first window already carries the generation, so only first
copies are compared as sets; re-sent copies are compared where both runs sent them. Between calls
the test sends a marker through each client's socket, which reaches the relay after everything the
call sent (loopback keeps a socket's order), so the datagrams are compared call by call. The
aggregator's fault knobs (seeded) add loss both ways, duplication and reordering; results are then
exact integer sums (``int``), which do not depend on the order in which slots complete (NC8
re-compression draws its random stream in that order).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from ncina.proto.descriptor import is_job_datagram
from ncina.proto.header import FLAG_RETX, HEADER
from ncina.worker import cpath
from ncina.worker.client import AllreduceClient
from ncina.worker.timing import RtoEstimator
from ncina_testlib import RankRelay, start_aggregator

pytestmark = pytest.mark.timeout(300)

JOB = 3
GENERATION = 6
Address = tuple[str, int]
Key = tuple[int, int, int, int, int]  # call, slot, pool version, offset, flags
MARK = b"end of call"


class Relay(RankRelay):
    """A ``RankRelay`` that records the uplink: per rank, per call, the datagrams (a MARK from
    the rank starts the next call's list and goes no further)."""

    def __init__(self, aggregator: Address, ranks: int) -> None:
        super().__init__(aggregator, ranks)
        self.uplink_of: list[list[list[bytes]]] = [[[]] for _ in range(ranks)]

    def uplink(self, rank: int, data: bytes) -> bool:
        if data == MARK:
            self.uplink_of[rank].append([])
            return False
        self.uplink_of[rank][-1].append(data)
        return True


@contextmanager
def relayed_job(
    tmp_path: Path, workers: int, k: int, result: str, faults: list[str], key: bytes | None
) -> Iterator[Relay]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    extra = ["--generation", str(GENERATION), "--seed", "11", "--pool-size", "8", *faults]
    if key is not None:
        key_file = tmp_path / "key"
        key_file.write_text(key.hex())
        extra += ["--key-file", str(key_file)]
    agg = start_aggregator("python", tmp_path, job=JOB, workers=workers, k=k, result=result,
                           extra=extra)  # fmt: skip
    relay = Relay(agg.address, workers)
    relay.start()
    try:
        yield relay
    except BaseException:  # say what the aggregator and the relay were doing (e.g. a timeout)
        try:
            print("aggregator stats:", json.dumps(agg.stats(timeout=5.0)["jobs"]))
        except Exception as exc:  # a diagnostic only
            print(f"no aggregator stats: {exc!r}")
        print(f"relay alive: {relay.is_alive()}, error: {relay.error!r}")
        print(agg.log())
        raise
    finally:
        relay.stop()
        status = agg.stop()
    assert relay.error is None, f"the relay failed: {relay.error!r}"
    assert status == 0, agg.log()


def run_job(
    tmp_path: Path,
    data_path: str,
    tensors: list[list[np.ndarray]],
    *,
    k: int,
    result: str,
    faults: list[str] = [],  # noqa: B006 (never modified)
    key: bytes | None = None,
    compressor: str | None = None,
) -> tuple[list[list[np.ndarray]], list[list[list[bytes]]], list[dict[str, float]]]:
    """Every rank all-reduces its tensors in turn, the ranks in lockstep; returns per rank the
    results, the uplink datagrams of each call and the client's stats."""
    workers = len(tensors)
    with relayed_job(tmp_path / data_path, workers, k, result, faults, key) as relay:
        clients = [
            AllreduceClient(relay.address(rank), job=JOB, rank=rank, workers=workers, k=k,
                            pool_size=8, result_format=result, seed=100 + rank, key=key,
                            timeout=0.02, deadline=60.0, data_path=data_path,
                            compressor=compressor)
            for rank in range(workers)
        ]  # fmt: skip
        try:
            assert all(c.data_path == data_path for c in clients)

            results: list[list[np.ndarray]] = [[] for _ in range(workers)]
            with ThreadPoolExecutor(workers) as pool:
                for call in range(len(tensors[0])):
                    def work(rank: int, call: int = call) -> np.ndarray:
                        return clients[rank].allreduce(tensors[rank][call], op="sum", tensor="t")

                    for rank, out in enumerate(pool.map(work, range(workers))):
                        results[rank].append(out)
                        clients[rank]._link.sock.sendto(MARK, relay.address(rank))
            stats = [c.stats for c in clients]
        finally:
            for c in clients:
                c.close()
        while any(len(u) <= len(tensors[0]) for u in relay.uplink_of):  # the last MARKs
            time.sleep(0.01)
        return results, [[list(c) for c in u] for u in relay.uplink_of], stats


def by_key(calls: list[list[bytes]]) -> dict[Key, bytes]:
    """The datagrams by (call, slot, pool version, offset, flags); every copy under a key must
    be the same bytes. Hellos are left out: both data paths say them from the same Python code,
    each client with its own random incarnation nonce (docs/protocol.md, "A new set of
    workers")."""
    out: dict[Key, bytes] = {}
    for call, datagrams in enumerate(calls):
        for d in datagrams:
            if is_job_datagram(d):
                continue
            _, flags, *_, slot, _, offset = HEADER.unpack_from(d)
            key = (call, slot, flags >> 2 & 1, offset, flags)
            assert out.setdefault(key, d) == d, f"two different copies of {key}"
    return out


def assert_same_wire(python: list[list[list[bytes]]], c: list[list[list[bytes]]]) -> None:
    for rank, (ours, theirs) in enumerate(zip(python, c, strict=True)):
        p, q = by_key(ours), by_key(theirs)
        first_p = {key for key in p if not key[4] & FLAG_RETX}
        first_q = {key for key in q if not key[4] & FLAG_RETX}
        assert first_p == first_q, f"rank {rank}: first copies differ: {first_p ^ first_q}"
        for key in p.keys() & q.keys():
            assert p[key] == q[key], f"rank {rank}: datagram {key} differs"


def tensors(workers: int, sizes: list[int]) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(21)
    return [[rng.standard_normal(n).astype(np.float32) for n in sizes] for _ in range(workers)]


def compare(tmp_path: Path, inputs: list[list[np.ndarray]], **options: object) -> None:
    ref, ref_wire, ref_stats = run_job(tmp_path, "python", inputs, **options)  # type: ignore
    got, got_wire, got_stats = run_job(tmp_path, "c", inputs, **options)  # type: ignore
    for rank, (want, have) in enumerate(zip(ref, got, strict=True)):
        for a, b in zip(want, have, strict=True):
            assert a.dtype == b.dtype == np.float32 and a.shape == b.shape
            assert a.tobytes() == b.tobytes(), f"rank {rank}: results differ"
    assert_same_wire(ref_wire, got_wire)
    for a, b in zip(ref_stats, got_stats, strict=True):
        for name in ("allreduce_calls", "elements", "saturated"):
            assert a[name] == b[name], name


@pytest.mark.parametrize("result", ["nc8", "int"])
def test_one_worker_same_datagrams_and_results(tmp_path: Path, result: str) -> None:
    # One worker: slots complete in the order they are sent, so even NC8 results (re-compressed
    # with the aggregator's seeded stream in completion order) are the same.
    compare(tmp_path, tensors(1, [5000, 777, 64]), k=64, result=result)


@pytest.mark.parametrize("gso", ["1", "0"], ids=["gso", "no-gso"])
def test_three_workers_keyed_same_datagrams_and_results(
    tmp_path: Path, gso: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The C path sends runs of equal-length datagrams as one UDP_SEGMENT send unless told not
    # to; the kernel's segments are the same datagrams either way.
    monkeypatch.setenv(cpath.GSO_ENV, gso)
    compare(tmp_path, tensors(3, [3001, 64 * 9]), k=64, result="int", key=bytes(range(32)))


def test_ina_compressor_quantizes_first_on_both_paths(tmp_path: Path) -> None:
    compare(tmp_path, tensors(2, [2000, 2000]), k=100, result="int", compressor="ef+nc")


@pytest.mark.parametrize("key", [None, bytes(range(7, 39))], ids=["untagged", "tagged"])
def test_loss_duplication_and_reordering_same_datagrams_and_results(
    tmp_path: Path, key: bytes | None
) -> None:
    faults = ["--drop-up", "0.05", "--drop-down", "0.05", "--duplicate", "0.05",
              "--reorder", "0.05", "--fault-seed", "3"]  # fmt: skip
    compare(tmp_path, tensors(3, [4000, 1000]), k=64, result="int", faults=faults, key=key)


def test_c_timer_gives_the_python_estimators_doubles() -> None:
    """timing.c mirrors RtoEstimator operation for operation: the same samples (slow runs that
    are skipped as outliers, then taken as a slower path, a fast path), and the same in-order
    answers of re-sent chunks (ncw_rto_spurious: a queue's, a stalled window's) give the same
    verdicts and doubles."""
    module = cpath.load()
    ffi, lib = module.ffi, module.lib
    reference = RtoEstimator(0.05, cap=1.0, floor=0.002)
    timer = ffi.new("struct ncw_rto *")
    for name in cpath.TIMER_FIELDS:
        setattr(timer, name, getattr(reference, name))
    rng = np.random.default_rng(9)

    def feed(samples: np.ndarray) -> None:
        for rtt in samples.tolist():
            reference.sample(rtt)
            lib.ncw_rto_sample(timer, rtt)
            for name in cpath.TIMER_FIELDS:
                assert getattr(timer, name) == getattr(reference, name), name

    feed(np.concatenate([rng.uniform(0.001, 0.004, 50), rng.uniform(0.02, 0.05, 10),
                         rng.uniform(0.0005, 0.001, 50), [3.0] * 6]))  # fmt: skip
    assert reference.outliers > 0 and reference.rto == 1.0
    feed(rng.uniform(0.0005, 0.001, 50))  # an idle path again

    def answered(pairs: list[tuple[float, float]]) -> None:
        for rtt, since in pairs:
            taken = reference.spurious(rtt, since)
            assert lib.ncw_rto_spurious(timer, rtt, since) == taken
            for name in cpath.TIMER_FIELDS:
                assert getattr(timer, name) == getattr(reference, name), name

    # Re-sent chunks answered in order. A window stalled by loss: each answered one round trip
    # after its re-send, the timeout itself; no sample.
    state = (reference.rto, reference.samples, reference.outliers)
    answered([(0.02 + since, since) for since in rng.uniform(0.0002, 0.001, 20).tolist()])
    assert (reference.rto, reference.samples, reference.outliers) == state
    # A window queued behind a slow link: its first copies answered up to 27 ms after the
    # re-send; the RTO climbs above the 47 ms queue.
    answered([(0.02 + 0.0007 * j, 0.0007 * j) for j in range(1, 39)])
    assert reference.rto > 0.047 > state[0]
    feed(rng.uniform(0.045, 0.06, 64))
    for rto in (0.003, 0.4, 0.7, 1.0):
        assert lib.ncw_rto_backoff(timer, rto) == reference.backoff(rto)
