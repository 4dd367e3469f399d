"""An aggregator for one job as the tests and benchmarks start it: ``ncina aggregator`` with the
job's options, its stats in ``WORKDIR/stats.json`` and its output in ``WORKDIR/aggregator.log``,
held as a ``RunningAggregator`` (stats on request, stop by PID).

The process conventions (readiness line, SIGUSR1 for stats, SIGTERM) are
``ncina.aggregator.process``'s. The backends that serve a kernel UDP socket
(``LOCAL_BACKENDS``) run in this namespace (``local_command``); the others need a place where
they serve, which a caller gives as its own ``Command`` (tests/ncina_testlib.py: a network
namespace on the tests' bridge).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ncina.aggregator import process as aggproc
from ncina.aggregator.backends import names
from ncina.proto.job import JobSpec, job_args

Address = tuple[str, int]
Command = Callable[[str, Sequence[str]], list[str]]
"""The command line of ``ncina aggregator --backend BACKEND ARGUMENTS``, wherever it runs."""

LOCAL_BACKENDS = names(kernel_sockets=True)
"""Backends that serve a kernel UDP socket: reached on 127.0.0.1, no namespace."""

START_TIMEOUT = 60.0  # generous: the first start may compile the NC8 C extension


@dataclass
class RunningAggregator:
    """An ``ncina aggregator`` child process and where it listens, logs and writes stats."""

    process: subprocess.Popen[bytes]
    address: Address
    stats_path: Path
    log_path: Path

    def log(self) -> str:
        """Everything the process wrote on stderr and stdout so far."""
        return self.log_path.read_text(errors="replace")

    def stats(self, timeout: float = 10.0) -> dict[str, Any]:
        """Ask for the stats now (SIGUSR1) and return the first document written after asking."""
        return aggproc.request_stats(self.process, self.stats_path, timeout)

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, wait, and return the exit status (SIGKILL if it does not exit in time)."""
        return aggproc.stop(self.process, timeout)


def local_command(backend: str, arguments: Sequence[str]) -> list[str]:
    """``ncina aggregator --backend BACKEND ARGUMENTS`` in this namespace, with this
    interpreter (``ValueError`` for a backend of no kernel socket)."""
    if backend not in LOCAL_BACKENDS:
        raise ValueError(
            f"the {backend} backend does not serve a kernel socket here: give a Command that "
            "runs it where it serves"
        )
    return [sys.executable, "-m", "ncina.cli", "aggregator", "--backend", backend, *arguments]


def launch_aggregator(
    backend: str,
    workdir: Path,
    *,
    job: int | None = None,
    workers: int | None = None,
    k: int | None = None,
    result: str | None = None,
    spec: JobSpec | None = None,
    extra: Sequence[str] = (),
    listen: str = "127.0.0.1:0",
    command: Command = local_command,
) -> RunningAggregator:
    """Start an aggregator for one job without waiting for it (see ``wait_ready``): the job
    ``spec``, every field of it (``JobSpec.to_args``; a key goes in ``extra`` as
    ``--key-file``), or the loose fields ``job``,
    ``workers``, ``k`` and ``result`` (``k=None`` leaves K to the aggregator, the largest that
    fits its MTU; ``result=None`` the result format: server mode's); ``extra`` are further
    options.

    Stats go to ``workdir/stats.json``, stderr and stdout to ``workdir/aggregator.log``.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    stats_path = workdir / "stats.json"
    log_path = workdir / "aggregator.log"
    if spec is not None and (job, workers, k, result) != (None,) * 4:
        raise ValueError("give the job as spec or as its loose fields, not both")
    fields = (spec.to_args(role="aggregator") if spec is not None
              else job_args(job=job, workers=workers, k=k, result=result or None))  # fmt: skip
    arguments = ["--listen", listen, *fields, "--stats", str(stats_path), *extra]
    with log_path.open("wb") as log:  # a file, not a pipe: a full pipe would stall the process
        process = subprocess.Popen(
            command(backend, arguments),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return RunningAggregator(process, ("", 0), stats_path, log_path)


def wait_ready(running: RunningAggregator) -> RunningAggregator:
    """Wait for the readiness line (the socket is bound) and record the address it names; an
    aggregator that exits or stays silent is stopped and ``RuntimeError`` says why."""
    try:
        running.address = aggproc.wait_ready(running.process, running.log_path, START_TIMEOUT)
    except RuntimeError:
        running.stop()
        raise
    return running


def start_aggregator(backend: str, workdir: Path, **options: Any) -> RunningAggregator:
    """``launch_aggregator`` and ``wait_ready``."""
    return wait_ready(launch_aggregator(backend, workdir, **options))
