"""CPU-seconds of a benchmark's sides: the processes it started, and the kernel's softirq time.

A process's user and system time come from ``/proc/PID/stat``. Packet work the kernel does in
softirq context (loopback and veth delivery, the protocol stacks) is charged to no process, so a
side's kernel share is the machine's softirq time over the side's run (``/proc/stat``). That
share is machine-wide: other processes' network traffic in the same seconds adds to it, so it is
an upper bound on a noisy machine, reported beside the processes' own time.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

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


@dataclass
class Usage:
    """CPU-seconds spent over one measured call: by the watched processes and in softirq."""

    processes_s: float
    softirq_s: float


def measure(call: Callable[[], T], pids: Iterable[int] = ()) -> tuple[T, Usage]:
    """Run ``call``; its result and the CPU time of ``pids`` and of softirq meanwhile (the
    processes must still run when ``call`` returns)."""
    pids = list(pids)
    before = [process_cpu_s(p) for p in pids]
    kernel = softirq_s()
    result = call()
    kernel = softirq_s() - kernel
    spent = sum(process_cpu_s(p) - b for p, b in zip(pids, before, strict=True))
    return result, Usage(spent, kernel)
