"""An aggregator as a child process: its readiness line, stats on request, stop by PID.

Every backend announces readiness with one line on its log (stderr) once its socket or port is
serving; benchmarks, the topology runner and the tests start ``ncina aggregator`` and wait for that
line, ask for counters with SIGUSR1, and stop it with SIGTERM. This module is the one place that
knows those conventions.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ncina.common.address import Address

READY = re.compile(r"listening on (\S+):(\d+) ")
"""The readiness line names the address the aggregator serves (see :func:`ready_line`)."""

BUILDING = "building: "
"""The start of a line printed before a compile that can take minutes (a P4 program, or the
wait for another process compiling it); the next line ends it. ``wait_ready``'s clock stands
still while it is the log's last line: its timeout is for a start, not for a compile (the
twin's K = 12 took 127 s of wall time under two CPU hogs)."""


def free_udp_port(host: str = "127.0.0.1") -> int:
    """A UDP port that was free a moment ago, for a member address to configure before its
    socket exists (prefer ``--listen HOST:0`` where the port can be learned afterwards)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ready_line(address: Address, backend: str, details: str) -> str:
    """The line a backend prints once it serves ``address``; :data:`READY` finds it."""
    host, port = address
    return f"ncina aggregator: listening on {host}:{port} (udp), backend {backend}, {details}"


def tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a log file, for error messages ('' if there is none)."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def start(
    arguments: Sequence[str], log_path: Path, timeout: float = 60.0
) -> tuple[subprocess.Popen[bytes], Address]:
    """Run ``ncina aggregator ARGUMENTS`` with this interpreter, its output in ``log_path``;
    return the process and the address it serves once it is ready (stopped again if it is not)."""
    command = [sys.executable, "-m", "ncina.cli", "aggregator", *arguments]
    with log_path.open("wb") as log:  # a file, not a pipe: a full pipe would stall the process
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        return proc, wait_ready(proc, log_path, timeout)
    except RuntimeError:
        stop(proc)
        raise


def wait_ready(proc: subprocess.Popen[bytes], log_path: Path, timeout: float = 60.0) -> Address:
    """Wait for the readiness line in ``log_path`` and return the address it names.

    Raises ``RuntimeError`` with the end of the log if the process exits first or stays silent
    for ``timeout`` seconds (generous by default: a first start may compile a C extension),
    not counting a compile it announces (``BUILDING``).
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            text = log_path.read_text(errors="replace")
        except FileNotFoundError:
            text = ""
        found = READY.search(text)
        if found:
            return found.group(1), int(found.group(2))
        if text.rstrip("\n").rpartition("\n")[2].startswith(BUILDING):
            deadline = time.monotonic() + timeout
        if proc.poll() is not None:
            raise RuntimeError(
                f"aggregator exited with status {proc.returncode} before it was ready "
                f"(log {log_path}):\n{tail(log_path)}"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"aggregator not ready within {timeout:g} s (log {log_path}):\n{tail(log_path)}"
            )
        time.sleep(0.02)


def request_stats(
    proc: subprocess.Popen[bytes], stats_path: Path, timeout: float = 10.0
) -> dict[str, Any]:
    """Ask for the counters now (SIGUSR1) and return the first document written after asking."""
    asked = time.time()
    proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            document = json.loads(stats_path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            document = None
        if document is not None and document["time"] >= asked:
            return document
        if proc.poll() is not None:
            raise RuntimeError(f"aggregator exited with status {proc.returncode}")
        time.sleep(0.002)  # answered within microseconds when idle (the backends' SIGUSR1 handlers)
    raise RuntimeError(f"no stats written to {stats_path} within {timeout:g} s of SIGUSR1")


STACKS_WAIT = 1.0
"""Seconds ``stop`` gives an aggregator that outlived its grace to print its stacks."""


def stop(proc: subprocess.Popen[bytes], grace: float = 10.0) -> int:
    """SIGTERM by PID (the aggregator writes its final stats), SIGKILL after ``grace`` seconds;
    return the exit status. Before the SIGKILL, SIGUSR2 has the aggregator print every thread's
    Python stack on its log: a stop that did not end says where it was stuck."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR2)
            time.sleep(STACKS_WAIT)
            proc.kill()
            proc.wait()
    return proc.returncode
