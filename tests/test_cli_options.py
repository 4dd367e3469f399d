"""One concept, one option name, in every ``ncina`` command; old names kept for one release.

``CONCEPTS`` is the table: each concept's canonical option, the type its value has wherever it
appears (a list of that type where a command sweeps it), and the spellings it replaced. No
command shows a replaced spelling in ``--help``; a command that still accepts one does so
through ``ncina.common.options.DeprecatedAlias`` (one line on stderr, the same value as the new
name).
``ALIASES`` lists every such old name with a value.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from ncina.cli import build_parser, main
from ncina.common.options import DeprecatedAlias

# concept -> (canonical option, (a value, the type it parses to wherever the option appears;
# None: not checked), old spellings)
CONCEPTS: dict[str, tuple[str, tuple[str, type] | None, frozenset[str]]] = {
    "ranks in the job": ("--workers", ("3", int), frozenset({"--world-size", "--nworkers"})),
    "an aggregator's address": (
        "--aggregator", ("10.0.0.1:47000", tuple), frozenset({"--ina", "--agg"})
    ),
    "slots in the job's pool": ("--pool-size", ("8", int), frozenset({"--window", "--slots"})),
    "initial retransmission timeout (s)": (
        "--timeout", ("0.5", float), frozenset({"--retransmit-timeout", "--rto"})
    ),
    "repetitions of a measurement or run": ("--repeat", ("3", int), frozenset({"--repeats"})),
    "directory of a run's files": (
        "--workdir", ("runs/x", Path), frozenset({"--out", "--run-dir"})
    ),
    "file the results are written to": ("--output", None, frozenset({"--results"})),
    "seed of the randomness": ("--seed", ("7", int), frozenset({"--random-seed"})),
    "elements per packet (the job's K)": (
        "--k", ("64", int), frozenset({"--lanes", "--elements-per-packet"})
    ),
    "link bandwidth (Mbit/s)": ("--bw", ("10", float), frozenset({"--bandwidth"})),
    "IP MTU": ("--mtu", ("1500", int), frozenset()),
    "job id": ("--job", ("1", int), frozenset({"--job-id"})),
    "the job's shared secret": ("--key-file", None, frozenset({"--key"})),
    "the job's profile": ("--profile", ("tofino", str), frozenset({"--p4-profile"})),
}  # fmt: skip

# (command, old option, new option, value given)
ALIASES: list[tuple[tuple[str, ...], str, str, str]] = [
    (("train",), "--world-size", "--workers", "3"),
    (("train",), "--ina", "--aggregator", "10.0.0.1:47000"),
    (("topo",), "--out", "--workdir", "runs/x"),
    (("bench", "ddp"), "--out", "--workdir", "runs/y"),
    (("bench", "aggregator"), "--window", "--pool-size", "8"),
    (("bench", "aggregator"), "--retransmit-timeout", "--timeout", "1.5"),
    (("bench", "tag"), "--repeats", "--repeat", "7"),
    (("bench", "training"), "--timeout", "--run-timeout", "60"),
    (("aggregator",), "--p4-profile", "--profile", "tofino"),
    (("bench", "aggregator"), "--p4-profile", "--profile", "tofino"),
    (("soak",), "--p4-profile", "--profile", "tofino"),
]
REQUIRED = {("aggregator",): ["--job", "1", "--workers", "2"]}
"""The options a command cannot parse without."""


def _commands() -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every leaf command's parser: ``("train",)``, ``("bench", "ddp")``, ..."""
    found: dict[tuple[str, ...], argparse.ArgumentParser] = {}

    def walk(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs and path:
            found[path] = parser
        for sub in subs:
            for name, child in sub.choices.items():
                walk(child, (*path, name))

    walk(build_parser(), ())
    return found


COMMANDS = _commands()


def _visible(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {
        option: action
        for action in parser._actions
        if action.help != argparse.SUPPRESS
        for option in action.option_strings
    }


def _shown(option: str, help_text: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", help_text) is not None


@pytest.mark.parametrize(("command", "old", "new", "value"), ALIASES)
def test_an_old_option_name_still_parses_to_the_same_value(
    command: tuple[str, ...], old: str, new: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = build_parser()
    required = REQUIRED.get(command, [])
    by_new = parser.parse_args([*command, *required, new, value])
    assert capsys.readouterr().err == ""
    by_old = parser.parse_args([*command, *required, old, value])
    assert vars(by_old) == vars(by_new)
    prog = " ".join(("ncina", *command))
    assert capsys.readouterr().err == (
        f"{prog}: {old} is deprecated and goes in the next release; use {new}\n"
    )
    help_text = COMMANDS[command].format_help()
    assert _shown(new, help_text) and not _shown(old, help_text)


def test_every_deprecated_name_is_listed_and_points_at_a_shown_option() -> None:
    aliases = {
        (command, option): action.canonical.option_strings[0]
        for command, parser in COMMANDS.items()
        for action in parser._actions
        if isinstance(action, DeprecatedAlias)
        for option in action.option_strings
    }
    assert aliases == {(command, old): new for command, old, new, _ in ALIASES}
    for (command, _), new in aliases.items():
        assert new in _visible(COMMANDS[command])


@pytest.mark.parametrize("command", sorted(COMMANDS), ids=" ".join)
def test_no_command_spells_a_concept_differently(command: tuple[str, ...]) -> None:
    visible = _visible(COMMANDS[command])
    for concept, (canonical, parses, old) in CONCEPTS.items():
        assert not old & visible.keys(), f"{concept}: use {canonical}, not {old & visible.keys()}"
        if canonical in visible and parses is not None:
            text, kind = parses
            convert = visible[canonical].type or str
            value = convert(text)  # (a sweep, bench fabric's --bw 100,200, takes a list of them)
            values = value if isinstance(value, list) else [value]
            assert values and all(isinstance(v, kind) for v in values), (
                f"{canonical} ({concept}) is not a {kind}")


def test_each_concept_is_an_option_of_some_command() -> None:
    options = {option for parser in COMMANDS.values() for option in _visible(parser)}
    assert {canonical for canonical, _, _ in CONCEPTS.values()} <= options


@pytest.mark.parametrize(
    ("backend", "option", "owner"),
    [
        ("socket", ["--lcores", "2"], "--lcores is an option of the dpdk backend"),
        ("socket", ["--pci", "0000:3b:00.0"], "--pci is an option of the dpdk backend"),
        ("python", ["--idle-sleep-us", "0"], "--idle-sleep-us is an option of the dpdk backend"),
        ("dpdk", ["--socket-mode", "forward"], "--socket-mode is an option of the socket backend"),
        ("socket", ["--grpc-port", "9559"], "--grpc-port is an option of the bmv2 backend"),
        ("bmv2", ["--hugepages", "on"], "--hugepages is an option of the dpdk backend"),
        ("socket", ["--iface", "lo"], "--iface is an option of the dpdk and bmv2 backends"),
    ],
)  # fmt: skip
def test_another_backends_option_is_refused_in_one_line(
    backend: str, option: list[str], owner: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An option the chosen backend would ignore (``--lcores 2`` on socket runs one strand) is
    refused before anything starts, naming the backend it belongs to."""
    status = main(["aggregator", "--backend", backend, "--job", "1", "--workers", "2",
                   "--result", "nc8", "--listen", "127.0.0.1:0", *option])  # fmt: skip
    err = capsys.readouterr().err
    assert status == 1
    assert err == f"ncina aggregator: error: {owner}, not {backend}\n"


ROLES: dict[tuple[str, ...], tuple[str, tuple[str, ...]]] = {
    ("aggregator",): ("aggregator", ()),
    ("allreduce",): ("worker", ()),
    ("train",): ("worker", ("total_workers",)),
    ("bench", "allreduce"): ("run", ()),
    ("bench", "fabric"): ("run", ()),
    ("topo",): ("run", ()),
    ("bench", "ddp"): ("run", ("profile",)),
}
"""Each job command's role (``ncina.proto.job.ROLE_LACKS``) and the fields it derives itself."""


def test_a_new_job_field_is_an_option_of_every_command_of_its_role(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A command's job options are its role's (``JobSpec.add_arguments(parser, role=...)``):
    each offers every field of its role but those it derives, and a field added to ``OPTIONS``
    alone becomes an option of every one of them, spelled and defaulted as there."""
    from ncina.proto.job import OPTIONS, Option, role_fields

    for command, (role, lacks) in ROLES.items():
        flags = {OPTIONS[name].flag for name in role_fields(role) if name not in lacks}
        assert flags <= _visible(COMMANDS[command]).keys(), command
    monkeypatch.setitem(OPTIONS, "foo", Option("--foo", "foo", "a new field", 7,
                                               kwargs={"type": int}))  # fmt: skip
    commands = _commands()
    for command in ROLES:
        parser = commands[command]
        foo = _visible(parser)["--foo"]
        assert (foo.dest, foo.default, foo.type) == ("foo", 7, int), command
