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

import numpy as np
from ncina.aggregator.jobs import Address, JobConfig
from ncina.aggregator.process import ready_line
from ncina.aggregator.stats import (
    GLOBAL_DROP_REASONS,
    JOB_COUNTERS,
    JOB_DROP_REASONS,
    GlobalStats,
    JobStats,
    publish,
    snapshot,
)

NAME = "dpdk"
# The order of enum ncd_drop in ncd.h.
DROP_NAMES = (
    "truncated",
    "bad_version",
    "bad_flags",
    "bad_format",
    "window_mismatch",
    "unknown_job",
    "non_member",
    "bad_slot",
    "bad_count",
    "bad_length",
    "bad_code",
    "chunk_mismatch",
    "bad_tag",
    "stale_generation",
)
IO_COUNTERS = (
    "rx_frames", "ignored", "arp_replies", "tx_frames", "tx_dropped", "no_mbuf", "oversize",
    "loops",
)  # fmt: skip
KEY_RING = 1 << 18  # nc8 result keys buffered per job (2 MiB); refilled every poll
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


class DataPlane:
    """The process's one C data plane (EAL can start once per process)."""

    def __init__(self, module: ModuleType) -> None:
        self.ffi = module.ffi
        self.lib = module.lib
        self._keepalive: list[Any] = []

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            reason = self.ffi.string(self.lib.ncd_error()).decode(errors="replace")
            raise RuntimeError(f"{what}: {reason}")

    def init(self, argv: Sequence[str]) -> None:
        """Start EAL and the port with ``argv`` (``argv[0]`` is a program name)."""
        args = [self.ffi.new("char[]", a.encode()) for a in argv]
        argv_c = self.ffi.new("char *[]", [*args, self.ffi.NULL])
        self._keepalive += [args, argv_c]  # EAL may keep pointers into argv
        self._check(self.lib.ncd_init(len(args), argv_c), "starting DPDK")

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

    def set_generation(self, generation: int) -> None:
        """The generation stamped on every result and notice (0: none, no notices)."""
        self.lib.ncd_set_generation(generation)

    @property
    def frame_room(self) -> int:
        """Bytes of the largest frame the data plane can send (an mbuf's data room)."""
        return int(self.lib.ncd_frame_room())

    def add_job(self, config: JobConfig) -> np.random.Generator:
        """Install a job and its members; returns the generator of its nc8 result keys (the
        Python reference's ``default_rng(seed)``), whose first keys are already pushed.

        Raises ``ValueError`` when the job's result frames exceed ``frame_room`` (naming the
        largest K), before anything is installed; the engine refuses such a job as well.
        """
        room = self.frame_room
        config.check_frame_room(room, f"the {room}-byte mbuf data room of the DPDK data plane")
        window = config.window
        rng = np.random.default_rng(config.seed)
        # The fallback stream (used only if the key ring ran dry) is seeded from the same rng's
        # independent child, so it does not consume the reference's keys.
        fallback = int(rng.spawn(1)[0].integers(0, 2**64, dtype=np.uint64))
        self._check(
            self.lib.ncd_job_add(
                config.job,
                config.workers,
                config.k,
                config.pool_size,
                window.e_min,
                window.span,
                int(config.result_format),
                fallback,
            ),
            f"installing job {config.job}",
        )
        if config.key is not None:
            self._check(self.lib.ncd_job_set_key(config.job, config.key, len(config.key)),
                        f"job {config.job} key")  # fmt: skip
        for rank, (host, port) in sorted(config.members.items()):
            self._check(
                self.lib.ncd_member_set(
                    config.job, rank, ipaddress.IPv4Address(host).packed, port
                ),
                f"job {config.job} member {rank}",
            )
        self._check(self.lib.ncd_job_key_ring(config.job, KEY_RING), "key ring")
        self.refill_keys(config.job, rng)
        return rng

    def refill_keys(self, job: int, rng: np.random.Generator) -> None:
        """Top up the job's nc8 result key ring with the next draws of ``rng``."""
        nxt = self.ffi.new("uint64_t *")
        space = self.lib.ncd_job_key_space(job, nxt)
        if space:
            keys = rng.integers(0, 2**64, size=space, dtype=np.uint64)
            self.lib.ncd_job_key_push(job, self.ffi.from_buffer("uint64_t[]", keys), space)

    def job_stats(self, job: int) -> JobStats:
        """The job's counters as the reference's ``JobStats``."""
        c = self.ffi.new("struct ncd_counters *")
        self._check(self.lib.ncd_job_stats(job, c), f"job {job} stats")
        stats = JobStats()
        for name in JOB_COUNTERS:
            setattr(stats, name, getattr(c, name))
        for i, name in enumerate(DROP_NAMES):
            if name in JOB_DROP_REASONS:
                stats.drops[name] = c.drops[i]
            elif c.drops[i]:  # never happens: the engine counts these globally
                raise RuntimeError(f"job {job} counted {name}, a global reason")
        return stats

    def global_stats(self) -> tuple[GlobalStats, dict[str, int]]:
        """The global section (``GlobalStats``) and the port's I/O counters."""
        c = self.ffi.new("struct ncd_counters *")
        io = self.ffi.new("struct ncd_io *")
        self.lib.ncd_global_stats(c, io)
        stats = GlobalStats()
        stats.packets_in = c.packets_in
        stats.bytes_in = c.bytes_in
        stats.send_errors = io.tx_dropped + io.no_mbuf + io.oversize
        for i, name in enumerate(DROP_NAMES):
            if name in GLOBAL_DROP_REASONS:
                stats.drops[name] = c.drops[i]
        return stats, {name: getattr(io, name) for name in IO_COUNTERS}

    def key_underruns(self, job: int) -> int:
        c = self.ffi.new("struct ncd_counters *")
        self.lib.ncd_job_stats(job, c)
        return int(c.key_underruns)


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
        # Jobs first: one the data plane cannot serve is refused before EAL takes the port.
        self.rngs = {c.job: self.plane.add_job(c) for c in self.configs}
        self.plane.init(eal_arguments(iface, eal_extra, vdev_options=vdev_options))
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
        global_stats, io = self.plane.global_stats()
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
