"""The dpdk backend's EAL command line (ncina.aggregator.backends.dpdk.eal): the port (a vdev on an
interface, or a NIC by PCI address, refused with a how-to when DPDK cannot take it) and the memory
(hugepages when 128 MB are free, the --no-huge fallback said at start). No root, no EAL: /sys is a
fake tree under tmp_path. The real run with hugepages is in test_dpdk_packets.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from ncina.aggregator.backends.dpdk.eal import (
    Memory,
    check_pci_port,
    choose_memory,
    eal_arguments,
    pci_address,
)

from ncina.cli import main

NO_HUGE = Memory(False, "test")


@pytest.mark.parametrize(
    ("text", "address"),
    [
        ("0000:3b:00.1", "0000:3b:00.1"),
        ("3B:00.0", "0000:3b:00.0"),
        (" 0001:af:1f.7 ", "0001:af:1f.7"),
    ],
)
def test_pci_addresses_are_written_in_full(text: str, address: str) -> None:
    assert pci_address(text) == address


@pytest.mark.parametrize("text", ["", "eth0", "3b:00", "0000:3b:00.8", "00000:3b:00.0", "3b:0.0"])
def test_a_malformed_pci_address_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="is not a PCI address"):
        pci_address(text)


def _device(sys_pci: Path, address: str, driver: str | None) -> None:
    device = sys_pci / address
    device.mkdir(parents=True)
    if driver is not None:
        target = sys_pci.parent / "drivers" / driver
        target.mkdir(parents=True, exist_ok=True)
        (device / "driver").symlink_to(target)


@pytest.mark.parametrize("driver", ["vfio-pci", "uio_pci_generic", "mlx5_core"])
def test_a_nic_dpdk_can_take_is_accepted(tmp_path: Path, driver: str) -> None:
    sys_pci = tmp_path / "devices"
    _device(sys_pci, "0000:3b:00.0", driver)
    assert check_pci_port("0000:3b:00.0", sys_pci) == driver


@pytest.mark.parametrize(
    ("driver", "said"),
    [("ixgbe", "bound to the kernel driver 'ixgbe'"), (None, "has no driver bound")],
)
def test_a_nic_on_a_kernel_driver_is_refused_with_how_to_bind_it(
    tmp_path: Path, driver: str | None, said: str
) -> None:
    sys_pci = tmp_path / "devices"
    _device(sys_pci, "0000:3b:00.0", driver)
    with pytest.raises(ValueError) as err:
        check_pci_port("0000:3b:00.0", sys_pci)
    assert said in str(err.value)
    assert "dpdk-devbind.py --bind=vfio-pci 0000:3b:00.0" in str(err.value)


def test_a_missing_pci_device_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such PCI device"):
        check_pci_port("0000:3b:00.0", tmp_path)


def _hugepages(root: Path, free: dict[int, int], reserved: int = 0) -> Path:
    for size_kb, pages in free.items():
        d = root / f"hugepages-{size_kb}kB"
        d.mkdir(parents=True)
        (d / "free_hugepages").write_text(f"{pages}\n")
        (d / "resv_hugepages").write_text(f"{reserved}\n")
    return root


@pytest.mark.parametrize(
    ("free", "hugepages"),
    [
        ({2048: 64, 1048576: 0}, True),  # exactly 128 MB of 2 MB pages
        ({2048: 0, 1048576: 1}, True),  # one 1 GB page
        ({2048: 63, 1048576: 0}, False),  # 126 MB
        ({}, False),
    ],
)
def test_auto_uses_hugepages_when_128_mb_are_free(
    tmp_path: Path, free: dict[int, int], hugepages: bool
) -> None:
    memory = choose_memory("auto", _hugepages(tmp_path / "hp", free))
    assert memory.hugepages is hugepages
    if not hugepages:
        assert memory.reason.startswith("--no-huge fallback: ")
        assert "128 MB needed" in memory.reason


def test_pages_another_process_reserved_are_not_counted_as_free(tmp_path: Path) -> None:
    """EAL counts free minus reserved: 70 free pages of which 7 reserved are 126 MB, too few."""
    memory = choose_memory("auto", _hugepages(tmp_path / "hp", {2048: 70}, reserved=7))
    assert not memory.hugepages and "126 MB of free hugepages" in memory.reason


def test_on_refuses_to_start_without_hugepages_and_off_never_uses_them(tmp_path: Path) -> None:
    few = _hugepages(tmp_path / "few", {2048: 10})
    with pytest.raises(ValueError, match=r"--hugepages on: 20 MB of free hugepages, 128 MB needed"):
        choose_memory("on", few)
    many = _hugepages(tmp_path / "many", {2048: 1000})
    assert choose_memory("on", many).hugepages
    assert not choose_memory("off", many).hugepages
    with pytest.raises(ValueError, match="--hugepages must be one of"):
        choose_memory("sometimes", many)


def test_a_pci_port_is_the_only_device_eal_probes() -> None:
    argv = eal_arguments(pci="0000:3b:00.0", memory=NO_HUGE, extra=["-m256"])
    assert "--allow=0000:3b:00.0" in argv
    assert "--no-pci" not in argv and not any(a.startswith("--vdev") for a in argv)
    assert argv[-1] == "-m256"


@pytest.mark.parametrize(
    ("pmd", "vdev"),
    [
        ("af_packet", "--vdev=net_af_packet0,iface=veth0,qpairs=1,framecnt=4096"),
        ("af_xdp", "--vdev=net_af_xdp0,iface=veth0,start_queue=0,queue_count=1,framecnt=4096"),
    ],
)
def test_an_interface_is_a_vdev_without_pci_probing(pmd: str, vdev: str) -> None:
    argv = eal_arguments(iface="veth0", memory=NO_HUGE, vdev_options="framecnt=4096", pmd=pmd)
    assert vdev in argv and "--no-pci" in argv
    assert not any(a.startswith("--allow") for a in argv)


def test_hugepages_replace_no_huge_with_in_memory() -> None:
    huge = eal_arguments(iface="veth0", memory=Memory(True, "test"))
    assert "--in-memory" in huge and "--no-huge" not in huge and "--no-shconf" not in huge
    plain = eal_arguments(iface="veth0", memory=NO_HUGE)
    assert "--no-huge" in plain and "--no-shconf" in plain and "--in-memory" not in plain
    assert plain[plain.index("-m") + 1] == huge[huge.index("-m") + 1] == "128"


@pytest.mark.parametrize("port", [{}, {"iface": "veth0", "pci": "0000:3b:00.0"}])
def test_eal_serves_exactly_one_port(port: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="serves one port"):
        eal_arguments(memory=NO_HUGE, **port)


@pytest.mark.parametrize(
    ("port", "said"),
    [
        ([], "serves one port: give --iface IF"),
        (["--iface", "veth0", "--pci", "3b:00.0"], "serves one port: give --iface IF"),
        (["--pci", "ff:1f.7"], "--pci 0000:ff:1f.7: no such PCI device"),
        (["--pci", "eth0"], "argument --pci: 'eth0' is not a PCI address"),
    ],
)
def test_the_command_refuses_a_port_it_cannot_serve_before_eal_starts(
    capsys: pytest.CaptureFixture[str], port: list[str], said: str
) -> None:
    argv = ["aggregator", "--backend", "dpdk", "--job", "1", "--workers", "2", "--k", "64",
            "--result", "int", "--listen", "10.0.0.1:47000", *port]  # fmt: skip
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own refusal (the --pci type)
        code = exc.code
    assert code == 2 if "not a PCI address" in said else code == 1
    err = capsys.readouterr().err
    assert said in err
    assert "Traceback" not in err
