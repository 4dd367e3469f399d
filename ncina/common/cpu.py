"""CPU-seconds of a benchmark's sides, each CPU-second counted once.

A process's user and system time come from ``/proc/PID/stat``. Packet work the kernel does in
softirq context (loopback and veth delivery, the bridge, HTB, the protocol stacks) lands in one
of three places: in the context of the process that happened to run (its system time: a
sender's own packets, mostly), in ``ksoftirqd``, or on an idle CPU. This kernel has no
``CONFIG_IRQ_TIME_ACCOUNTING``, so the first is in that process's time *and* in
``/proc/stat``'s softirq: adding the two counts it twice (issue 40: ``cpu_s`` 2.05 where the
machine was busy 1.56 CPU-seconds).

The rule: a side's CPU is its processes' own time plus the CPU time **no process was
charged** over the side's window (:func:`unattributed_s`): the machine's busy time
(``/proc/stat``: every tick is in exactly one of user, nice, system, irq, softirq, steal, idle,
iowait) less what every process on the machine was charged meanwhile (a process that exited
by its reaper's children's time), ``ksoftirqd`` counted as no process (its time is the
deferred packet work): softirq on an idle CPU and in ``ksoftirqd``. It is machine-wide: other
processes' traffic in the same instants adds to it, so on a busy machine it is an upper bound,
reported beside the processes' own time; but the sum never exceeds the machine's busy time
over the window, to within ticks. The window runs from the first rank's start to the last
rank's end, each rank taking a :func:`snapshot` around its call. A process's time includes its
descendants' (:func:`process_cpu_s`: BMv2's switch is its aggregator's child). Counters
tick in 1/``SC_CLK_TCK`` s (10 ms).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

TICK = os.sysconf("SC_CLK_TCK")
IDLE_FIELDS = (4, 5)
"""``/proc/stat``'s ``cpu`` line: idle and iowait (after the label), the rest is busy."""


def _stats() -> dict[int, tuple[str, list[str]]]:
    """Every process's name and ``/proc/PID/stat`` fields after the name (state first)."""
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            text = Path(entry.path, "stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited meanwhile
        name, rest = text.rsplit(")", 1)
        out[int(entry.name)] = (name.split("(", 1)[1], rest.split())
    return out


def _spent_s(fields: list[str]) -> float:
    """A process's user and system time and its reaped children's (``/proc/PID/stat``)."""
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / TICK


def process_cpu_s(pid: int) -> float:
    """CPU time of process ``pid`` so far, in seconds, with its descendants': user plus system
    time of it and of every live descendant, and of the children they reaped (0 once it is
    gone). An aggregator's own children count: BMv2's ``simple_switch_grpc`` is the
    aggregator process's child (issue 40)."""
    stats = _stats()
    if pid not in stats:
        return 0.0
    children: dict[int, list[int]] = {}
    for child, (_, fields) in stats.items():
        children.setdefault(int(fields[1]), []).append(child)
    total, todo = 0.0, [pid]
    while todo:
        one = todo.pop()
        total += _spent_s(stats[one][1])
        todo += children.get(one, [])
    return total


def busy_s() -> float:
    """The machine's busy time so far, all CPUs, in seconds: every ``/proc/stat`` ``cpu``
    field but idle and iowait (guest time is already in user and nice, so left out)."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:]]
    return sum(v for i, v in enumerate(fields[:8]) if i + 1 not in IDLE_FIELDS) / TICK


def tasks_cpu_s() -> dict[str, float]:
    """Every process's user plus system time so far (its threads' included) and its reaped
    children's, keyed by ``PID/start time`` so that a reused PID is another process;
    ``ksoftirqd`` threads left out (their time is packet work no process asked for)."""
    return {f"{pid}/{fields[19]}": _spent_s(fields) for pid, (name, fields) in _stats().items()
            if not name.startswith("ksoftirqd/")}  # fmt: skip


def snapshot() -> dict[str, Any]:
    """The machine's CPU counters now (JSON-able): ``t`` (``CLOCK_MONOTONIC``), ``busy``
    (:func:`busy_s`) and ``tasks`` (:func:`tasks_cpu_s`)."""
    return {"t": time.monotonic(), "busy": busy_s(), "tasks": tasks_cpu_s()}


def unattributed_s(before: dict[str, Any], after: dict[str, Any]) -> float:
    """CPU-seconds between two :func:`snapshot` s that no process was charged: the machine's
    busy time less every process's (one alive at both counts its difference, one started in
    between all of its time, one gone by the second less its time at the first: its whole time
    is then in its reaper's children's time). Never below 0 (the counters tick apart)."""
    charged = sum(spent - before["tasks"].get(key, 0.0) for key, spent in after["tasks"].items())
    charged -= sum(spent for key, spent in before["tasks"].items() if key not in after["tasks"])
    return max(0.0, after["busy"] - before["busy"] - charged)


def window_unattributed_s(reports: Iterable[dict[str, Any]]) -> float:
    """:func:`unattributed_s` from the earliest to the latest of the ranks' snapshots around
    their timed calls (``machine_at`` of ``ncina.harness.workers.timed``)."""
    pairs = [r["machine_at"] for r in reports]
    first = min((before for before, _ in pairs), key=lambda snap: snap["t"])
    last = max((after for _, after in pairs), key=lambda snap: snap["t"])
    return unattributed_s(first, last)


@dataclass
class Usage:
    """CPU-seconds the watched processes spent over one measured call."""

    processes_s: float


def measure(call: Callable[[], T], pids: Iterable[int] = ()) -> tuple[T, Usage]:
    """Run ``call``; its result and the CPU time of ``pids`` meanwhile (the processes must
    still run when ``call`` returns)."""
    pids = list(pids)
    before = [process_cpu_s(p) for p in pids]
    result = call()
    spent = sum(process_cpu_s(p) - b for p, b in zip(pids, before, strict=True))
    return result, Usage(spent)
