"""The EAL command line of the dpdk backend: which port (a veth through a vdev, or a NIC by PCI
address) and which memory (hugepages when the machine has them, else ``--no-huge``).

Everything here is decided before EAL starts, from /sys and /proc, so that a port or a memory
setting that cannot work is refused with a sentence that says what to do, instead of an EAL
error from deep inside ``rte_eal_init``.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

# The poll-mode drivers that attach the data plane to a Linux interface (Debian's DPDK ships
# both), and the options each gets by default for `strands` queue pairs (``--lcores``): af_packet
# is a packet socket per queue (qpairs, one fanout group: the kernel spreads the frames by flow
# hash); af_xdp an AF_XDP socket on each of the interface's queues 0..strands-1 (the kernel hands
# them the frames from its XDP hook; the interface's own RSS spreads them).
PMDS = {"af_packet": "qpairs={strands}", "af_xdp": "start_queue=0,queue_count={strands}"}
# The most strands (lcores, each with its RX/TX queue pair) a data plane runs (NCE_MAX_STRANDS).
MAX_LCORES = 8
# Memory EAL reserves for the mbuf pool, the TX buffer and the reassembly table (MB).
MEMORY_MB = 128
HUGEPAGE_MODES = ("auto", "on", "off")
# Kernel drivers a PCI NIC must be bound to for DPDK to take it over (docs/dpdk.md), and those
# whose PMD runs beside the kernel driver (Mellanox: no rebinding).
USERSPACE_PCI_DRIVERS = ("vfio-pci", "uio_pci_generic", "igb_uio")
BIFURCATED_PCI_DRIVERS = ("mlx5_core", "mlx4_core")
_PCI = re.compile(r"(?:([0-9a-f]{4}):)?([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])")
SYS_PCI = Path("/sys/bus/pci/devices")
SYS_HUGEPAGES = Path("/sys/kernel/mm/hugepages")


def pci_address(text: str) -> str:
    """``text`` as a full PCI address ``dddd:bb:dd.f`` (domain 0000 when left out); raises
    ``ValueError`` for anything else."""
    m = _PCI.fullmatch(text.strip().lower())
    if m is None:
        raise ValueError(f"{text!r} is not a PCI address (expected dddd:bb:dd.f or bb:dd.f, "
                         "as lspci -D prints it)")  # fmt: skip
    domain, bus, device, function = m.groups()
    return f"{domain or '0000'}:{bus}:{device}.{function}"


def check_pci_port(address: str, sys_pci: Path = SYS_PCI) -> str:
    """The kernel driver of the NIC at ``address`` (a full address), after checking that DPDK
    can take it: raises ``ValueError`` saying how to bind it when it cannot."""
    device = sys_pci / address
    if not device.exists():
        raise ValueError(f"--pci {address}: no such PCI device (lspci -D lists the machine's)")
    driver_link = device / "driver"
    driver = driver_link.resolve().name if driver_link.exists() else ""
    if driver in USERSPACE_PCI_DRIVERS or driver in BIFURCATED_PCI_DRIVERS:
        return driver
    bound = f"is bound to the kernel driver {driver!r}" if driver else "has no driver bound"
    raise ValueError(
        f"--pci {address} {bound}: DPDK needs it bound to vfio-pci first "
        f"(modprobe vfio-pci; dpdk-devbind.py --bind=vfio-pci {address}; docs/dpdk.md)"
    )


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on, in order."""
    return sorted(os.sched_getaffinity(0))


def check_lcores(lcores: int, cpus: Sequence[int] | None = None) -> None:
    """Raise ``ValueError`` unless ``lcores`` strands can run: 1 to ``MAX_LCORES``, and no more
    than the CPUs this process may use (``cpus``, by default its affinity): a polling strand
    that shares a CPU with another only takes turns with it."""
    cpus = allowed_cpus() if cpus is None else cpus
    if not 1 <= lcores <= MAX_LCORES:
        raise ValueError(f"--lcores {lcores}: the dpdk data plane runs 1 to {MAX_LCORES} lcores")
    if lcores > len(cpus):
        raise ValueError(f"--lcores {lcores}: this process may use {len(cpus)} CPU"
                         f"{'s' if len(cpus) != 1 else ''} ({','.join(map(str, cpus))}), "
                         f"so at most --lcores {len(cpus)}")  # fmt: skip


def combined_channels(ethtool_l: str) -> int:
    """The current combined channels (RX/TX queue pairs) in the output of ``ethtool -l IF``: what
    DPDK's af_xdp driver binds its queues to. An interface without combined channels (``n/a``,
    as a veth's: separate RX and TX channels) counts as one, as the driver counts it."""
    current = ethtool_l.partition("Current hardware settings:")[2]
    for line in current.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "Combined":
            return int(value) if value.strip().isdigit() else 1
    return 1


def _ethtool_channels(iface: str) -> str | None:
    try:
        proc = subprocess.run(["ethtool", "-l", iface], capture_output=True, text=True,
                              check=False)  # fmt: skip
    except FileNotFoundError:
        return None
    return proc.stdout if proc.returncode == 0 else None


def check_queues(
    iface: str, pmd: str, lcores: int, channels: Callable[[str], str | None] = _ethtool_channels
) -> None:
    """Raise ``ValueError`` when ``pmd`` cannot give ``lcores`` queue pairs on ``iface``:
    af_xdp binds an AF_XDP socket to each of the interface's first ``lcores`` combined
    channels (``channels``: ``ethtool -l`` output, None where it cannot tell: DPDK's own error
    then); af_packet makes its queues itself."""
    if pmd != "af_xdp" or lcores == 1:
        return
    text = channels(iface)
    if text is None:
        return
    have = combined_channels(text)
    if have < lcores:
        raise ValueError(
            f"--lcores {lcores} with --dpdk-pmd af_xdp needs {lcores} combined channels on "
            f"{iface}, it has {have} (a NIC: ethtool -L {iface} combined {lcores}; a veth has "
            "none, its RX and TX channels are separate); or use --dpdk-pmd af_packet"
        )


@dataclass(frozen=True)
class Memory:
    """How EAL gets its memory: ``hugepages`` or not, and why (printed at start)."""

    hugepages: bool
    reason: str


def free_hugepage_mb(sys_hugepages: Path = SYS_HUGEPAGES) -> int:
    """MB of hugepages over every page size that are free and not reserved by another process's
    mapping (what EAL counts as available)."""
    total_kb = 0
    for size_dir in sys_hugepages.glob("hugepages-*kB"):
        size_kb = int(size_dir.name.removeprefix("hugepages-").removesuffix("kB"))
        reserved = size_dir / "resv_hugepages"
        pages = int((size_dir / "free_hugepages").read_text()) - (
            int(reserved.read_text()) if reserved.exists() else 0
        )
        total_kb += size_kb * max(pages, 0)
    return total_kb // 1024


def choose_memory(mode: str, sys_hugepages: Path = SYS_HUGEPAGES) -> Memory:
    """Hugepages for ``mode`` ``auto`` (when ``MEMORY_MB`` of them are free), ``on`` (raises
    ``ValueError`` when they are not) or ``off``.

    No hugetlbfs mount is needed: with ``--in-memory`` EAL maps them through memfd.
    """
    if mode not in HUGEPAGE_MODES:
        raise ValueError(f"--hugepages must be one of {', '.join(HUGEPAGE_MODES)}, not {mode!r}")
    if mode == "off":
        return Memory(False, "--hugepages off: --no-huge (anonymous memory)")
    free = free_hugepage_mb(sys_hugepages) if sys_hugepages.exists() else 0
    if free >= MEMORY_MB:
        return Memory(True, f"hugepages ({free} MB free)")
    missing = f"{free} MB of free hugepages, {MEMORY_MB} MB needed"
    if mode == "on":
        raise ValueError(f"--hugepages on: {missing} (reserve them with "
                         "sysctl vm.nr_hugepages=N; docs/dpdk.md)")  # fmt: skip
    return Memory(False, f"--no-huge fallback: {missing}")


def eal_arguments(
    *,
    iface: str | None = None,
    pci: str | None = None,
    memory: Memory,
    extra: Sequence[str] = (),
    vdev_options: str = "",
    pmd: str = "af_packet",
    lcores: int = 1,
) -> list[str]:
    """The EAL command line for one port: the NIC at PCI address ``pci`` (only that one is
    probed), or else a vdev of ``pmd`` (``PMDS``) on ``iface`` with ``vdev_options`` added to
    the PMD's defaults (for ``lcores`` queue pairs) and no PCI probing.

    Without hugepages, ``--no-shconf`` and a per-process ``--file-prefix`` let several data
    planes run at once (``--in-memory`` would, but it is incompatible with ``--no-huge``); with
    hugepages, ``--in-memory`` does that and leaves no hugepage files behind. The ``lcores``
    lcores 0..lcores-1 (strand i on lcore i; 0 is the main one) may each run on any CPU this
    process may use (EAL would otherwise pin each to one).
    """
    if (iface is None) == (pci is None):
        raise ValueError("the dpdk backend serves one port: give --iface IF or --pci ADDRESS")
    cpus = ",".join(str(c) for c in allowed_cpus())
    strands = "0" if lcores == 1 else f"(0-{lcores - 1})"
    if memory.hugepages:
        mem = ["--in-memory"]
    else:
        mem = ["--no-huge", "--no-shconf", f"--file-prefix=ncd{os.getpid()}"]
    if pci is not None:
        port = [f"--allow={pci}"]
    else:
        options = ",".join(o for o in (PMDS[pmd].format(strands=lcores), vdev_options) if o)
        port = ["--no-pci", f"--vdev=net_{pmd}0,iface={iface}" + (f",{options}" if options else "")]
    return [
        "ncina-dpdk",
        *mem,
        "-m",
        str(MEMORY_MB),
        f"--lcores={strands}@({cpus})",
        "--log-level=lib.eal:error",
        "--no-telemetry",
        *port,
        *extra,
    ]
