"""A new set of workers at once (issue 38, case 8; docs/protocol.md, "A new set of workers") on
every backend: two clients all-reduce and close, two new clients of the same job all-reduce at
once and get the exact sum. Each client's hellos carry its incarnation nonce, so the new
clients' hellos start the job afresh without waiting for ``--restart-idle`` (an hour here). A
rank's hello said again in the middle of the job (the same nonce) restarts nothing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from ncina.worker.client import AllreduceClient
from ncina_testlib import AGGREGATOR_BACKENDS, source_address, start_aggregator, twin_lacks

pytestmark = pytest.mark.timeout(180)

JOB = 4
K = 32
ELEMENTS = 3 * K + 7  # 4 chunks, the last one short


def _clients(address: tuple[str, int]) -> list[AllreduceClient]:
    return [AllreduceClient(address, job=JOB, rank=rank, workers=2, k=K, pool_size=8,
                            result_format="int", deadline=20.0, seed=rank,
                            bind=(source_address(address), 0)) for rank in range(2)]  # fmt: skip


def _allreduce_all(clients: list[AllreduceClient], xs: list[np.ndarray]) -> list[np.ndarray]:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(clients)) as pool:
        return list(pool.map(lambda c, x: c.allreduce(x, "sum"), clients, xs))


@pytest.mark.parametrize("backend", AGGREGATOR_BACKENDS)
def test_two_sets_of_workers_one_after_the_other_get_exact_sums(
    backend: str, tmp_path: Path
) -> None:
    twin_lacks(backend, "restart")
    agg = start_aggregator(backend, tmp_path / "agg", job=JOB, workers=2, k=K, result="int",
                           extra=["--pool-size", "8", "--generation", "5",
                                  "--restart-idle", "3600"])  # fmt: skip
    xs = [np.ldexp(1.0, (np.arange(ELEMENTS) + 3 * rank) % 20 - 10).astype(np.float32)
          for rank in range(2)]  # fmt: skip
    want = (xs[0].astype(np.float64) + xs[1]).astype(np.float32)
    try:
        for _ in range(2):  # the first set, then a new one at once
            clients = _clients(agg.address)
            try:
                outs = _allreduce_all(clients, xs)
                clients[1]._hello.send()  # said again mid-job (the same nonce): restarts nothing
                outs += _allreduce_all(clients, xs)
            finally:
                for client in clients:
                    client.close()
            for out in outs:
                assert out.tobytes() == want.tobytes()
        stats = agg.stats()["jobs"][str(JOB)]
    finally:
        agg.stop()
    assert stats["slots_completed"] == 2 * (1 + 2 * 4)  # per set: the agreement, 2 calls of 4
    assert stats["drops"]["late"] == stats["drops"]["chunk_mismatch"] == 0

