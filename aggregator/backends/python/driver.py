"""The Python reference backend: one blocking UDP socket in front of ``pipeline.Aggregator``.

The loop receives into one preallocated buffer, hands the datagram to the aggregator logic and
sends what it returns. The socket has a kernel receive timeout (``SO_RCVTIMEO``) rather than a
Python-level one, so an idle loop still wakes up to write stats and notice signals, while a busy
loop does one ``recvfrom`` system call per packet (a Python socket timeout would add a ``poll``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from ncina.aggregator import hierarchy, metrics
from ncina.aggregator.backends import Serving
from ncina.aggregator.backends.python.faults import FaultConfig, FaultyPath
from ncina.aggregator.backends.python.pipeline import Aggregator
from ncina.aggregator.backends.python.slots import DEFAULT_MAX_RESIDUAL_ELEMENTS
from ncina.aggregator.control import JobsDirectory, apply_changes
from ncina.aggregator.hierarchy import LeafAggregator
from ncina.aggregator.jobs import JobConfig
from ncina.aggregator.process import ready_line
from ncina.aggregator.stats import publish, snapshot, write_or_say

from ncina.common.address import Address
from ncina.common.options import positive_int

NAME = "python"
RECEIVE_TIMEOUT_US = 200_000  # how long an idle loop sleeps before looking at stats and signals
SOCKET_BUFFER_BYTES = 4 << 20  # asked for SO_RCVBUF and SO_SNDBUF; the kernel may cap it
MAX_DATAGRAM = 0xFFFF  # the whole of any UDP datagram, so oversized ones are seen and counted
CONTROL_INTERVAL = 0.2  # seconds between looks at the jobs directory


def open_socket(listen: Address) -> socket.socket:
    """A bound, blocking IPv4 UDP socket with big buffers and a kernel receive timeout."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            # Best effort: the kernel's default buffers still work, with more loss under bursts.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
        timeout = struct.pack("@ll", 0, RECEIVE_TIMEOUT_US)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeout)
        sock.bind(listen)
    except OSError as exc:
        sock.close()
        where = f"{listen[0]}:{listen[1]}/udp"
        raise OSError(f"cannot listen on {where}: {exc.strerror or exc}") from exc
    return sock


class PythonBackend:
    """Serves an ``Aggregator`` on a UDP socket until SIGTERM/SIGINT (or ``request_stop``).

    Stats go to ``stats_path`` (atomically) every ``stats_interval`` seconds, on SIGUSR1 and at
    exit; without a path they are printed as one JSON line on ``log`` on SIGUSR1 and at exit.
    With ``control`` (``ncina.aggregator.control``) jobs are added and removed from its
    directory every ``CONTROL_INTERVAL`` seconds while the others run, each change logged.
    """

    def __init__(
        self,
        aggregator: Aggregator,
        listen: Address,
        *,
        stats_path: Path | None = None,
        stats_interval: float = 1.0,
        log: TextIO = sys.stderr,
        faults: FaultConfig | None = None,
        control: JobsDirectory | None = None,
    ) -> None:
        self.aggregator = aggregator
        self.control = control
        self.stats_path = stats_path
        self.stats_interval = stats_interval
        self.log = log
        self.started = time.time()
        self.socket = open_socket(listen)
        self.address: Address = self.socket.getsockname()
        self._stop = False
        self._stats_requested = False
        self._receiving = False  # in the receive: no packet half handled (``_on_stats_signal``)
        self._internal_error_logged = False
        # Emulated network faults (``--drop-up`` ...): None keeps the plain loop below.
        self.faults = (
            FaultyPath(faults, aggregator.handle, self._send)
            if faults is not None and faults.active
            else None
        )

    def run(self) -> int:
        """Install the signal handlers, announce readiness on ``log``, serve, write final stats."""
        signal.signal(signal.SIGTERM, self._on_stop_signal)
        signal.signal(signal.SIGINT, self._on_stop_signal)
        signal.signal(signal.SIGUSR1, self._on_stats_signal)
        if self.stats_path is not None:
            self.write_stats()  # fails early on an unwritable path, and shows the schema at once
        if isinstance(self.aggregator, LeafAggregator):  # a leaf: its spine's handshake first
            try:
                self.aggregator.join(self.socket)
            except BaseException:
                self.close()
                raise
        jobs = "; ".join(slots.describe() for slots in self.aggregator.jobs.values())
        details = f"pid {os.getpid()}, generation {self.aggregator.generation}, {jobs}"
        line = ready_line(self.address, NAME, details)
        print(line, file=self.log, flush=True)
        try:
            self.serve()
        finally:
            self.close()
            self.write_stats()
        return 0

    def serve(self) -> None:
        """The packet loop; returns after ``request_stop``."""
        buffer = bytearray(MAX_DATAGRAM)
        view = memoryview(buffer)
        receive = self.socket.recvfrom_into
        send = self.socket.sendto
        handle = self.aggregator.handle
        global_stats = self.aggregator.stats
        faults = self.faults
        control = self.control
        clock = time.monotonic
        next_write = clock() + self.stats_interval
        periodic = self.stats_path is not None or metrics.serving()
        next_poll = 0.0
        while not self._stop:
            self._receiving = True
            try:
                size, source = receive(buffer)
            except BlockingIOError:  # SO_RCVTIMEO expired: idle
                self._receiving = False
                if faults is not None:
                    faults.idle()
            else:
                self._receiving = False
                try:
                    if faults is not None:  # a held-back datagram must outlive the buffer
                        faults.deliver(bytes(view[:size]), source)
                    else:
                        for datagram, destination in handle(view[:size], source):
                            try:
                                send(datagram, destination)
                            except OSError:
                                global_stats.send_errors += 1
                except Exception:
                    self._internal_error(source)
            requested = self._stats_requested
            if requested or (periodic and clock() >= next_write):
                self._stats_requested = False
                next_write = clock() + self.stats_interval
                write_or_say(self.write_stats, self.log, periodic=not requested)
            if control is not None and clock() >= next_poll:
                next_poll = clock() + CONTROL_INTERVAL
                self.apply_control()

    def apply_control(self) -> None:
        """Add and remove jobs as the jobs directory says, and log each change."""
        aggregator = self.aggregator
        assert self.control is not None
        apply_changes(self.control, aggregator.jobs.keys(), aggregator.add_job,
                      aggregator.remove_job, self.log, aggregator.limits)  # fmt: skip

    def _send(self, datagram: bytes, destination: Address) -> None:
        """Send one datagram; a failure is counted (``send_errors``), never raised."""
        try:
            self.socket.sendto(datagram, destination)
        except OSError:
            self.aggregator.stats.send_errors += 1

    def close(self) -> None:
        """Release the socket (``run`` does it on its way out)."""
        self.socket.close()

    def request_stop(self) -> None:
        """Make ``serve`` return within one receive timeout."""
        self._stop = True

    def stats_document(self) -> dict[str, Any]:
        """The stats JSON document (docs/protocol.md, "Counters") as of now."""
        document = snapshot(
            backend=NAME,
            started=self.started,
            global_stats=self.aggregator.stats,
            jobs={job: slots.stats for job, slots in self.aggregator.jobs.items()},
            faults=self.faults.counts if self.faults is not None else None,
            limits=self.aggregator.limits,
        )
        if isinstance(self.aggregator, LeafAggregator):
            document["upstream"] = self.aggregator.upstream_document()
        return document

    def write_stats(self, periodic: bool = False) -> None:
        """Write the stats document to ``stats_path``, or print it as one line on ``log``
        (not when ``periodic``); the metrics endpoint serves it (``stats.publish``)."""
        publish(self.stats_document(), self.stats_path, self.log, periodic=periodic)

    def _internal_error(self, source: Address) -> None:
        self.aggregator.stats.drops["internal_error"] += 1
        if self._internal_error_logged:
            return
        self._internal_error_logged = True
        print(
            f"ncina aggregator: internal error on a packet from {source[0]}:{source[1]} "
            "(counted as internal_error; later ones are only counted):",
            file=self.log,
        )
        traceback.print_exc(file=self.log)
        self.log.flush()

    def _on_stop_signal(self, signum: int, frame: object) -> None:
        self._stop = True

    def _on_stats_signal(self, signum: int, frame: object) -> None:
        """Write the stats at once when the loop waits in its receive (no packet is half
        handled then, so the counters are consistent; the interrupted receive resumes), else as
        soon as the packet in hand is done: an idle aggregator answers SIGUSR1 in microseconds,
        not after its receive timeout."""
        if self._receiving:
            write_or_say(self.write_stats, self.log)
        else:
            self._stats_requested = True


@dataclass(frozen=True)
class PythonOptions:
    """The python backend's options (``ncina.aggregator.backends``' contract)."""

    serving: Serving
    faults: FaultConfig
    """The emulated network faults (``--drop-up`` ...; none by default)."""
    max_residual_elements: int
    """``--max-residual-elements``: server mode's error-feedback memory, in float32 elements."""


def add_arguments(parser: Any) -> list[Any]:
    """The ``ncina aggregator`` options of the python backend: server mode's memory and the
    emulated network faults, as their argument groups."""
    group = parser.add_argument_group("python backend")
    group.add_argument(
        "--max-residual-elements",
        type=positive_int,
        default=DEFAULT_MAX_RESIDUAL_ELEMENTS,
        metavar="N",
        help="server mode (python backend): the error-feedback memory a job keeps, in float32 "
        "elements (each chunk's state is charged 512 more); a chunk past it gets no error "
        "feedback, counted (limits.residuals_unkept) (default: %(default)s, about 1 GiB)",
    )
    faults = parser.add_argument_group(
        "emulated network faults (python backend; seeded, counted in the stats' faults section)"
    )
    for flag, what in (
        ("--drop-up", "drop each received datagram"),
        ("--drop-down", "drop each result datagram to each worker"),
        ("--duplicate", "process each received datagram twice"),
        ("--reorder", "hold each received datagram back behind the next one"),
    ):
        faults.add_argument(flag, type=float, default=0.0, metavar="P", help=f"{what} with "
                            "probability P (default: 0)")  # fmt: skip
    faults.add_argument("--fault-seed", type=int, default=0, help="seed of the fault decisions")
    faults.add_argument("--drop-every", type=int, default=0, metavar="N",
                        help="also drop the Nth, 2Nth, ... datagram from each source and to "
                        "each destination address: a fixed pattern (default: 0, off)")
    return [group, faults]


def options(args: Any, serving: Serving) -> PythonOptions:
    """The python backend's options of the parsed command line ``args``."""
    faults = FaultConfig(
        drop_up=args.drop_up,
        drop_down=args.drop_down,
        duplicate=args.duplicate,
        reorder=args.reorder,
        seed=args.fault_seed,
        drop_every=args.drop_every,
    )
    return PythonOptions(serving, faults, args.max_residual_elements)


def serve(config: JobConfig, options: PythonOptions) -> int:
    """Run the python backend for ``config`` (in server mode with ``serving.compressor``)
    until SIGTERM/SIGINT."""
    serving = options.serving
    if serving.tree is not None:
        aggregator = hierarchy.make_aggregator(config, serving.tree, serving.generation)
    else:
        aggregator = Aggregator(
            serving.generation, max_residual_elements=options.max_residual_elements
        )
        aggregator.add_job(config, serving.compressor)
    aggregator.restart_idle = serving.restart_idle
    backend = PythonBackend(
        aggregator,
        serving.listen,
        stats_path=serving.stats,
        stats_interval=serving.stats_interval,
        faults=options.faults,
        control=serving.control,
    )
    return backend.run()
