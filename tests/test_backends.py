"""The registry of aggregator backends (``ncina.aggregator.backends``): one table that every
list of backends reads, each row's driver keeping the contract (``add_arguments``, ``options``,
``serve``), and each backend's flags reaching its typed options.

Runs everywhere: it parses command lines and imports the drivers, it starts nothing.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest
from ncina.aggregator import backends
from ncina.aggregator.backends import BACKENDS, Serving

from ncina.cli import build_parser
from ncina.harness.aggregators import LOCAL_BACKENDS

BASE = ["aggregator", "--job", "1", "--workers", "2", "--result", "int"]


def parse(*arguments: str) -> Any:
    return build_parser().parse_args([*BASE, *arguments])


def serving() -> Serving:
    return Serving(listen=("127.0.0.1", 0), generation=3, stats=Path("s.json"),
                   stats_interval=0.5, restart_idle=2.0, control=None, tree=None,
                   compressor=None)  # fmt: skip


def test_the_backend_choices_are_the_registry() -> None:
    """``--backend`` accepts the registry's names and nothing else, and its help lists each
    row's summary."""
    assert backends.names() == ("python", "socket", "dpdk", "bmv2")
    for name in backends.names():
        assert parse("--backend", name).backend == name
    with pytest.raises(SystemExit):
        parse("--backend", "tofino")  # a folder, no row: the twin is bmv2's --p4-profile
    with pytest.raises(KeyError, match="available: python, socket, dpdk, bmv2"):
        backends.get("tofino")


def test_capabilities_select_the_lists_the_others_read() -> None:
    assert backends.names(keyed=True) == ("python", "socket", "dpdk")
    assert backends.names(jobs_dir=True) == ("python", "socket", "dpdk")
    assert backends.names(server_mode=True) == ("python",)
    assert backends.names(switch=False) == ("python", "socket", "dpdk")
    assert LOCAL_BACKENDS == backends.names(kernel_sockets=True) == ("python", "socket")


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_every_driver_keeps_the_contract(backend: backends.Backend) -> None:
    """Each driver has ``add_arguments``, ``options`` and ``serve``; ``options`` gives a frozen
    dataclass that holds the ``Serving`` it was given; ``serve`` takes the job and it."""
    driver = backend.load()
    assert set(inspect.signature(driver.serve).parameters) == {"config", "options"}
    given = serving()
    options = driver.options(parse("--backend", backend.name), given)
    assert dataclasses.is_dataclass(options) and options.serving is given
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.serving = given


@pytest.mark.parametrize(
    ("backend", "arguments", "field", "value"),
    [
        ("python", ["--drop-up", "0.25", "--fault-seed", "9"], "faults",
         ("drop_up", "seed", 0.25, 9)),
        ("python", ["--max-residual-elements", "7"], "max_residual_elements", 7),
        ("socket", ["--socket-mode", "forward"], "mode", "forward"),
        ("dpdk", ["--iface", "veth0", "--lcores", "2", "--eal-arg=-m256"], "lcores", 2),
        ("dpdk", ["--eal-arg=-m256", "--eal-arg=--x"], "eal_args", ["-m256", "--x"]),
        ("bmv2", ["--l2-host", "aa:bb=2", "--l2-host", "cc:dd=1"], "l2_hosts",
         (("aa:bb", 2), ("cc:dd", 1))),
        ("bmv2", ["--rank-port", "1=2", "--p4-profile", "tofino"], "rank_ports", {1: 2}),
    ],
)  # fmt: skip
def test_a_backends_flags_reach_its_options(
    backend: str, arguments: list[str], field: str, value: Any
) -> None:
    driver = backends.get(backend).load()
    options = driver.options(parse("--backend", backend, *arguments), serving())
    got = getattr(options, field)
    if field == "faults":
        first, second, *expected = value
        assert [getattr(got, first), getattr(got, second)] == expected
    else:
        assert got == value


def test_bmv2_refuses_a_jobs_directory_before_anything_starts(tmp_path: Path) -> None:
    from ncina.aggregator.control import JobsDirectory

    with_control = dataclasses.replace(serving(), control=JobsDirectory(tmp_path))
    with pytest.raises(ValueError, match="--jobs-dir is not available on bmv2"):
        backends.get("bmv2").load().options(parse("--backend", "bmv2"), with_control)
