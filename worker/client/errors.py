"""The errors a transfer's outcome becomes: a restart of the aggregator the client does not
recover from (``AggregatorRestartedError``), a call without progress (``TimeoutError`` naming
the ranks the aggregator waits for), and ``Restart``, the signal between the data paths and the
restart recovery (``ncina.worker.client.recovery``)."""

from __future__ import annotations

import functools
import operator


class AggregatorRestartedError(RuntimeError):
    """The aggregator restarted (a result or notice of another generation): the slot state of
    the all-reduce in progress is lost, so it cannot complete; nothing partial is returned."""


class Restart(Exception):
    """A transfer met another generation (the aggregator restarted): recovered from, or
    turned into ``AggregatorRestartedError``."""

    def __init__(self, generation: int) -> None:
        super().__init__(f"generation {generation}")
        self.generation = generation


def restarted(
    aggregator: tuple[str, int], *, job: int, rank: int, known: int, generation: int,
    recovers: bool, retries: int, recovered: int,
) -> AggregatorRestartedError:  # fmt: skip
    """The error of a call that saw ``generation``, not the client's (``known``), after
    ``recovered`` recoveries in the call: the aggregator restarted once more than the client
    recovers from (``recovers``: whether it does at all; ``retries``: ``restart_retries``)."""
    host, port = aggregator
    if not recovers:
        why = ("server mode and hierarchical jobs do not recover" if retries
               else "restart_retries is 0")  # fmt: skip
    else:
        why = f"after {recovered} recoveries in this call (restart_retries)"
    drawn = ("the same again" if generation == known  # it said a restart notice
             else f"now {generation}")  # fmt: skip
    return AggregatorRestartedError(
        f"allreduce: aggregator {host}:{port} restarted (generation "
        f"{known}, {drawn}; job {job}, rank {rank}): "
        f"the slots of this call are lost, nothing is returned ({why}); every rank must "
        f"start a new client"
    )


def timed_out(
    aggregator: tuple[str, int], *, job: int, rank: int, workers: int, deadline: float,
    outstanding: list[int], waiting: list[tuple[int, int | None]],
) -> TimeoutError:  # fmt: skip
    """The error of a call without progress for ``deadline`` seconds. ``outstanding`` are the
    slots still waiting, ``waiting`` per slot its chunk's element count and the bitmap of the
    ranks the aggregator holds for that chunk according to its latest notice (None: no notice
    about that chunk); the message names the ranks every such notice says is missing, else
    those any says. Every live rank sends the lowest chunk no slot completed whatever its
    congestion window (``ncina.worker.transfer.Transfer``), but a later one only when its window
    has room: a rank missing from some chunks may just be behind, one missing from all is not."""
    host, port = aggregator
    everyone = (1 << workers) - 1
    gaps = [everyone & ~held for _, held in waiting if held is not None]
    missing = 0
    if gaps:
        missing = functools.reduce(operator.and_, gaps) or functools.reduce(operator.or_, gaps)
    if missing:
        ranks = [r for r in range(workers) if missing >> r & 1]
        why = f"the aggregator has nothing from rank(s) {_ranges(ranks)} for them"
    else:
        why = "no notice from the aggregator names a missing rank"
    elements = sum(count for count, _ in waiting)
    return TimeoutError(
        f"allreduce: no result from aggregator {host}:{port} for {deadline:g} s "
        f"(job {job}, rank {rank}): {len(outstanding)} slots outstanding "
        f"{_ranges(outstanding)} holding {elements} elements; {why}"
    )


def _ranges(values: list[int]) -> str:
    """``[0-3, 7, 9-10]`` for sorted integers, so an error message stays short."""
    runs: list[list[int]] = []
    for v in values:
        if runs and runs[-1][1] == v - 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return "[" + ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs) + "]"
