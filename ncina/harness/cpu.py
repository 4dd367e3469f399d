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
iowait) less what every process on the machine was charged meanwhile, ``ksoftirqd`` counted
as no process (its time is the deferred packet work). That is softirq on an idle CPU and in
``ksoftirqd``, and time of processes that exited inside the window (their share is lost with
them: a small upward error). It is machine-wide: other processes' traffic in the same instants
adds to it, so on a busy machine it is an upper bound, reported beside the processes' own time;
but the sum never exceeds the machine's busy time over the window, to within ticks. The window
runs from the first rank's start to the last rank's end, each rank taking a
:func:`snapshot` around its call. Counters tick in 1/``SC_CLK_TCK`` s (10 ms).
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


def process_cpu_s(pid: int) -> float:
    """User plus system CPU time of process ``pid`` so far, in seconds (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def busy_s() -> float:
    """The machine's busy time so far, all CPUs, in seconds: every ``/proc/stat`` ``cpu``
    field but idle and iowait (guest time is already in user and nice, so left out)."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:]]
    return sum(v for i, v in enumerate(fields[:8]) if i + 1 not in IDLE_FIELDS) / TICK


def tasks_cpu_s() -> dict[str, float]:
    """Every process's user plus system time so far (its threads' included), keyed by
    ``PID/start time`` so that a reused PID is another process; ``ksoftirqd`` threads left
    out (their time is packet work no process asked for)."""
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            text = Path(entry.path, "stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited meanwhile
        name, rest = text.rsplit(")", 1)
        if name.split("(", 1)[1].startswith("ksoftirqd/"):
            continue
        fields = rest.split()
        out[f"{entry.name}/{fields[19]}"] = (int(fields[11]) + int(fields[12])) / TICK
    return out


def snapshot() -> dict[str, Any]:
    """The machine's CPU counters now (JSON-able): ``t`` (``CLOCK_MONOTONIC``), ``busy``
    (:func:`busy_s`) and ``tasks`` (:func:`tasks_cpu_s`)."""
    return {"t": time.monotonic(), "busy": busy_s(), "tasks": tasks_cpu_s()}


def unattributed_s(before: dict[str, Any], after: dict[str, Any]) -> float:
    """CPU-seconds between two :func:`snapshot` s that no process was charged: the machine's
    busy time less every process's (one alive at both counts its difference, one started in
    between all of its time). Never below 0 (the counters tick apart)."""
    charged = sum(spent - before["tasks"].get(key, 0.0) for key, spent in after["tasks"].items())
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
