"""``ncina aggregator --backend bmv2``: compile ``p4/`` for the job's K, start
``simple_switch_grpc`` on the ``--iface`` interfaces (switch ports 1, 2, ...), push the pipeline
and the job over P4Runtime, announce readiness, and turn the switch's counters into the stats
document until SIGTERM. The switch answers ARP for the ``--listen`` address, serves its UDP port
(0: the protocol's) and switches every other frame at L2.

One interface is an aggregator attached to a link, as the DPDK data plane is; several make it the
network's switch (``make topo BACKEND=bmv2``): ``--rank-port`` says which port each rank is on,
for its copy of a result, and ``--l2-host`` which port each known MAC address is on.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ncina.aggregator import metrics
from ncina.aggregator.backends import Serving
from ncina.aggregator.backends.bmv2 import entries, gen, toolchain
from ncina.aggregator.backends.bmv2.control import Controller
from ncina.aggregator.backends.bmv2.switch import Switch, SwitchConfig
from ncina.aggregator.backends.tofino import twin
from ncina.aggregator.backends.tofino.twin import events as twin_events
from ncina.aggregator.backends.tofino.twin import learning as twin_learning
from ncina.aggregator.backends.tofino.twin import limits as twin_limits
from ncina.aggregator.backends.tofino.twin import switching as twin_switching
from ncina.aggregator.jobs import JobConfig
from ncina.aggregator.process import ready_line
from ncina.aggregator.stats import GlobalStats, JobStats, publish, snapshot
from ncina.proto.header import PORT

NAME = "bmv2"
FIRST_PORT = 1  # the switch port of the first --iface; every rank's, unless --rank-port says


@dataclass(frozen=True)
class Bmv2Options:
    """The bmv2 backend's options (``ncina.aggregator.backends``' contract)."""

    serving: Serving
    iface: str | None
    """``--iface``: the switch's interfaces, comma-separated (ports 1, 2, ...)."""
    p4_k: int | None
    """``--p4-k``: the lanes to compile the program for (None: the job's K)."""
    device_id: int
    """``--device-id``: the P4Runtime device id."""
    grpc_port: int
    """``--grpc-port``: the switch's P4Runtime port (0: a free one)."""
    thrift_port: int
    """``--thrift-port``: the switch's Thrift port (0: a free one)."""
    switch_log: Path | None
    """``--switch-log``: the switch's output file (None: logs/bmv2-<iface>.log)."""
    pcap_dir: Path | None
    """``--pcap-dir``: where the switch writes its pcaps (None: nowhere)."""
    mode: str
    """``--bmv2-mode``: aggregate, or forward (p4/echo/echo.p4)."""
    switch_debug: bool
    """``--switch-debug``: log each packet's path through the pipeline."""
    rank_ports: dict[int, int]
    """``--rank-port``: rank -> the switch port it is on."""
    l2_hosts: tuple[tuple[str, int], ...]
    """``--l2-host``: (MAC address, the switch port it is on), as given."""


def add_arguments(parser: Any) -> list[Any]:
    """The ``ncina aggregator`` options of the bmv2 backend, as their argument group
    (``--iface`` is shared with dpdk)."""
    group = parser.add_argument_group("bmv2 backend (p4/ on simple_switch_grpc, docs/bmv2.md)")
    # fmt: off
    group.add_argument("--p4-k", type=int, metavar="K",
                       help="bmv2: lanes to compile the program for (default: the job's --k)")
    group.add_argument("--device-id", type=int, default=1, help="bmv2: P4Runtime device id "
                       "(default: %(default)s)")
    group.add_argument("--grpc-port", type=int, default=0, metavar="PORT",
                       help="bmv2: the switch's P4Runtime port on 127.0.0.1 (default: a free one)")
    group.add_argument("--thrift-port", type=int, default=0, metavar="PORT",
                       help="bmv2: the switch's Thrift port, for simple_switch_CLI (default: a "
                       "free one)")
    group.add_argument("--switch-log", type=Path, metavar="FILE",
                       help="bmv2: the switch's output (default: logs/bmv2-<iface>.log)")
    group.add_argument("--pcap-dir", type=Path, metavar="DIR",
                       help="bmv2: write the switch's pcaps into DIR (default: none)")
    group.add_argument("--bmv2-mode", choices=("aggregate", "forward"), default="aggregate",
                       help="bmv2: aggregate, or forward (p4/echo/echo.p4, the no-op forwarder "
                       "that echoes every datagram: what the switch itself forwards, for "
                       "benchmarks) (default: %(default)s)")
    group.add_argument("--switch-debug", action="store_true",
                       help="bmv2: log each packet's path through the pipeline (slow)")
    group.add_argument("--rank-port", type=_pair(int, "RANK"), action="append", default=[],
                       metavar="RANK=PORT", help="bmv2: the switch port rank RANK is on, for its "
                       "copy of each result (default: port 1, the first --iface)")
    group.add_argument("--l2-host", type=_pair(str, "MAC"), action="append", default=[],
                       metavar="MAC=PORT", help="bmv2: the switch port of a host's MAC address; "
                       "frames to other addresses are flooded")
    # fmt: on
    return [group]


def options(args: Any, serving: Serving) -> Bmv2Options:
    """The bmv2 backend's options of the parsed command line ``args``."""
    if serving.control is not None:
        raise ValueError(
            "--jobs-dir is not available on bmv2: the P4 program holds up to 16 jobs, but "
            "adding and removing them while the switch runs (table entries, multicast "
            "groups, a share of the slot registers) is not implemented in its control "
            "plane; run one job per switch, or the python, socket or dpdk backend"
        )
    return Bmv2Options(
        serving, iface=args.iface, p4_k=args.p4_k, device_id=args.device_id,
        grpc_port=args.grpc_port, thrift_port=args.thrift_port,
        switch_log=args.switch_log, pcap_dir=args.pcap_dir, mode=args.bmv2_mode,
        switch_debug=args.switch_debug, rank_ports=dict(args.rank_port),
        l2_hosts=tuple(args.l2_host),
    )  # fmt: skip


def _pair(key: type, name: str) -> Any:
    """The argparse type of ``NAME=PORT`` options: ``(key(NAME), port)``."""

    def parse(text: str) -> tuple[Any, int]:
        left, sep, right = text.partition("=")
        try:
            if not sep:
                raise ValueError
            return key(left), int(right)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {name}=PORT") from None

    return parse


def _free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mac(iface: str) -> str:
    try:
        return Path(f"/sys/class/net/{iface}/address").read_text().strip()
    except OSError:
        raise ValueError(f"--iface {iface}: no such network interface") from None


def _to_log(line: str) -> None:
    """A build's line on the aggregator's log (stderr): a compile before the switch starts is
    announced, so that ``wait_ready`` does not count it against the start."""
    print(line, file=sys.stderr, flush=True)


def serve(config: JobConfig, options: Bmv2Options) -> int:
    """Run the bmv2 backend for ``config`` until SIGTERM/SIGINT."""
    if not options.iface:
        raise ValueError("the bmv2 backend needs --iface IF[,IF...] (the switch's interfaces)")
    serving = options.serving
    generation = serving.generation
    ifaces = options.iface.split(",")
    ports = {FIRST_PORT + i: iface for i, iface in enumerate(ifaces)}
    rank_ports = options.rank_ports
    for what, port_numbers in (("--rank-port", rank_ports.values()),
                               ("--l2-host", (p for _, p in options.l2_hosts))):  # fmt: skip
        unknown = sorted(set(port_numbers) - set(ports))
        if unknown:
            raise ValueError(f"{what}: port {unknown[0]} is not one of the --iface ports "
                             f"1..{len(ports)}")  # fmt: skip
    strangers = sorted(set(rank_ports) - set(range(config.workers)))
    if strangers:
        raise ValueError(f"--rank-port: rank {strangers[0]} is not a rank of the job "
                         f"(0..{config.workers - 1})")  # fmt: skip
    host, port = serving.listen
    if host == "0.0.0.0":
        raise ValueError("the bmv2 backend needs --listen with the address it answers for")
    port = port or PORT
    k = options.p4_k or config.k
    profile = config.profile  # --profile tofino runs p4/twin/, the Tofino program's twin
    if profile == "tofino":
        refusal = twin_limits.refusal(config, k)
        if refusal:
            raise ValueError(f"the bmv2 backend's tofino profile cannot run this job: {refusal}")
    else:  # before anything starts: what the program cannot do, a K more than BMv2 takes
        entries.check_job(config)
        gen.check_k(k)
    macs = [_mac(iface) for iface in ifaces]  # every interface must exist before anything starts
    mac = macs[0]  # the aggregator's MAC address: that of port 1's interface
    reason = toolchain.missing()
    if reason:
        raise ValueError(f"the bmv2 backend cannot run: {reason}")
    [job] = entries.place([config], generation, k)
    forward = options.mode == "forward"
    build = (toolchain.build_echo(announce=_to_log) if forward
             else toolchain.build(k, profile=profile, announce=_to_log))  # fmt: skip
    switch = Switch(
        SwitchConfig(
            ports=ports,
            log_path=options.switch_log or Path("logs") / f"bmv2-{ifaces[0]}.log",
            device_id=options.device_id,
            grpc_port=options.grpc_port or _free_tcp_port(),
            thrift_port=options.thrift_port or _free_tcp_port(),
            pcap_dir=options.pcap_dir,
            verbose=options.switch_debug,
        )
    ).start()
    controller = Controller(switch.config.grpc_address, options.device_id)
    try:
        controller.connect(build)
        if forward:  # the echo program has no tables
            return _Server(controller, switch, job, options, (host, port), mac, k, True).run()
        rank_port = {rank: rank_ports.get(rank, FIRST_PORT) for rank in range(config.workers)}
        # The job's group first and the aggregator's own address after every entry of the job:
        # until it is in, nothing addressed to the aggregator is taken, so no hello is answered
        # and no round completes on a job half installed (twin.entries); the flood group last,
        # so that meanwhile such a datagram is dropped (the sender resends it), not flooded.
        if profile == "tofino":
            # Members are learned from the switch's digests (twin.learning), by a thread that
            # runs while the job does: subscribed before the job's first packet can come.
            controller.subscribe(twin_learning.DIGEST)
            job_group, flood_group = twin.groups(job, rank_port, list(ports))
            controller.insert_group(job_group)
            for entry in [*twin_switching.l2_entries(dict(options.l2_hosts)),
                          *twin.entries(job, (host, port, mac))]:  # fmt: skip
                controller.insert(entry)
            controller.insert_group(flood_group)
            listener = twin_learning.Listener(controller, twin_learning.Learning(job))
            return _Server(controller, switch, job, options, (host, port), mac, k,
                           profile=profile, listener=listener).run()  # fmt: skip
        controller.insert_group(entries.job_group(job, rank_port))
        for entry in entries.l2_entries(dict(options.l2_hosts)):
            controller.insert(entry)
        controller.insert_all(entries.lane_entries(k))
        for entry in entries.job_entries(job, serving.restart_idle):
            controller.insert(entry)
        controller.insert(entries.local_entry(host, port, mac, generation))
        controller.insert_group(entries.flood_group(list(ports)))
        return _Server(controller, switch, job, options, (host, port), mac, k).run()
    finally:
        controller.close()
        switch.stop()


class _Server:
    """The running backend: readiness line, stats on SIGUSR1 and every interval, stop on TERM."""

    def __init__(self, controller: Controller, switch: Switch, job: entries.InstalledJob,
                 options: Bmv2Options, listen: tuple[str, int], mac: str, k: int,
                 forward: bool = False, profile: str = "default",
                 listener: twin_learning.Listener | None = None) -> None:  # fmt: skip
        self.controller = controller
        self.switch = switch
        self.job = job
        self.options = options
        self.listen = listen
        self.mac = mac
        self.k = k
        self.forward = forward  # the no-op forwarder: no counters, the document stays zero
        self.profile = profile
        self.listener = listener  # the twin's: members learned from digests
        self.started = time.time()
        self._stop = False
        self._stats_requested = False

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGUSR1, self._on_stats)
        if self.listener is not None:
            self.listener.start()
        self.write_stats()
        cfg = self.switch.config
        program = (f"no-op forwarder p4/{toolchain.ECHO}" if self.forward else
                   f"P4 program p4/{toolchain.PROFILES[self.profile]} K={self.k}, "
                   f"generation {self.job.generation}")  # fmt: skip
        details = (
            f"switch pid {self.switch.process.pid if self.switch.process else '?'} "
            f"(device {cfg.device_id}, grpc {cfg.grpc_address}, thrift {cfg.thrift_port}, "
            f"log {cfg.log_path}), {program}, "
            f"pid {os.getpid()}, iface {self.options.iface} mac {self.mac}, "
            f"{self.job.config.describe()}"
        )
        print(ready_line(self.listen, NAME, details), file=sys.stderr, flush=True)
        next_write = time.monotonic() + self.options.serving.stats_interval
        periodic = self.options.serving.stats is not None or metrics.serving()
        while not self._stop:
            time.sleep(0.02)
            if self.switch.process is not None and self.switch.process.poll() is not None:
                print(f"ncina aggregator: the switch exited with status "
                      f"{self.switch.process.returncode} (log {cfg.log_path})",
                      file=sys.stderr, flush=True)  # fmt: skip
                return 1
            if self.listener is not None and self.listener.error is not None:
                print(f"ncina aggregator: learning members failed: {self.listener.error}",
                      file=sys.stderr, flush=True)  # fmt: skip
                return 1
            now = time.monotonic()
            requested = self._stats_requested
            if requested or (periodic and now >= next_write):
                self._stats_requested = False
                next_write = now + self.options.serving.stats_interval
                self.write_stats(periodic=not requested)
        if self.listener is not None:  # the job goes: its learned members are forgotten
            self.listener.stop()
        self.write_stats()
        return 0

    def _on_stop(self, signum: int, frame: Any) -> None:
        self._stop = True

    def _on_stats(self, signum: int, frame: Any) -> None:
        self._stats_requested = True

    def stats_document(self) -> dict[str, Any]:
        # Stamped before the read: a P4Runtime round trip (tens of ms under load), so a
        # document stamped after it could hold counts older than its time.
        taken = time.time()
        if self.forward:
            return snapshot(backend=NAME, started=self.started, global_stats=GlobalStats(),
                            jobs={self.job.config.job: JobStats()}, taken=taken)  # fmt: skip
        if self.profile == "tofino":  # the twin: one counter per event kind, no transport section
            counts = self.controller.read_counters(
                [twin_events.GLOBAL_COUNTER, *twin_events.JOB_COUNTERS])
            document = snapshot(
                backend=NAME,
                started=self.started,
                global_stats=entries.global_stats(counts[twin_events.GLOBAL_COUNTER]),
                jobs={self.job.config.job: entries.job_stats(
                    self.job, twin_events.job_counts(counts))},
                taken=taken,
            )  # fmt: skip
            if self.listener is not None:
                document["learning"] = self.listener.learning.to_json()
            return document
        counts = self.controller.read_counters(
            [entries.GLOBAL_COUNTER, entries.JOB_COUNTER, entries.TRANSPORT_COUNTER])
        document = snapshot(
            backend=NAME,
            started=self.started,
            global_stats=entries.global_stats(counts[entries.GLOBAL_COUNTER]),
            jobs={self.job.config.job: entries.job_stats(self.job, counts[entries.JOB_COUNTER])},
            taken=taken,
        )  # fmt: skip
        document[NAME] = entries.transport_stats(counts[entries.TRANSPORT_COUNTER])
        return document

    def write_stats(self, periodic: bool = False) -> None:
        publish(self.stats_document(), self.options.serving.stats, sys.stderr, periodic=periodic)
