"""What the socket and dpdk backends share around their C loops: the backend contract of
``ncina aggregator`` (readiness line, stats document and file, signals) for an engine whose
loop runs in a thread.

The C loop runs in a Python thread: cffi releases the GIL for the call, so the loop never touches
Python, and the main thread is free to handle signals and write the stats document (the schema
of ``ncina.aggregator.stats``, plus one section of the I/O layer's own counters named after the
backend).
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from ncina.aggregator import metrics
from ncina.aggregator.control import JobsDirectory, apply_changes
from ncina.aggregator.engine import Engine
from ncina.aggregator.hierarchy import UPSTREAM_COUNTERS, LeafAggregator, SpineLink
from ncina.aggregator.jobs import JobConfig
from ncina.aggregator.process import ready_line
from ncina.aggregator.stats import LimitStats, publish, snapshot, write_or_say

from ncina.common.address import Address

POLL_SECONDS = 0.05
CONTROL_INTERVAL = 0.2  # seconds between looks at the jobs directory (as the Python backend)


class EngineBackend:
    """Serve jobs with an engine's C loop until SIGTERM/SIGINT (or ``request_stop``).

    Same contract as ``PythonBackend``: a readiness line on ``log``, stats to ``stats_path``
    every ``stats_interval`` seconds, on SIGUSR1 and at exit (one JSON line on ``log`` without a
    path). Subclasses set ``name`` and ``address`` and implement the loop hooks below. With
    ``control`` (``ncina.aggregator.control``) jobs are added and removed from its directory
    every ``CONTROL_INTERVAL`` seconds while the others run, each change logged (the engine
    configures an added job completely before the loop sees it, and frees a removed one once
    the loop cannot hold it).
    """

    name = ""
    leaf: LeafAggregator | None = None  # a leaf's (set by a subclass before ``run``)

    def __init__(
        self,
        plane: Engine,
        configs: Sequence[JobConfig],
        *,
        stats_path: Path | None,
        stats_interval: float,
        generation: int,
        log: TextIO,
        control: JobsDirectory | None = None,
    ) -> None:
        self.plane = plane
        self.configs = {c.job: c for c in configs}
        self.control = control
        self.limits = LimitStats()  # what --max-jobs refused
        self.stats_path = stats_path
        self.stats_interval = stats_interval
        self.generation = generation
        self.log = log
        self.started = time.time()
        self.address: Address = ("0.0.0.0", 0)
        self._loop_ended = threading.Event()  # set by the loop's thread
        # Set by a signal handler (or ``request_stop``), which must take no lock: a handler runs
        # in the main thread between two bytecodes, and that thread may hold the lock of the
        # poll's wait (``Event.wait`` re-takes it after its timeout), so ``Event.set`` there
        # would wait on it for good (the -9 of stop 47's CI).
        self._stopping = False
        self._stats_requested = False
        self._waiting = False  # in the poll's wait (``_on_stats_signal``)
        self._run_rc = 0
        plane.set_generation(generation)

    def install_jobs(self) -> None:
        """Install every job."""
        for config in self.configs.values():
            self.plane.add_job(config)

    def add_job(self, config: JobConfig) -> None:
        """Install one more job while the loop runs."""
        self.plane.add_job(config)
        self.configs[config.job] = config

    def remove_job(self, job: int) -> None:
        """Uninstall a job while the loop runs."""
        del self.configs[job]
        self.plane.remove_job(job)

    # ---- hooks of the I/O layer ----

    def loop(self) -> int:
        """Run the C loop on this thread until ``stop_loop``; its return code."""
        raise NotImplementedError

    def stop_loop(self) -> None:
        """Make ``loop`` return (called from the main thread)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the I/O layer (after the loop returned)."""
        raise NotImplementedError

    def prepare(self) -> None:
        """What must happen before the loop serves (after the first stats are written): a
        leaf's job handshake with its spine. Nothing by default."""

    def join_spine(self, link: socket.socket | SpineLink) -> None:
        """A leaf's ``prepare``: the spine's job handshake (``LeafAggregator.join``) over
        ``link``, then the engine learns the spine, the rank and its generation. On failure the
        I/O layer is closed and the error raised."""
        leaf = self.leaf
        assert leaf is not None and leaf.leaf is not None
        try:
            leaf.join(link)
            self.plane.set_upstream(leaf.leaf.config.job, leaf)
        except BaseException:
            self.close()
            raise

    def upstream_document(self) -> dict[str, Any] | None:
        """A leaf's ``upstream`` section of the stats document (the handshake's counts, from
        ``join``, plus the engine's), or None (not a leaf)."""
        if self.leaf is None:
            return None
        document = self.leaf.upstream_document()
        engine = self.plane.upstream_stats()
        for name in UPSTREAM_COUNTERS:
            document[name] += getattr(engine, name)
        for reason, count in engine.drops.items():
            document["drops"][reason] += count
        return document

    def details(self) -> str:
        """What the readiness line says about the I/O layer (after the pid)."""
        raise NotImplementedError

    def io_stats(self) -> tuple[int, dict[str, Any]]:
        """The I/O layer's failures (the global ``send_errors``) and its counters."""
        raise NotImplementedError

    # ---- the contract ----

    def run(self) -> int:
        """Install signal handlers, announce readiness, run the loop thread, poll, clean up;
        returns the loop's return code."""
        signal.signal(signal.SIGTERM, self._on_stop_signal)
        signal.signal(signal.SIGINT, self._on_stop_signal)
        signal.signal(signal.SIGUSR1, self._on_stats_signal)
        if self.stats_path is not None:
            self.write_stats()
        self.prepare()
        self.plane.set_live(True)
        thread = threading.Thread(target=self._loop, name=f"{self.name} loop", daemon=True)
        thread.start()
        jobs = "; ".join(c.describe() for c in self.configs.values())
        details = f"pid {os.getpid()}, {self.details()}, {jobs}"
        print(ready_line(self.address, self.name, details), file=self.log, flush=True)
        try:
            self._poll()
        finally:
            self.stop_loop()
            thread.join()
            self.plane.set_live(False)
            self.write_stats()
            self.close()
        return self._run_rc

    def _loop(self) -> None:
        self._run_rc = self.loop()
        if self._run_rc != 0:
            reason = self.plane.ffi.string(self.plane.lib.nce_error()).decode(errors="replace")
            print(f"ncina aggregator: the {self.name} loop stopped: {reason}", file=self.log,
                  flush=True)  # fmt: skip
        self._loop_ended.set()

    def _poll(self) -> None:
        next_write = time.monotonic() + self.stats_interval
        periodic = self.stats_path is not None or metrics.serving()
        next_control = 0.0
        while True:
            self._waiting = True  # a stats signal meanwhile writes them at once
            ended = self._loop_ended.wait(POLL_SECONDS)
            self._waiting = False
            if ended or self._stopping:
                break
            if self.control is not None and time.monotonic() >= next_control:
                next_control = time.monotonic() + CONTROL_INTERVAL
                apply_changes(self.control, self.configs.keys(), self.add_job, self.remove_job,
                              self.log, self.limits)  # fmt: skip
            now = time.monotonic()
            requested = self._stats_requested
            if requested or (periodic and now >= next_write):
                self._stats_requested = False
                next_write = now + self.stats_interval
                write_or_say(self.write_stats, self.log, periodic=not requested)

    def request_stop(self) -> None:
        """Make ``run`` return within one poll period."""
        self._stopping = True

    def stats_document(self) -> dict[str, Any]:
        """The stats document (``ncina.aggregator.stats`` schema) plus the I/O section, stamped
        before its counters are read: the strands count on while they are (``snapshot``)."""
        taken = time.time()
        send_errors, io = self.io_stats()
        global_stats = self.plane.global_stats()
        global_stats.send_errors = send_errors
        document = snapshot(
            backend=self.name,
            started=self.started,
            global_stats=global_stats,
            jobs={job: self.plane.job_stats(job) for job in self.configs},
            limits=self.limits,
            taken=taken,
        )
        upstream = self.upstream_document()
        if upstream is not None:
            document["upstream"] = upstream
        document[self.name] = io
        return document

    def write_stats(self, periodic: bool = False) -> None:
        """Write the stats document to ``stats_path``, or print it as one line on ``log``
        (not when ``periodic``); the metrics endpoint serves it (``stats.publish``)."""
        publish(self.stats_document(), self.stats_path, self.log, periodic=periodic)

    def _on_stop_signal(self, signum: int, frame: object) -> None:
        self._stopping = True  # no lock (see ``__init__``): the poll sees it within its period

    def _on_stats_signal(self, signum: int, frame: object) -> None:
        """Write the stats at once when the main thread waits between polls (it is not in the
        middle of a write then), else at its next poll: SIGUSR1 is answered in microseconds,
        not after up to ``POLL_SECONDS``."""
        if self._waiting:
            write_or_say(self.write_stats, self.log)
        else:
            self._stats_requested = True

