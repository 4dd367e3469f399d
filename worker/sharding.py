"""One tensor all-reduced through several aggregators at once (the ``multi`` topology).

An :class:`~ncina.worker.client.AllreduceClient` talks to one aggregator. With ``M`` aggregators a
worker holds ``M`` clients (one job per aggregator, same ranks) and splits every tensor into ``M``
contiguous element ranges cut on chunk boundaries (:func:`shard_bounds`): aggregator ``j`` gets
chunks ``[C*j/M, C*(j+1)/M)`` of the tensor's ``C`` chunks, and spreads them over its own slot pool.
The slots of the fabric are thus sharded across the aggregators, each serving an equal share of the
chunks (within one), as the Natural Compression prototype's eight aggregators did. The ``M`` ranges
are reduced concurrently, one thread per client (the clients block in ``poll``, which releases the
GIL). Every worker cuts the same tensor the same way, so all clients of a job stay in step.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from ncina.worker.client import AllreduceClient


def shard_bounds(n: int, k: int, shards: int) -> list[tuple[int, int]]:
    """``shards`` contiguous ``[start, stop)`` ranges of ``n`` elements cut at multiples of ``k``.

    Shard ``j`` holds chunks ``C*j//shards .. C*(j+1)//shards - 1`` of the ``C = ceil(n/k)``
    chunks; shards may be empty when there are fewer chunks than shards.
    """
    if k < 1 or shards < 1:
        raise ValueError(f"need k >= 1 and shards >= 1, got k={k}, shards={shards}")
    chunks = -(-n // k)
    cuts = [min(n, chunks * j // shards * k) for j in range(shards + 1)]
    return list(itertools.pairwise(cuts))


class ShardedAllreduce:
    """Mean (or sum) all-reduce of float32 vectors across ``len(clients)`` aggregators (module
    doc).

    The clients must share ``k``; the object owns them and closes them in :meth:`close`.
    """

    def __init__(self, clients: Sequence[AllreduceClient]) -> None:
        if not clients:
            raise ValueError("need at least one client")
        if len({c.k for c in clients}) != 1:
            raise ValueError("all clients of a sharded all-reduce need the same k")
        self.clients = list(clients)
        self.k = self.clients[0].k
        self._pool = ThreadPoolExecutor(len(self.clients), thread_name_prefix="ncina-shard")

    def allreduce(
        self,
        x: np.ndarray,
        tensor: Hashable = None,
        *,
        out: np.ndarray | None = None,
        op: str = "mean",
    ) -> np.ndarray:
        """The mean (``op="sum"``: the sum) over the job's workers of the 1-D float32 array
        ``x``; ``tensor`` names it for the clients' compressor state
        (``AllreduceClient.allreduce``).

        The mean goes into ``out`` when given (float32 of ``x``'s shape, C-contiguous; may be
        ``x`` itself), each aggregator's range straight into its slice of it, else into a new
        array; the array is returned. ``x`` may have any shape (0-dim included): the ranges
        are of its elements in C order.
        """
        if len(self.clients) == 1:
            return self.clients[0].allreduce(x, op, tensor, out=out)
        if out is None:
            out = np.empty(x.shape, dtype=np.float32)
        elif out.shape != x.shape:
            raise ValueError(f"out has shape {out.shape}, the tensor {x.shape}")
        # The ranges are of elements: cut the flat views (a shaped tensor's axis 0 is not its
        # elements, and a 0-dim one has no axis to slice).
        flat, flat_out = np.reshape(x, -1), _flat_view(out)
        bounds = shard_bounds(flat.size, self.k, len(self.clients))
        futures = [
            self._pool.submit(client.allreduce, flat[start:stop], op, tensor,
                              out=flat_out[start:stop])
            for client, (start, stop) in zip(self.clients, bounds, strict=True)
            if stop > start
        ]
        for future in futures:
            future.result()
        return out

    @property
    def stats(self) -> dict[str, float]:
        """The clients' counters, summed; ``rto_s``, a current timeout rather than a count, is
        the largest client's."""
        total: dict[str, float] = {}
        for client in self.clients:
            for key, value in client.stats.items():
                if key == "rto_s":
                    total[key] = max(total.get(key, 0.0), value)
                else:
                    total[key] = total.get(key, 0) + value
        return total

    def close(self) -> None:
        """Stop the threads and close every client."""
        self._pool.shutdown()
        for client in self.clients:
            client.close()


def _flat_view(out: np.ndarray) -> np.ndarray:
    """``out`` as a 1-D view of its elements; ``ValueError`` when it has no such view (not
    C-contiguous), since results written into a copy would be lost."""
    if not out.flags.c_contiguous:
        raise ValueError("out must be a C-contiguous array")
    return out.reshape(-1)
