"""CPU-seconds of a benchmark's sides: the processes it started, and the kernel's softirq time.

A process's user and system time come from ``/proc/PID/stat``. Packet work the kernel does in
softirq context (loopback and veth delivery, the protocol stacks) is charged to no process, so a
side's kernel share is the machine's softirq time (``/proc/stat``) over the side's timed call:
from the first rank's start to the last rank's end, each rank reading the counter around its
call (:func:`window_softirq_s`). That share is machine-wide: other processes' network traffic
in the same instants adds to it, so it is an upper bound on a noisy machine, reported beside
the processes' own time. (Over a whole run, start-up included, a neighbour's traffic made it
seconds for a call of 0.1 s.) The counter ticks in 1/``SC_CLK_TCK`` s (10 ms).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

TICK = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """User plus system CPU time of process ``pid`` so far, in seconds (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def softirq_s() -> float:
    """Softirq time of all CPUs so far, in seconds (``/proc/stat``'s seventh ``cpu`` field)."""
    with open("/proc/stat") as stat:
        fields = stat.readline().split()
    return int(fields[7]) / TICK


def window_softirq_s(reports: Iterable[dict[str, Any]]) -> float:
    """The machine's softirq time from the earliest to the latest of the ranks' readings
    around their timed calls (``softirq_at`` of ``ncina.harness.workers.timed``)."""
    readings = [r["softirq_at"] for r in reports]
    return max(after for _, after in readings) - min(before for before, _ in readings)


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
