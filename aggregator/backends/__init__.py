"""The aggregator's backends, one folder each, behind one registry (docs/architecture.md).

``BACKENDS`` is the list of backends everywhere: ``ncina aggregator --backend`` is a lookup in
it (``get``), and the benchmarks, the topology runner and the tests read their lists from it
(``names``, with what a backend can do). Each row names its backend's driver module, which
holds the contract:

- ``add_arguments(parser) -> list[group]``: the backend's own options, as argument groups (an
  option of a group of another backend than the one chosen is refused);
- ``options(args, serving) -> Options``: those options read back into a typed options object
  (a frozen dataclass of the backend's) holding ``serving``;
- ``serve(config, options) -> int``: serve the job ``config`` (``ncina.aggregator.jobs.
  JobConfig``: the ``JobSpec`` of the command line with its members and seed) until
  SIGTERM/SIGINT.

``Serving`` is what every backend serves with, read from the options the command shares.
The Tofino program's folder (``tofino/``) is no row: its twin runs on the bmv2 backend
(``--p4-profile tofino``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ncina.aggregator.control import JobsDirectory
    from ncina.aggregator.hierarchy import Tree
    from ncina.proto.compressors.base import Compressor

    from ncina.common.address import Address


@dataclass(frozen=True)
class Backend:
    """One backend: its name, its driver module and what it can do."""

    name: str
    driver: str
    """The module with ``add_arguments``, ``options`` and ``serve``."""
    summary: str
    """What it is, in a few words (``--backend``'s help)."""
    kernel_sockets: bool
    """It serves on the host's kernel UDP sockets: no root, any network namespace, and the
    links' checksum offloads apply (else it takes a port of its own: a DPDK port, a switch)."""
    switch: bool
    """It is a switch, which serves Mininet's topologies only (no host benchmark drives it)."""
    keyed: bool
    """It serves jobs with a key (the authentication tag, docs/protocol.md)."""
    jobs_dir: bool
    """It adds and removes jobs from ``--jobs-dir`` while it runs."""
    server_mode: bool
    """It serves ``--mode server`` (compressed payloads summed in float)."""

    def load(self) -> ModuleType:
        """The driver module (imported on first use: ``--help`` needs every one's options,
        a run only the chosen one's)."""
        return importlib.import_module(self.driver)


BACKENDS: tuple[Backend, ...] = (
    Backend("python", "ncina.aggregator.backends.python.driver", "reference",
            kernel_sockets=True, switch=False, keyed=True, jobs_dir=True, server_mode=True),
    Backend("socket", "ncina.aggregator.backends.socket.driver",
            "C engine, kernel UDP socket, no root",
            kernel_sockets=True, switch=False, keyed=True, jobs_dir=True, server_mode=False),
    Backend("dpdk", "ncina.aggregator.backends.dpdk.driver", "C engine on a DPDK port",
            kernel_sockets=False, switch=False, keyed=True, jobs_dir=True, server_mode=False),
    Backend("bmv2", "ncina.aggregator.backends.bmv2.driver", "P4 switch",
            kernel_sockets=False, switch=True, keyed=False, jobs_dir=False, server_mode=False),
)  # fmt: skip


def names(**capabilities: bool) -> tuple[str, ...]:
    """The names of the backends, in ``BACKENDS``' order, that have every one of
    ``capabilities`` as given (``names(keyed=True)``: those that serve keyed jobs)."""
    return tuple(
        b.name for b in BACKENDS
        if all(getattr(b, field) == value for field, value in capabilities.items())
    )  # fmt: skip


def get(name: str) -> Backend:
    """The backend called ``name`` (``KeyError`` naming the available ones otherwise)."""
    for backend in BACKENDS:
        if backend.name == name:
            return backend
    raise KeyError(f"{name} is not a backend (available: {', '.join(names())})")


@dataclass(frozen=True)
class Serving:
    """What every backend serves with, from ``ncina aggregator``'s shared options."""

    listen: Address
    """``--listen``: the IPv4 address and UDP port to serve (port 0: a free one)."""
    generation: int
    """This start's generation, stamped on every result (``--generation``, else random)."""
    stats: Path | None
    """``--stats``: the file the stats document is written to, or None (stderr)."""
    stats_interval: float
    """``--stats-interval``: seconds between two writes of the stats file."""
    restart_idle: float
    """``--restart-idle``: how long a job must be quiet before a hello restarts it."""
    control: JobsDirectory | None
    """``--jobs-dir``: jobs added and removed while the backend runs, or None."""
    tree: Tree | None
    """Two-level aggregation (``--upstream``, ``--uplink int``), or None for a one-level job."""
    compressor: Compressor | None
    """Server mode's compressor (``--mode server``), or None in INA mode."""
