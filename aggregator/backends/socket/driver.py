"""Drive the socket data plane: one kernel UDP socket around the slot engine.

The loop (``ncs_run``: ``recvmmsg`` batches in, the engine per datagram, ``sendmmsg`` batches out)
runs in a thread of ``ncina.aggregator.engine.backend.EngineBackend``, which keeps the backend
contract (readiness, stats, signals); this module opens the socket and adds its counters (the
stats document's ``socket`` section). No root, no DPDK: any process with a UDP port can serve.
"""

from __future__ import annotations

import ipaddress
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from ncina.aggregator import hierarchy
from ncina.aggregator.backends import Serving
from ncina.aggregator.control import JobsDirectory
from ncina.aggregator.engine import Engine
from ncina.aggregator.engine.backend import EngineBackend
from ncina.aggregator.hierarchy import LeafAggregator
from ncina.aggregator.jobs import JobConfig

from ncina.common.address import Address

NAME = "socket"
IO_COUNTERS = (
    "rx_datagrams",
    "rx_batches",
    "tx_datagrams",
    "tx_batches",
    "send_errors",
    "oversized",
    "wakeups",
    "rx_buffers",
    "rx_coalesced",
    "tx_gso_sends",
    "gso_fallbacks",
)
FLAGS = ("gro", "gso")
MODES = {"aggregate": 0, "forward": 1}


class SocketBackend(EngineBackend):
    """Serve jobs with the C engine on a UDP socket bound to ``listen`` (port 0: a free one,
    reported in the readiness line); the ``EngineBackend`` contract.

    ``mode="forward"`` runs the no-op forwarder instead (every datagram back to its sender: the
    limit of this I/O path, for benchmarks).

    With ``leaf`` (``hierarchy.LeafAggregator`` of the one job of ``configs``) the job is a leaf
    of a spine (docs/protocol.md "Hierarchical aggregation"): before serving, ``leaf.join`` does
    the spine's job handshake on this socket; then the engine sends complete slots' sums up and
    the spine's results down (``aggregator/engine/upstream.c``).
    """

    name = NAME

    def __init__(
        self,
        configs: Sequence[JobConfig],
        listen: Address,
        *,
        stats_path: Path | None = None,
        stats_interval: float = 1.0,
        mode: str = "aggregate",
        generation: int = 0,
        log: TextIO = sys.stderr,
        control: JobsDirectory | None = None,
        leaf: LeafAggregator | None = None,
    ) -> None:
        from ncina.aggregator.backends.socket.binding import load

        plane = Engine(load())
        room = int(plane.lib.ncs_dgram_room())
        plane.set_reply_room(room, f"the {room}-byte send buffer of the socket data plane")
        super().__init__(plane, configs, stats_path=stats_path, stats_interval=stats_interval,
                         generation=generation, log=log, control=control)  # fmt: skip
        self.mode = MODES[mode]
        host, port = listen
        bound = plane.lib.ncs_open(ipaddress.IPv4Address(host).packed, port)
        if bound < 0:
            raise OSError(plane.ffi.string(plane.lib.nce_error()).decode(errors="replace"))
        self.address = (host, bound)
        self.leaf = leaf
        try:
            if leaf is not None:
                assert leaf.leaf is not None
                hierarchy.check_int_frame_room(leaf.leaf.config, room, f"the {room}-byte send "
                                               "buffer of the socket data plane")  # fmt: skip
            self.install_jobs()
        except BaseException:
            plane.lib.ncs_close()
            raise

    def prepare(self) -> None:
        """A leaf: the spine's job handshake on a duplicate of the data plane's socket
        (``EngineBackend.join_spine``)."""
        import os
        import socket

        if self.leaf is not None:
            with socket.socket(fileno=os.dup(self.plane.lib.ncs_fileno())) as sock:
                self.join_spine(sock)

    def loop(self) -> int:
        return int(self.plane.lib.ncs_run(self.mode))

    def stop_loop(self) -> None:
        self.plane.lib.ncs_stop()

    def close(self) -> None:
        self.plane.lib.ncs_close()

    def details(self) -> str:
        _, io = self.io_stats()
        offloads = ", ".join(f"UDP {flag.upper()} {'on' if io[flag] else 'off'}" for flag in FLAGS)
        if self.mode:
            return f"no-op forwarder, {offloads}"
        return f"aggregator, generation {self.generation}, {offloads}"

    def io_stats(self) -> tuple[int, dict[str, int]]:
        c = self.plane.ffi.new("struct ncs_io *")
        self.plane.lib.ncs_io_stats(c)
        io: dict[str, int] = {name: getattr(c, name) for name in IO_COUNTERS}
        io.update({flag: bool(getattr(c, flag)) for flag in FLAGS})
        return io["send_errors"] + io["oversized"], io


@dataclass(frozen=True)
class SocketOptions:
    """The socket backend's options (``ncina.aggregator.backends``' contract)."""

    serving: Serving
    mode: str
    """``--socket-mode``: aggregate, or forward (the no-op forwarder)."""


def add_arguments(parser: Any) -> list[Any]:
    """The ``ncina aggregator`` options of the socket backend, as their argument group."""
    group = parser.add_argument_group("socket backend")
    group.add_argument(
        "--socket-mode",
        choices=tuple(MODES),
        default="aggregate",
        help="socket: aggregate, or forward (the no-op forwarder that echoes every datagram: "
        "the limit of the socket I/O path, for benchmarks) (default: %(default)s)",
    )
    return [group]


def options(args: Any, serving: Serving) -> SocketOptions:
    """The socket backend's options of the parsed command line ``args``."""
    return SocketOptions(serving, mode=args.socket_mode)


def serve(config: JobConfig, options: SocketOptions) -> int:
    """Run the socket backend for ``config`` until SIGTERM/SIGINT."""
    serving = options.serving
    if serving.tree is not None:  # a spine's leaves' int frames, or the leaf's own
        hierarchy.check_int_frames(config, serving.tree.mtu)
    backend = SocketBackend(
        [config],
        serving.listen,
        stats_path=serving.stats,
        stats_interval=serving.stats_interval,
        mode=options.mode,
        generation=serving.generation,
        control=serving.control,
        leaf=hierarchy.make_leaf(config, serving.tree, serving.generation),
    )
    backend.plane.set_restart_idle(serving.restart_idle)
    return backend.run()
