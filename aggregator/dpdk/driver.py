"""Drive the C data plane: EAL and the af_packet port, jobs, the run thread, stats and signals.

The burst loop (``ncd_run``) runs in a Python thread: cffi releases the GIL for the call, so the
loop never touches Python, and the main thread is free to handle signals, keep the nc8 result key
rings topped up and write the stats document (the schema of ``ncina.aggregator.stats``).
"""

from __future__ import annotations

import ipaddress
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, TextIO

from ncina.aggregator.engine import Engine
from ncina.aggregator.jobs import Address, JobConfig
from ncina.aggregator.process import ready_line
from ncina.aggregator.stats import GlobalStats, publish, snapshot

NAME = "dpdk"
IO_COUNTERS = ("rx_frames", "ignored", "arp_replies", "tx_frames", "tx_dropped", "no_mbuf", "loops")
POLL_SECONDS = 0.05
DEFAULT_IDLE_SLEEP_US = 20
MODES = {"aggregate": 0, "forward": 1}


def eal_arguments(iface: str, extra: Sequence[str] = (), *, vdev_options: str = "") -> list[str]:
    """The EAL command line for one af_packet port on ``iface`` without hugepages or PCI.

    ``--no-shconf`` and a per-process ``--file-prefix`` let several data planes run at once
    (``--in-memory`` would, but it is incompatible with ``--no-huge``), and the main lcore may
    run on any CPU this process may use (EAL would otherwise pin it to one).
    """
    cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    vdev = f"net_af_packet0,iface={iface}" + (f",{vdev_options}" if vdev_options else "")
    return [
        "ncina-dpdk",
        "--no-huge",
        "--no-pci",
        "--no-shconf",
        f"--file-prefix=ncd{os.getpid()}",
        "-m",
        "128",
        f"--lcores=0@({cpus})",
        "--log-level=lib.eal:error",
        "--no-telemetry",
        f"--vdev={vdev}",
        *extra,
    ]


class DataPlane(Engine):
    """The process's one C data plane (EAL can start once per process): the engine's control
    plane and the DPDK port's."""

    def __init__(self, module: ModuleType) -> None:
        super().__init__(module)
        self._keepalive: list[Any] = []

    def init(self, argv: Sequence[str]) -> None:
        """Start EAL and the port with ``argv`` (``argv[0]`` is a program name)."""
        args = [self.ffi.new("char[]", a.encode()) for a in argv]
        argv_c = self.ffi.new("char *[]", [*args, self.ffi.NULL])
        self._keepalive += [args, argv_c]  # EAL may keep pointers into argv
        self.check(self.lib.ncd_init(len(args), argv_c), "starting DPDK")

    @property
    def mac(self) -> str:
        """The port's MAC address, ``aa:bb:...``."""
        buf = self.ffi.new("uint8_t[6]")
        self.lib.ncd_get_mac(buf)
        return ":".join(f"{b:02x}" for b in bytes(buf))

    def set_mac(self, mac: str) -> None:
        """Set the MAC the engine answers to (offline use; ``init`` takes the port's)."""
        self.lib.ncd_set_mac(bytes.fromhex(mac.replace(":", "")))

    def set_address(self, listen: Address) -> None:
        """The aggregator's IPv4 address (0.0.0.0: any) and UDP port."""
        host, port = listen
        if not 0 < port <= 0xFFFF:
            raise ValueError(f"the dpdk backend needs a fixed UDP port, not {port}")
        self.lib.ncd_set_address(ipaddress.IPv4Address(host).packed, port)

    def reset(self) -> None:
        """Remove every job and zero every counter, the port's too (tests)."""
        self.lib.nce_reset()
        self.lib.ncd_io_reset()

    def port_stats(self) -> tuple[GlobalStats, dict[str, int]]:
        """The global section (``GlobalStats``, the port's failures as ``send_errors``) and the
        port's I/O counters."""
        io = self.ffi.new("struct ncd_io *")
        self.lib.ncd_io_stats(io)
        stats = self.global_stats()
        stats.send_errors = io.tx_dropped + io.no_mbuf
        return stats, {name: getattr(io, name) for name in IO_COUNTERS}


class DpdkBackend:
    """Serve jobs with the C data plane on ``iface`` until SIGTERM/SIGINT (or ``request_stop``).

    Same contract as ``PythonBackend``: a readiness line on ``log``, stats to ``stats_path``
    every ``stats_interval`` seconds, on SIGUSR1 and at exit (one JSON line on ``log`` without a
    path). ``mode="forward"`` runs the no-op forwarder instead (benchmarks).
    """

    def __init__(
        self,
        configs: Sequence[JobConfig],
        iface: str,
        listen: Address,
        *,
        eal_extra: Sequence[str] = (),
        vdev_options: str = "",
        stats_path: Path | None = None,
        stats_interval: float = 1.0,
        idle_sleep_us: int = DEFAULT_IDLE_SLEEP_US,
        mode: str = "aggregate",
        generation: int = 0,
        log: TextIO = sys.stderr,
    ) -> None:
        from ncina.aggregator.dpdk.binding import load

        self.configs = list(configs)
        self.iface = iface
        self.listen = listen
        self.stats_path = stats_path
        self.stats_interval = stats_interval
        self.idle_sleep_us = idle_sleep_us
        self.mode = MODES[mode]
        self.log = log
        self.started = time.time()
        self.plane = DataPlane(load())
        self.plane.set_address(listen)
        self.plane.set_generation(generation)
        self.generation = generation
        self.plane.init(eal_arguments(iface, eal_extra, vdev_options=vdev_options))
        self.rngs = {c.job: self.plane.add_job(c) for c in self.configs}
        self._stop = threading.Event()
        self._stats_requested = False
        self._run_rc = 0

    def run(self) -> int:
        """Install signal handlers, announce readiness, run the loop thread, poll, clean up."""
        signal.signal(signal.SIGTERM, self._on_stop_signal)
        signal.signal(signal.SIGINT, self._on_stop_signal)
        signal.signal(signal.SIGUSR1, self._on_stats_signal)
        if self.stats_path is not None:
            self.write_stats()
        thread = threading.Thread(target=self._loop, name="ncd_run", daemon=True)
        thread.start()
        jobs = "; ".join(c.describe() for c in self.configs)
        mode = "no-op forwarder" if self.mode else f"aggregator, generation {self.generation}"
        details = f"{mode}, pid {os.getpid()}, iface {self.iface} mac {self.plane.mac}, {jobs}"
        print(ready_line(self.listen, NAME, details), file=self.log, flush=True)
        try:
            self._poll()
        finally:
            self.plane.lib.ncd_stop()
            thread.join()
            self.write_stats()
            self.plane.lib.ncd_close()
        return self._run_rc

    def _loop(self) -> None:
        self._run_rc = self.plane.lib.ncd_run(self.mode, self.idle_sleep_us)
        self._stop.set()

    def _poll(self) -> None:
        next_write = time.monotonic() + self.stats_interval
        while not self._stop.wait(POLL_SECONDS):
            for job, rng in self.rngs.items():
                self.plane.refill_keys(job, rng)
            now = time.monotonic()
            if self._stats_requested or (self.stats_path is not None and now >= next_write):
                self._stats_requested = False
                next_write = now + self.stats_interval
                try:
                    self.write_stats()
                except OSError as exc:
                    print(f"ncina aggregator: cannot write stats: {exc}", file=self.log, flush=True)

    def request_stop(self) -> None:
        """Make ``run`` return within one poll period."""
        self._stop.set()

    def stats_document(self) -> dict[str, Any]:
        """The stats document (``ncina.aggregator.stats`` schema) plus a ``dpdk`` I/O section."""
        global_stats, io = self.plane.port_stats()
        document = snapshot(
            backend=NAME,
            started=self.started,
            global_stats=global_stats,
            jobs={c.job: self.plane.job_stats(c.job) for c in self.configs},
        )
        io["key_underruns"] = sum(self.plane.key_underruns(c.job) for c in self.configs)
        document["dpdk"] = io
        return document

    def write_stats(self) -> None:
        """Write the stats document to ``stats_path``, or print it as one line on ``log``."""
        publish(self.stats_document(), self.stats_path, self.log)

    def _on_stop_signal(self, signum: int, frame: object) -> None:
        self._stop.set()

    def _on_stats_signal(self, signum: int, frame: object) -> None:
        self._stats_requested = True


def add_arguments(parser: Any) -> None:
    """The ``ncina aggregator`` options of the dpdk backend."""
    group = parser.add_argument_group("dpdk backend")
    group.add_argument(
        "--eal-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="dpdk: an extra EAL argument, passed through (repeatable, e.g. --eal-arg=-m256)",
    )
    group.add_argument(
        "--vdev-options",
        default="",
        metavar="K=V,...",
        help="dpdk: extra net_af_packet options (e.g. framecnt=4096,qdisc_bypass=1)",
    )
    group.add_argument(
        "--dpdk-mode",
        choices=tuple(MODES),
        default="aggregate",
        help="dpdk: aggregate, or forward (the no-op forwarder that echoes every frame: the "
        "I/O limit, for benchmarks) (default: %(default)s)",
    )
    group.add_argument(
        "--idle-sleep-us",
        type=int,
        default=DEFAULT_IDLE_SLEEP_US,
        metavar="US",
        help="dpdk: when idle, sleep this long between polls; 0 polls flat out "
        "(default: %(default)s)",
    )


def serve(config: JobConfig, args: Any, generation: int) -> int:
    """Run the dpdk backend for ``config`` with the parsed command line ``args``."""
    if not args.iface:
        raise ValueError("the dpdk backend needs --iface IF (the interface to attach to)")
    backend = DpdkBackend(
        [config],
        args.iface,
        args.listen,
        eal_extra=args.eal_arg,
        vdev_options=args.vdev_options,
        stats_path=args.stats,
        stats_interval=args.stats_interval,
        idle_sleep_us=args.idle_sleep_us,
        mode=args.dpdk_mode,
        generation=generation,
    )
    return backend.run()
