"""Drive the C data plane: EAL and its port (a vdev on an interface, or a NIC by PCI address)
around the slot engine.

The burst loop (``ncd_run``) runs in a thread of ``ncina.aggregator.engine.backend.
EngineBackend``, which keeps the backend contract (readiness, stats, signals); this module adds
EAL, the port and its counters (the stats document's ``dpdk`` section).
"""

from __future__ import annotations

import argparse
import ipaddress
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, TextIO

import numpy as np
from ncina.aggregator import hierarchy
from ncina.aggregator.backends import Serving
from ncina.aggregator.backends.dpdk.eal import (
    HUGEPAGE_MODES,
    MAX_LCORES,
    PMDS,
    Memory,
    check_lcores,
    check_pci_port,
    check_queues,
    choose_memory,
    eal_arguments,
    pci_address,
)
from ncina.aggregator.control import JobsDirectory
from ncina.aggregator.engine import Engine
from ncina.aggregator.engine.backend import EngineBackend
from ncina.aggregator.hierarchy import LeafAggregator, check_int_frame_room
from ncina.aggregator.jobs import JobConfig
from ncina.proto.header import Format

from ncina.common.address import Address

NAME = "dpdk"
IO_COUNTERS = (
    "rx_frames", "ignored", "arp_replies", "tx_frames", "tx_dropped", "no_mbuf", "oversize",
    "loops", "bad_checksum", "fragments", "reassembled", "uplink_frames", "uplink_no_mac",
    "arp_requests", "spine_mac_learned", "handoffs", "handoff_full", "handed_in", "parks",
)  # fmt: skip
DEFAULT_IDLE_SLEEP_US = 20
MODES = {"aggregate": 0, "forward": 1}


class DataPlane(Engine):
    """The process's one C data plane (EAL can start once per process): the engine's control
    plane and the DPDK port's."""

    def __init__(self, module: ModuleType) -> None:
        super().__init__(module)
        self._keepalive: list[Any] = []
        self.set_reply_room(int(self.lib.ncd_dgram_room()), self.room_limit)

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

    def set_strands(self, strands: int) -> None:
        """Run ``strands`` data-plane strands (``--lcores``; before ``init``): one RX/TX queue pair
        and one lcore each, strand i owning the slots s with s % strands == i."""
        self.check(self.lib.ncd_set_strands(strands), f"{strands} strands")

    def io_counters(self, strand: int | None = None) -> dict[str, int]:
        """The port's counters (``IO_COUNTERS``), summed over the strands, or strand
        ``strand``'s."""
        c = self.ffi.new("struct ncd_io *")
        if strand is None:
            self.lib.ncd_io_stats(c)
        elif self.lib.ncd_strand_io_stats(strand, c) != 0:
            raise ValueError(f"no strand {strand}: the data plane runs {self.lib.ncd_strands()}")
        return {name: getattr(c, name) for name in IO_COUNTERS}

    def set_address(self, listen: Address) -> None:
        """The aggregator's IPv4 address (0.0.0.0: any) and UDP port."""
        host, port = listen
        if not 0 < port <= 0xFFFF:
            raise ValueError(f"the dpdk backend needs a fixed UDP port, not {port}")
        self.lib.ncd_set_address(ipaddress.IPv4Address(host).packed, port)

    def set_spine(self, spine: Address | None) -> None:
        """A leaf's spine (``--upstream``): where its datagrams go, to the MAC the data plane
        resolves by ARP on its port; None: no spine (forgets a learned MAC)."""
        host, port = spine if spine is not None else ("0.0.0.0", 0)
        self.lib.ncd_set_spine(ipaddress.IPv4Address(host).packed, port)

    @property
    def spine_mac(self) -> str | None:
        """The spine's MAC as learned (``aa:bb:...``), or None while it is not known."""
        buf = self.ffi.new("uint8_t[6]")
        if not self.lib.ncd_spine_mac(buf):
            return None
        return ":".join(f"{b:02x}" for b in bytes(buf))

    def reset(self) -> None:
        """Remove every job and zero every counter, the port's too (tests)."""
        self.lib.nce_reset()
        self.lib.ncd_io_reset()

    @property
    def frame_room(self) -> int:
        """Bytes of the largest frame the data plane can send (an mbuf's data room)."""
        return int(self.lib.ncd_frame_room())

    @property
    def room_limit(self) -> str:
        """What ``frame_room`` is, for the messages that refuse a job."""
        return f"the {self.frame_room}-byte mbuf data room of the DPDK data plane"

    def add_job(self, config: JobConfig) -> np.random.Generator:
        """Install a job (``Engine.add_job``), after checking that its result frames fit
        ``frame_room``: raises ``ValueError`` naming the largest K, before anything is installed
        (the engine refuses such a job as well)."""
        config.check_frame_room(self.frame_room, self.room_limit)
        if config.uplink_format == Format.INT:  # a spine: its leaves' int partial sums
            check_int_frame_room(config, self.frame_room, self.room_limit)
        return super().add_job(config)


class PortLink:
    """``hierarchy.SpineLink`` over the data plane's port before its loop runs: a leaf's job
    handshake (``ncd_spine_send``: a hello before the spine's MAC is known sends an ARP request
    instead; ``ncd_spine_receive`` answers ARP and learns the spine's MAC meanwhile)."""

    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane
        self._buf = plane.ffi.new(f"uint8_t[{plane.frame_room}]")
        self._ip = plane.ffi.new("uint32_t *")
        self._port = plane.ffi.new("uint16_t *")

    def send(self, datagram: bytes) -> None:
        if self.plane.lib.ncd_spine_send(datagram, len(datagram)) < 0:
            reason = self.plane.ffi.string(self.plane.lib.nce_error()).decode(errors="replace")
            raise RuntimeError(f"sending to the spine: {reason}")

    def receive(self, timeout: float) -> tuple[bytes, Address] | None:
        size = self.plane.lib.ncd_spine_receive(self._buf, len(self._buf), self._ip, self._port,
                                                int(timeout * 1e6))  # fmt: skip
        if size <= 0:  # none, or larger than a frame: no answer of a spine
            return None
        source = str(ipaddress.IPv4Address(bytes(self.plane.ffi.buffer(self._ip))))
        return bytes(self.plane.ffi.buffer(self._buf, size)), (source, int(self._port[0]))


class DpdkBackend(EngineBackend):
    """Serve jobs with the C data plane on one port (the ``EngineBackend`` contract): the
    interface ``iface`` through a vdev of ``pmd``, or the NIC at PCI address ``pci``; in
    hugepages or not as ``memory`` says (``eal.choose_memory``).

    ``lcores`` strands (``--lcores``) serve the port, each on its own lcore and RX/TX queue pair.
    ``mode="forward"`` runs the no-op forwarder instead (benchmarks).

    With ``leaf`` (``hierarchy.LeafAggregator`` of the one job of ``configs``) the job is a leaf
    of a spine on the port's link (docs/protocol.md "Hierarchical aggregation", docs/dpdk.md):
    ``listen`` must name the leaf's own address; before serving, the data plane resolves the
    spine's MAC by ARP and does the spine's job handshake over the port (``PortLink``); then
    the engine sends complete slots' sums up in frames to that MAC and takes the spine's results.
    """

    name = NAME

    def __init__(
        self,
        configs: Sequence[JobConfig],
        listen: Address,
        *,
        iface: str | None = None,
        pci: str | None = None,
        memory: Memory,
        eal_extra: Sequence[str] = (),
        vdev_options: str = "",
        pmd: str = "af_packet",
        lcores: int = 1,
        stats_path: Path | None = None,
        stats_interval: float = 1.0,
        idle_sleep_us: int = DEFAULT_IDLE_SLEEP_US,
        mode: str = "aggregate",
        generation: int = 0,
        log: TextIO = sys.stderr,
        control: JobsDirectory | None = None,
        leaf: LeafAggregator | None = None,
    ) -> None:
        from ncina.aggregator.backends.dpdk.binding import load

        check_lcores(lcores)
        if leaf is not None and lcores > 1:
            raise ValueError(
                f"a dpdk leaf (--upstream) serves on one lcore, not --lcores {lcores}: its link "
                "to the spine (ARP, uplinks, the engine's upstream state) is one strand's"
            )
        if iface is not None:
            check_queues(iface, pmd, lcores)
        plane = DataPlane(load())
        super().__init__(plane, configs, stats_path=stats_path, stats_interval=stats_interval,
                         generation=generation, log=log, control=control)  # fmt: skip
        self.plane: DataPlane = plane
        self.port = f"PCI {pci}" if pci is not None else f"iface {iface} ({pmd})"
        self.memory = memory
        self.address = listen
        self.idle_sleep_us = idle_sleep_us
        self.mode = MODES[mode]
        self.lcores = lcores
        if leaf is not None:
            assert leaf.leaf is not None
            if listen[0] == "0.0.0.0":
                raise ValueError(
                    "a dpdk leaf (--upstream) needs --listen with its own IPv4 address: its "
                    "partial sums and ARP requests come from it, the spine's results go to it"
                )
            check_int_frame_room(leaf.leaf.config, plane.frame_room, plane.room_limit)
        self.leaf = leaf
        plane.set_address(listen)
        plane.set_spine(None if leaf is None else leaf.upstream.address)
        plane.set_strands(lcores)
        # Jobs first: one the data plane cannot serve is refused before EAL takes the port.
        self.install_jobs()
        plane.init(eal_arguments(iface=iface, pci=pci, memory=memory, extra=eal_extra,
                                 vdev_options=vdev_options, pmd=pmd, lcores=lcores))  # fmt: skip

    def prepare(self) -> None:
        """A leaf: the spine's job handshake over the port (``EngineBackend.join_spine``)."""
        if self.leaf is not None:
            self.join_spine(PortLink(self.plane))

    def loop(self) -> int:
        return int(self.plane.lib.ncd_run(self.mode, self.idle_sleep_us))

    def stop_loop(self) -> None:
        self.plane.lib.ncd_stop()

    def close(self) -> None:
        self.plane.lib.ncd_close()

    def details(self) -> str:
        mode = "no-op forwarder" if self.mode else f"aggregator, generation {self.generation}"
        strands = f"{self.lcores} lcores" if self.lcores > 1 else "1 lcore"
        details = (f"{mode}, {self.port} mac {self.plane.mac}, {strands}, "
                   f"memory: {self.memory.reason}")
        if self.leaf is not None:
            host, port = self.leaf.upstream.address
            details += f", leaf of spine {host}:{port} (its MAC {self.plane.spine_mac})"
        return details

    def io_stats(self) -> tuple[int, dict[str, Any]]:
        """The port's counters summed over the strands, and each strand's under ``strands``."""
        io: dict[str, Any] = self.plane.io_counters()
        failures = io["tx_dropped"] + io["no_mbuf"] + io["oversize"]
        io["strands"] = [self.plane.io_counters(strand) for strand in range(self.lcores)]
        return failures, io


def _pci(text: str) -> str:
    try:
        return pci_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@dataclass(frozen=True)
class DpdkOptions:
    """The dpdk backend's options (``ncina.aggregator.backends``' contract)."""

    serving: Serving
    iface: str | None
    """``--iface``: the interface the data plane serves (or ``pci``)."""
    pci: str | None
    """``--pci``: the NIC's PCI address (or ``iface``)."""
    hugepages: str
    """``--hugepages``: auto, on or off."""
    eal_args: list[str]
    """``--eal-arg``: extra EAL arguments."""
    vdev_options: str
    """``--vdev-options``: extra options of the ``pmd`` driver."""
    pmd: str
    """``--dpdk-pmd``: af_packet or af_xdp."""
    lcores: int
    """``--lcores``: data-plane strands, one per lcore and queue pair."""
    idle_sleep_us: int
    """``--idle-sleep-us``: the idle loop's sleep between polls."""
    mode: str
    """``--dpdk-mode``: aggregate, or forward (the no-op forwarder)."""


def add_arguments(parser: Any) -> list[Any]:
    """The ``ncina aggregator`` options of the dpdk backend, as their argument group."""
    group = parser.add_argument_group("dpdk backend")
    group.add_argument(
        "--eal-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="dpdk: an extra EAL argument, passed through (repeatable, e.g. --eal-arg=-m256)",
    )
    group.add_argument(
        "--pci",
        type=_pci,
        metavar="ADDRESS",
        help="dpdk: serve the NIC at this PCI address (dddd:bb:dd.f, bound to vfio-pci) instead "
        "of --iface; EAL probes only this device",
    )
    group.add_argument(
        "--hugepages",
        choices=HUGEPAGE_MODES,
        default="auto",
        help="dpdk: auto uses hugepages when 128 MB of them are free, else runs --no-huge (the "
        "start line says which); on requires them; off never uses them "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--dpdk-pmd",
        choices=tuple(PMDS),
        default="af_packet",
        help="dpdk: how the data plane attaches to --iface: af_packet (a packet socket) or "
        "af_xdp (an AF_XDP socket on queue 0, or 0..N-1 with --lcores N, frames taken at the "
        "XDP hook) (default: %(default)s)",
    )
    group.add_argument(
        "--vdev-options",
        default="",
        metavar="K=V,...",
        help="dpdk: extra options of the --dpdk-pmd driver (e.g. af_packet's "
        "framecnt=4096,qdisc_bypass=1)",
    )
    group.add_argument(
        "--lcores",
        type=int,
        default=1,
        metavar="N",
        help=f"dpdk: run N strands (1..{MAX_LCORES}, at most the CPUs this process may use), each "
        "on its own lcore and RX/TX queue pair (af_packet: qpairs=N, spread by flow hash; "
        "af_xdp: the interface's first N combined channels; --pci: RSS); strand i owns the "
        "slots s with s %% N == i, frames of others' slots are handed over "
        "(default: %(default)s)",
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
    return [group]


def options(args: Any, serving: Serving) -> DpdkOptions:
    """The dpdk backend's options of the parsed command line ``args``."""
    return DpdkOptions(
        serving,
        iface=args.iface or None,
        pci=args.pci,
        hugepages=args.hugepages,
        eal_args=args.eal_arg,
        vdev_options=args.vdev_options,
        pmd=args.dpdk_pmd,
        lcores=args.lcores,
        idle_sleep_us=args.idle_sleep_us,
        mode=args.dpdk_mode,
    )


def serve(config: JobConfig, options: DpdkOptions) -> int:
    """Run the dpdk backend for ``config`` until SIGTERM/SIGINT."""
    serving = options.serving
    if serving.tree is not None:  # a spine's leaves' int frames, or the leaf's own
        hierarchy.check_int_frames(config, serving.tree.mtu)
    if bool(options.iface) == bool(options.pci):
        raise ValueError(
            "the dpdk backend serves one port: give --iface IF (an interface, through "
            "--dpdk-pmd) or --pci ADDRESS (a NIC bound to vfio-pci)"
        )
    if options.pci:
        check_pci_port(options.pci)
    backend = DpdkBackend(
        [config],
        serving.listen,
        iface=options.iface,
        pci=options.pci,
        memory=choose_memory(options.hugepages),
        eal_extra=options.eal_args,
        vdev_options=options.vdev_options,
        pmd=options.pmd,
        lcores=options.lcores,
        stats_path=serving.stats,
        stats_interval=serving.stats_interval,
        idle_sleep_us=options.idle_sleep_us,
        mode=options.mode,
        generation=serving.generation,
        control=serving.control,
        leaf=hierarchy.make_leaf(config, serving.tree, serving.generation),
    )
    backend.plane.set_restart_idle(serving.restart_idle)
    return backend.run()
