"""NC8 results do not depend on arrival order (docs/protocol.md, "Re-compression"), on every
backend in ``AGGREGATOR_BACKENDS``.

The same contributions reach two fresh aggregators under one ``--seed``: to the first slot by
slot, each slot's ranks in order; to the second all at once, the ranks of every slot permuted and
the slots interleaved so that they complete in another order. Every rank must receive the same
result bytes for every (slot, version) from both, and those bytes must be the re-compression keyed
by ``nc8.result_key(seed, job, slot, version, offset, use)``, so the backends agree with each other
too. Before results were keyed by the chunk (seed, job, slot, version, offset and the slot
version's use) each completion drew the next key of one stream, and the two orders gave different
bytes.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from ncina.proto import nc8
from ncina.proto.header import FLAG_POOL
from ncina_testlib import (
    AGGREGATOR_BACKENDS,
    Worker,
    dissect,
    exact_sums,
    start_aggregator,
    twin_lacks,
    uplink,
    window_e_min,
)

JOB, WORKERS, K, POOL, SEED = 12, 3, 16, 6, 0xC0FFEE

Contribution = tuple[int, int, int, int, list[int]]
"""(rank, slot, version, offset, codes)."""


def contributions() -> list[list[Contribution]]:
    """Two rounds over the pool (version 0, then version 1 at other offsets): random codes of
    both signs whose sums are mostly not powers of two, so the rounding has choices to make."""
    rnd = random.Random(5)
    rounds = []
    for version in (0, 1):
        packets = []
        for slot in range(POOL):
            offset = (version * POOL + slot) * K
            for rank in range(WORKERS):
                codes = [rnd.choice((0, 0x80)) | rnd.randint(1, 40) for _ in range(K)]
                packets.append((rank, slot, version, offset, codes))
        rounds.append(packets)
    return rounds


def scrambled(packets: list[Contribution], seed: int) -> list[Contribution]:
    """The same packets with each slot's ranks permuted and the slots interleaved, their last
    contributions (the completions) in reverse slot order."""
    rnd = random.Random(seed)
    by_slot = [[p for p in packets if p[1] == slot] for slot in range(POOL)]
    for mine in by_slot:
        rnd.shuffle(mine)
    early = [p for mine in by_slot for p in mine[:-1]]
    rnd.shuffle(early)
    return early + [mine[-1] for mine in reversed(by_slot)]


def completion_order(packets: list[Contribution]) -> list[int]:
    """The slots in the order their last contribution arrives."""
    return sorted(range(POOL), key=lambda s: max(i for i, p in enumerate(packets) if p[1] == s))


def run(backend: str, workdir: Path, rounds: list[list[Contribution]]) -> dict[tuple, bytes]:
    """Send the rounds (each one's results awaited before the next) to a fresh aggregator;
    return {(rank, slot, version, offset): result payload}."""
    agg = start_aggregator(backend, workdir, job=JOB, workers=WORKERS, k=K, result="nc8",
                           extra=["--seed", str(SEED), "--pool-size", str(POOL)])  # fmt: skip
    workers = [Worker(agg.address) for _ in range(WORKERS)]
    emin = window_e_min(WORKERS)
    got: dict[tuple, bytes] = {}
    try:
        for packets in rounds:
            for rank, slot, version, offset, codes in packets:
                workers[rank].send(uplink(job=JOB, rank=rank, slot=slot, offset=offset,
                                          codes=codes, emin=emin, pool=version))  # fmt: skip
            for rank, worker in enumerate(workers):
                for _ in range(POOL):
                    fields, payload = dissect(worker.receive())
                    version = int(bool(fields["flags"] & FLAG_POOL))
                    key = (rank, fields["slot"], version, fields["offset"])
                    assert key not in got, f"two results for {key}"
                    got[key] = payload
    finally:
        for worker in workers:
            worker.close()
        assert agg.stop() == 0, agg.log()
    return got


@pytest.mark.parametrize("backend", AGGREGATOR_BACKENDS)
def test_results_do_not_depend_on_arrival_order(backend: str, tmp_path: Path) -> None:
    twin_lacks(backend, "k")  # 16 lanes
    rounds = contributions()
    in_order = run(backend, tmp_path / "in-order", rounds)
    shuffled = run(backend, tmp_path / "shuffled",
                   [scrambled(packets, seed) for seed, packets in enumerate(rounds)])  # fmt: skip
    assert len(in_order) == WORKERS * POOL * 2
    differ = sorted(k for k in in_order if in_order[k] != shuffled.get(k))
    assert not differ, f"{len(differ)} of {len(in_order)} results differ, first {differ[0]}"
    # The documented bytes: every backend gives these, whatever the order.
    for packets in rounds:
        for slot in range(POOL):
            mine = [p for p in packets if p[1] == slot]
            _, _, version, offset, _ = mine[0]
            sums = np.array(exact_sums(p[4] for p in mine), np.int64)
            key = nc8.result_key(SEED, JOB, slot, version, offset, 0)  # first use
            want = nc8.recompress(sums, key).tobytes()
            for rank in range(WORKERS):
                assert in_order[(rank, slot, version, offset)] == want, (slot, version)


def test_the_scrambled_order_completes_slots_in_another_order() -> None:
    """The test above really changes the completion order and the ranks' order in a slot."""
    for seed, packets in enumerate(contributions()):
        mixed = scrambled(packets, seed)
        assert sorted(map(repr, mixed)) == sorted(map(repr, packets))
        assert completion_order(packets) == list(range(POOL))
        assert completion_order(mixed) == list(reversed(range(POOL)))
        ranks = [[p[0] for p in ps if p[1] == slot] for ps in (packets, mixed) for slot in
                 range(POOL)]  # fmt: skip
        assert ranks[:POOL] != ranks[POOL:]
