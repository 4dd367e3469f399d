"""The P4 generator and the control plane's decisions, without p4c or BMv2 (runs everywhere).

The generated lanes must be exactly K, each action and the int-result widening must touch every
lane once, the counter numbering of config.p4 must be the control plane's, and the compile rule
must name the program, the generated directory and both outputs.
"""

from __future__ import annotations

import functools
import io
import re
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from ncina.aggregator.backends.bmv2 import entries, gen, layout, toolchain
from ncina.aggregator.jobs import JobConfig
from ncina.aggregator.stats import GLOBAL_DROP_REASONS, JOB_DROP_REASONS
from ncina.proto import nc8
from ncina.proto.wire import ETH_IPV4_UDP_HEADERS, MAX_WORKERS


def _action(text: str, name: str) -> str:
    """The body of ``action name() { ... }`` in generated P4 (actions have no nested braces)."""
    found = re.search(rf"action {name}\([^)]*\) {{\n(.*?)\n    }}\n", text, re.S)
    assert found, f"no action {name}"
    return found.group(1)


def _lanes(text: str) -> list[int]:
    return sorted({int(i) for i in re.findall(r"hdr\.lanes\[(\d+)\]", text)})


def _group_lanes(text: str) -> list[int]:
    """The lanes whose byte of their group ``text`` slices (``hdr.codes[g].v[h:l]``)."""
    return [int(g) * gen.GROUP + gen.GROUP - 1 - int(low) // 8 for g, _, low in
            re.findall(r"hdr\.codes\[(\d+)\]\.v\[(\d+):(\d+)\]", text)]  # fmt: skip


@pytest.mark.parametrize("k", [8, 12, 64, 256])
def test_generated_program_has_k_lanes_in_every_step(k: int, tmp_path: Path) -> None:
    config, lanes = gen.write(k, tmp_path)
    defines = dict(re.findall(r"#define (\w+) (\d+)", config.read_text()))
    n = -(-k // 8)
    assert int(defines["NCINA_K"]) == k and int(defines["NCINA_GROUPS"]) == n
    assert int(defines["NCINA_CELL_BITS"]) == 8 * gen.LANE_BITS
    text = lanes.read_text()
    assert text.count("control CheckCodes(") == 1 and text.count("control LaneSums(") == 1
    every, groups = list(range(k)), list(range(n))
    # One cell of 8 lanes' sums and one of their result codes per group, by slot version.
    assert [int(g) for g in re.findall(
        r"register<bit<NCINA_CELL_BITS>>\(NCINA_SLOTS\) cells_(\d+);", text)] == groups
    assert [int(g) for g in re.findall(r"register<bit<64>>\(NCINA_SLOTS\) results_(\d+);", text)
            ] == groups  # fmt: skip
    # The parser: a chunk's full groups as groups (one state per group, stopping after
    # `count / 8` of them), then its last `count % 8` lanes lane by lane (one state per tail
    # lane, extracting its element of the 7-lane stack, marking its code); a count above K is
    # StackOutOfBounds (bad_count).
    assert int(defines["NCINA_TAIL"]) == min(7, k)
    full, tail = list(range(k // 8)), list(range(min(7, k)))
    parser = text[text.index("parser LaneParser("):text.index("control CheckCodes")]
    assert "transition select(hdr.nc.count[15:3]) {\n            0: lane_0;\n" \
        "            default: group_0;\n" in parser
    found = re.findall(r"state group_(\d+) \{\n\s+packet\.extract\(hdr\.codes\[(\d+)\]\);\n"
                       r"\s+(.*)\n", parser)  # fmt: skip
    assert [(int(a), int(b)) for a, b, _ in found] == [(g, g) for g in full]
    assert [end for *_, end in found] == [
        f"transition select(hdr.nc.count[15:3], hdr.nc.count[2:0]) {{ ({g + 1}, 0): accept; "
        f"({g + 1}, _): lane_0; default: group_{g + 1}; }}"
        for g in full[:-1]] + [f"verify(hdr.nc.count <= {k}, error.StackOutOfBounds);"]
    last_group = parser[parser.index(f"state group_{full[-1]} {{"):parser.index("state lane_0")]
    assert ("transition accept;" if k % 8 == 0 else
            "transition select(hdr.nc.count[2:0]) { 0: accept; default: lane_0; }") in last_group
    states = re.findall(r"state lane_(\d+) \{\n\s+packet\.extract\(hdr\.lanes\[(\d+)\]\);\n"
                        r"\s+meta\.codes_seen = meta\.codes_seen \| \(bit<128>\)1 << "
                        r"\(bit<8>\)hdr\.lanes\[(\d+)\]\.code;\n\s+(.*)\n", parser)  # fmt: skip
    assert [(int(a), int(b), int(c)) for a, b, c, _ in states] == [(i, i, i) for i in tail]
    assert [end for *_, end in states] == [
        f"transition select(hdr.nc.count[2:0]) {{ {i + 1}: accept; default: lane_{i + 1}; }}"
        for i in tail[:-1]] + ["transition accept;"]
    # CheckCodes gathers a packet's tail lanes into the group that `count` ends in, its lanes
    # past the tail zero; the groups' window check is one sum per group.
    for g in groups:
        gather = _action(text, f"gather_{g}")
        lanes_g = range(min(7, k - 8 * g))
        assert re.findall(r"hdr\.lanes\[(\d+)\]\.sign \+\+ hdr\.lanes\[(\d+)\]\.code", gather) \
            == [(str(j), str(j)) for j in lanes_g]
        assert gather.count("8w0") == 8 - len(lanes_g)
        assert f"if (hdr.nc.count[15:3] == {g}) {{\n                gather_{g}();" in text
        # and a reply's tail lanes get the group's result codes back
        scatter = _action(text, f"scatter_{g}")
        assert _lanes(scatter) == list(lanes_g)
        assert sorted(_group_lanes(scatter)) == sorted(2 * [8 * g + j for j in lanes_g])
        assert f"if (hdr.nc.count < {8 * (g + 1)}) {{\n" \
            f"                        hdr.codes[{g}].setInvalid();" in text
    check = text[text.index("control CheckCodes"):text.index("control LaneSums")]
    # (the same sum in both branches: a packet with a tail checks its full groups too)
    assert [int(g) for g in re.findall(r"\(\(hdr\.codes\[(\d+)\]\.v & 64w0x7F7F", check)
            ] == groups * 2  # fmt: skip
    narrow_sum = re.search(r"            if \((\(.*\)) != 0\) \{\n\s+meta\.bad_code = 1;", check)
    assert narrow_sum and f"meta.bad_code = {narrow_sum[1]} != 0 ? 1w1 : 1w0;" in check
    # store and add: one cell per group, each lane's code once in its group's operand.
    for action, reads in (("store", 0), ("add", 1)):
        body = _action(text, action)
        # (its sign once, its code in both branches of `sign ? B - v : B + v`)
        assert sorted(_group_lanes(body)) == sorted(every * 3), action
        assert [int(g) for g in re.findall(r"cells_(\d+)\.write\(", body)] == groups, action
        assert len(re.findall(r"cells_\d+\.read\(", body)) == reads * n, action
    assert [int(g) for g in re.findall(r"results_(\d+)\.read\(hdr\.codes\[(?:\d+)\]",
                                       _action(text, "load_nc8"))] == groups  # fmt: skip
    clear = _action(text, "clear")
    assert _lanes(clear) == tail and len(re.findall(r"hdr\.lanes\[\d+\]", clear)) == len(tail)
    assert [int(g) for g in re.findall(r"hdr\.codes\[(\d+)\]\.setInvalid", clear)] == groups
    # Re-compression, lane by lane: an action reads the sum as a magnitude (the group's first
    # lane reads the cell), one LPM table apply per lane finds its highest set bit (64 entries,
    # one per bit), its action rounds it with one random word into the lane's byte, and after
    # a group's last lane its codes are stored.
    apply = text[text.index("    apply {", text.index("control LaneSums")):]
    encode = apply[apply.index("key();"):apply.index("load_nc8();")]
    calls = re.findall(r"(prepare|high|keep)_(\d+)(?:\.apply)?\(\);", encode)
    expected = []
    for i in every:
        expected += [("prepare", str(i)), ("high", str(i))]
        if i % 8 == 7 or i == k - 1:
            expected.append(("keep", str(i // 8)))
    assert calls == expected
    assert "if (" not in encode
    assert [int(i) for i in re.findall(r"table high_(\d+) \{", text)] == every
    assert [g for g in groups if f"cells_{g}.read(meta.cell" in _action(text, f"prepare_{8 * g}")
            ] == groups  # fmt: skip
    for i in every:
        for action in (f"round_{i}", f"zero_{i}"):
            assert _group_lanes(_action(text, action)) == [i], action
    assert [int(g) for g in re.findall(r"results_(\d+)\.write\(meta\.slot_index, hdr\.codes",
                                       text)] == groups  # fmt: skip
    assert "random(" not in text  # the rounding bits are the chunk's hash (docs/protocol.md)
    assert apply.count("key();") == 1 and text.count("hash(") == 1  # one CRC-32 per result
    terms = re.findall(r"\(\(meta\.result_key \^ 32w0x([0-9A-F]{8})\) \+\+ 32w0\)", text)
    assert [int(t, 16) for t in terms] == nc8.lane_terms(0, k).tolist()
    # int results: each lane i < count becomes a 64-bit lane, a full group's 8 as one 512-bit
    # header (lane 8g the most significant), the last count % 8 each in the tail stack.
    assert [int(g) for g in re.findall(r"hdr\.wide_groups\[(\d+)\]\.setValid\(\)", text)] == full
    for g in full:
        value = re.search(rf"hdr\.wide_groups\[{g}\]\.v = (.*);", text)
        assert value is not None and re.findall(r"meta\.cell\[(\d+):(\d+)\]", value[1]) == [
            (str(70 * j + 69), str(70 * j)) for j in range(8)]
    tails = re.findall(r"if \(hdr\.nc\.count > (\d+)\) \{\n\s+hdr\.wide\[(\d+)\]\.setValid\(\);"
                       r"\n\s+hdr\.wide\[(\d+)\]\.value = \(bit<64>\)\(meta\.cell\[(\d+):", text)
    assert [(int(i), int(j), int(j2), int(high)) for i, j, j2, high in tails] == [
        (i, i % 8, i % 8, 70 * (i % 8) + 69) for i in every if i % 8 < 7]


def test_generation_is_reproducible_and_checks_k(tmp_path: Path) -> None:
    first = [p.read_bytes() for p in gen.write(64, tmp_path / "a")]
    second = [p.read_bytes() for p in gen.write(64, tmp_path / "b")]
    assert first == second
    assert gen.lanes_p4(8) != gen.lanes_p4(9)
    for bad in (0, 1025):
        with pytest.raises(ValueError, match=r"K must be in 1\.\.1024"):
            gen.write(bad, tmp_path / "c")


def test_counter_numbering_is_shared_with_the_control_plane() -> None:
    values = layout.defines(16)
    assert values["NCINA_JOB_EVENTS"] == len(layout.JOB_EVENTS)
    assert values["EV_PACKETS_IN"] == 0  # P4 uses 0 as "no fault"
    for reason in JOB_DROP_REASONS:
        assert layout.JOB_EVENTS[values[f"EV_{reason.upper()}"]] == reason
    assert set(layout.GLOBAL_EVENTS) == set(GLOBAL_DROP_REASONS) - {"internal_error"}
    # Every EV_ name the hand-written P4 uses is defined.
    used = set()
    for path in toolchain.sources():
        used |= set(re.findall(r"\b(EV_\w+)", path.read_text()))
    assert used and used <= set(values)


def test_hand_written_program_declares_its_tables_and_wires_only_in_the_top_file() -> None:
    text = {p.name: p.read_text() for p in toolchain.sources()}
    tables = {name: re.findall(r"^\s*table (\w+) \{", src, re.M) for name, src in text.items()}
    assert tables["admission.p4"] == ["jobs"]
    assert tables["members.p4"] == ["members"]
    assert tables["forward.p4"] == ["l2"]
    assert tables["ncina.p4"] == ["local_address"]
    assert re.findall(r'#include "(\w+\.p4)"', text["ncina.p4"]) == [
        "config.p4", "headers.p4", "state.p4", "lanes.p4", "parser.p4", "checksum.p4",
        "transport.p4", "arp.p4",
        "forward.p4", "members.p4", "admission.p4", "slots.p4", "reply.p4", "rewrite.p4",
    ]  # fmt: skip
    # The P4Info names the control plane uses exist in the program.
    for qualified in (entries.JOBS_TABLE, entries.MEMBERS_TABLE, entries.L2_TABLE,
                      entries.LOCAL_TABLE):  # fmt: skip
        assert any(qualified.rsplit(".", 1)[1] in names for names in tables.values())


def test_compile_rule_names_the_program_the_generated_files_and_both_outputs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NCINA_P4C", "/opt/p4c/bin/p4c-bm2-ss")
    build = toolchain.Build(64, tmp_path / "k64")
    command = toolchain.compile_command(build)
    assert command[0] == "/opt/p4c/bin/p4c-bm2-ss"
    assert command[-1] == str(toolchain.P4_DIR / "ncina.p4")
    assert command[command.index("-I") + 1] == str(tmp_path / "k64")
    assert command[command.index("-o") + 1] == str(tmp_path / "k64" / "ncina.json")
    assert command[command.index("--p4runtime-files") + 1] == str(
        tmp_path / "k64" / "ncina.p4info.txt"
    )
    assert toolchain.BUILD_DIR / "k64" == toolchain.ROOT / "build" / "p4" / "k64"
    # The benchmark's no-op forwarder: its own program and outputs, nothing generated.
    echo = toolchain.Build(0, tmp_path / "echo", toolchain.ECHO)
    command = toolchain.compile_command(echo)
    assert command[-1] == str(toolchain.P4_DIR / "echo" / "echo.p4")
    assert (toolchain.P4_DIR / "echo" / "echo.p4").is_file()
    assert command[command.index("-o") + 1] == str(tmp_path / "echo" / "echo.json")
    assert echo.p4info == tmp_path / "echo" / "echo.p4info.txt"


def test_missing_compiler_is_one_sentence_naming_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NCINA_P4C", str(tmp_path / "no-such-p4c"))
    reason = toolchain.missing()
    assert reason is not None and "no-such-p4c is not installed" in reason and "\n" not in reason
    with pytest.raises(toolchain.ToolchainError, match="no-such-p4c is not installed"):
        toolchain.build(8, tmp_path / "k8", force=True)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _fake_p4c(path: Path, body: str) -> Path:
    """A stand-in for p4c-bm2-ss: a shell script (``$@``: the compile command's arguments)."""
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


# Writes both outputs the compile command names, like p4c-bm2-ss.
WRITE_OUTPUTS = """while [ $# -gt 0 ]; do
  case "$1" in -o|--p4runtime-files) echo built > "$2"; shift;; esac; shift
done"""


def test_a_compile_shows_progress_on_a_terminal_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("NCINA_P4C", str(_fake_p4c(tmp_path / "p4c", WRITE_OUTPUTS)))
    build = toolchain.build(8, tmp_path / "quiet")
    assert build.json.read_text() == "built\n" and build.p4info.read_text() == "built\n"
    assert capsys.readouterr().err == ""  # stderr is not a terminal here: no bar
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    toolchain.build(8, tmp_path / "shown")
    assert "p4c-bm2-ss ncina.p4 K=8" in terminal.getvalue()


def test_a_failed_compile_names_the_command_and_its_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p4c = _fake_p4c(tmp_path / "p4c", "echo 'ncina.p4(3): syntax error' >&2; exit 2")
    monkeypatch.setenv("NCINA_P4C", str(p4c))
    with pytest.raises(toolchain.ToolchainError) as failed:
        toolchain.build(8, tmp_path / "k8")
    assert str(failed.value).startswith(f"{p4c} --std p4-16")
    assert str(failed.value).endswith("failed with status 2:\nncina.p4(3): syntax error")


def _job(**options: object) -> JobConfig:
    values: dict = {"job": 7, "workers": 4, "k": 64, "result_format": "nc8"}
    values.update(options)
    return JobConfig.create(**values)


def test_jobs_are_placed_in_disjoint_slot_ranges_and_refused_when_they_do_not_fit() -> None:
    a, b = _job(job=1, pool_size=64), _job(job=2, pool_size=100)
    placed = entries.place([a, b], generation=3, k=64)
    assert [(p.index, p.slot_base) for p in placed] == [(0, 0), (1, 128)]
    with pytest.raises(ValueError, match="K=64, the program was built for 32"):
        entries.place([a], 3, k=32)
    with pytest.raises(ValueError, match="does not fit"):
        entries.place([_job(pool_size=layout.SLOTS // 2 + 1)], 3, k=64)
    with pytest.raises(ValueError, match="authentication tag"):
        entries.place([_job(key=b"k" * 16)], 3, k=64)


def test_job_entries_and_groups() -> None:
    config = _job(workers=3, members=[(1, ("10.0.0.2", 40001))], result_format="int",
                  seed=0xFEED)
    [job] = entries.place([config], generation=9, k=64)
    row, member = entries.job_entries(job)
    assert row.table == entries.JOBS_TABLE and row.match == {"hdr.nc.job": "7"}
    assert row.params["emin"] == str(config.window.e_min & 0xFF) == str(256 - 50)
    assert row.params["max_code"] == str(config.window.max_code)
    assert (row.params["result_format"], row.params["generation"]) == ("1", "9")
    assert row.params["seed"] == str(job.seed) and job.seed == 0xFEED  # the job's --seed
    [drawn] = entries.place([_job(seed=None)], generation=9, k=64)
    assert 0 <= drawn.seed < 2**64  # none given: one drawn, installed with the entry
    assert member.match == {"meta.job_index": "0", "hdr.nc.rank": "1"}
    assert member.params == {"ip": "10.0.0.2", "port": "40001"}
    assert entries.job_group(job, dict.fromkeys(range(3), 1)).replicas == ((1, 0), (1, 1), (1, 2))
    assert entries.job_group(job, {0: 3, 1: 1, 2: 2}) == entries.Group(1, ((3, 0), (1, 1), (2, 2)))
    assert entries.flood_group([2, 1]) == entries.Group(layout.FLOOD_GROUP, ((1, 0), (2, 0)))
    assert entries.l2_entries({"02:00:00:00:00:02": 2, "02:00:00:00:00:01": 1}) == [
        entries.Entry(entries.L2_TABLE, {"hdr.eth.dst": f"02:00:00:00:00:0{port}"},
                      entries.L2_ACTION, {"port": str(port)}) for port in (1, 2)]  # fmt: skip


def test_counters_become_the_stats_document_in_udp_payload_bytes() -> None:
    [job] = entries.place([_job(job=3, k=16, result_format="int"),
                           _job(job=4, k=16)], 1, k=16)[1:]  # fmt: skip
    base = job.index * len(layout.JOB_EVENTS)
    ev = {name: base + i for i, name in enumerate(layout.JOB_EVENTS)}
    frame = ETH_IPV4_UDP_HEADERS + 16  # every uplink below has the header and `count` codes
    counts = {
        ev["packets_in"]: (5, 5 * frame + 16 * 4 + 2),
        ev["contributions"]: (4, 0),
        ev["results_sent"]: (4, 4 * (frame + 16)),  # one 4-worker slot of 16 elements
        ev["results_resent"]: (1, frame + 16),
        ev["notices_sent"]: (2, 0),
        ev["bad_code"]: (1, 0),
    }
    stats = entries.job_stats(job, counts)
    assert stats.packets_in == 5 and stats.bytes_in == 16 * 5 + 16 * 4 + 2
    assert (stats.contributions, stats.results_sent, stats.results_resent) == (4, 4, 1)
    assert stats.packets_out == 4 + 1 + 2
    assert stats.bytes_out == 5 * (16 + 16) + 2 * 24  # nc8 results: one byte per element
    assert stats.drops["bad_code"] == 1 and sum(stats.drops.values()) == 1
    glob = entries.global_stats({layout.GLOBAL_EVENTS.index("truncated"): (2, 2 * 50)})
    assert (glob.packets_in, glob.bytes_in, glob.drops["truncated"]) == (2, 16, 2)


class _Fields(dict):
    """P4 field paths (``meta.result_key``) as nested attributes, for evaluating statements."""

    def __getattr__(self, name: str) -> object:
        return self.setdefault(name, _Fields())

    def __setattr__(self, name: str, value: object) -> None:
        self[name] = value


# Widths of the fields the key's hash reads (p4/headers.p4), to pack them as BMv2 does.
_HASHED_BITS = {"meta.seed": 64, "hdr.nc.job": 16, "hdr.nc.slot": 16, "hdr.nc.offset": 32,
                "meta.result_use": 32, "meta.result_version": 8}  # fmt: skip


def _run_key(statements: str, fields: _Fields) -> None:
    """Execute the generated ``key`` action on ``fields``: the version's widening assignment,
    then the ``hash(..., HashAlgorithm.crc32, 32w0, {fields}, 64w0x100000000)`` as zlib's CRC-32
    of the listed fields packed big-endian at their P4 widths (BMv2's crc32 is zlib's: checked
    on BMv2 itself by test_bmv2_parity's nc8 results)."""
    text = " ".join(statements.split())
    assert text.startswith("meta.result_version = (bit<8>)hdr.nc.pool;")
    fields.meta.result_version = fields.hdr.nc.pool
    call = re.fullmatch(r".*hash\(meta\.result_key, HashAlgorithm\.crc32, 32w0, \{ (.*) \}, "
                        r"64w0x100000000\);", text)  # fmt: skip
    assert call is not None, text
    *names, lane = call[1].split(", ")
    assert lane == "32w0"
    packed = b"".join(int(eval(name, {}, fields)).to_bytes(_HASHED_BITS[name] // 8, "big")
                      for name in names) + bytes(4)  # fmt: skip
    fields.meta.result_key = zlib.crc32(packed)


def _slices(text: str) -> str:
    """P4 bit slices ``x[h:l]`` as Python (``(x >> l & mask)``)."""
    return re.sub(r"([\w.]+(?:\[\d+\])?(?:\.\w+)?)\[(\d+):(\d+)\]",
                  lambda m: f"({m[1]} >> {m[3]} & {(1 << (int(m[2]) - int(m[3]) + 1)) - 1})", text)


def _p4_expr(text: str) -> str:
    """A generated P4 expression as Python: bit slices of one bit, the ternaries the lanes write
    (``C ? A : B`` as a whole statement or ``(C ? 7w1 : 7w0)``), the word's concatenation
    with 32 zero bits."""
    text = _slices(text)
    text = re.sub(r" \+\+ 32w0\)", r" << 32)", text)
    text = re.sub(r"\((.*) \? 7w1 : 7w0\)$", r"(1 if (\1) else 0)", text)
    if " ? " in text:
        cond, rest = text.split(" ? ", 1)
        yes, no = rest.split(" : ", 1)
        text = f"({yes}) if ({cond}) else ({no})"
    text = re.sub(r"\(bit<\d+>\)", "", text)
    return re.sub(r"\b\d+w(0x[0-9A-Fa-f]+|\d+)", r"\1", text)


@functools.cache
def _lane_rows(k: int) -> dict[int, list[tuple[int, int, str, dict[str, int]]]]:
    """The control plane's entries of each lane's LPM table: (value, prefix, action, args)."""
    rows: dict[int, list[tuple[int, int, str, dict[str, int]]]] = {}
    for e in entries.lane_entries(k):
        lane = int(e.table.rsplit("_", 1)[1])
        assert e.table == entries.LANE_TABLE.format(lane=lane)
        value, prefix = (int(x, 0) for x in e.match[entries.LANE_KEY].split("/"))
        params = {name: int(v) for name, v in e.params.items()}
        rows.setdefault(lane, []).append((value, prefix, e.action, params))
    return rows


WORKERS = 4


def _lane_code(text: str, k: int, lane: int, total: int, fields: _Fields) -> int:
    """Lane ``lane``'s re-compression as BMv2 runs it on the sum ``total`` of ``WORKERS``
    contributions: ``prepare_i`` on a cell holding the lane's biased sum, the longest match
    among the control plane's entries of its LPM table (or the table's default ``zero_i``) and
    that action with the entry's arguments. Returns the byte written into the lane's group."""
    group, place = divmod(lane, gen.GROUP)
    fields.meta.unbias = WORKERS * gen.LANE_BIAS
    cell = (total + WORKERS * gen.LANE_BIAS) << (gen.LANE_BITS * place)
    fields.meta.cell = None  # until prepare_i (of the group's first lane) reads the cell
    if place:
        fields.meta.cell = cell
    fields.hdr.codes = [_Fields(v=0) for _ in range(group + 1)]

    def run(body: str, args: dict[str, int]) -> None:
        for statement in " ".join(body.split()).split(";"):
            statement = statement.strip()
            if statement == f"cells_{group}.read(meta.cell, meta.slot_index)":
                fields.meta.cell = cell
            elif byte := re.fullmatch(rf"hdr\.codes\[{group}\]\.v\[(\d+):(\d+)\] = (.*)",
                                      statement):  # fmt: skip
                high, low, value = byte.groups()
                assert (int(high), int(low)) == (63 - 8 * place, 56 - 8 * place)
                sign, code = value.split(" ++ ", 1) if " ++ " in value else ("0", value)
                code = code[1:-1] if code.startswith("(") else code  # (code + (C ? 1 : 0))
                sign_bit = eval(_p4_expr(sign), {}, fields)
                code_bits = eval(_p4_expr(code), {}, {**fields, **args}) % 2**7
                fields.hdr.codes[group].v |= (sign_bit << 7 | code_bits) << int(low)
            elif statement:
                target, expr = (x.strip() for x in statement.split("=", 1))
                owner, name = target.rsplit(".", 1)
                value = eval(_p4_expr(expr), {}, {**fields, **args}) % 2**64
                setattr(eval(owner, {}, fields), name, value)

    run(_action(text, f"prepare_{lane}"), {})
    assert fields.meta.lane_sum == total % 2**64
    magnitude = fields.meta.lane_magnitude
    matches = []
    for value, prefix, action, params in _lane_rows(k)[lane]:
        mask = (2**64 - 1) ^ ((1 << (64 - prefix)) - 1)
        if magnitude & mask == value:
            assert action == f"NcinaIngress.slots.sums.round_{lane}"
            matches.append((prefix, params))
    if matches:
        run(_action(text, f"round_{lane}"), max(matches, key=lambda m: m[0])[1])
    else:
        run(_action(text, f"zero_{lane}"), {})
    return fields.hdr.codes[group].v >> (56 - 8 * place) & 0xFF


def test_generated_rounding_bits_are_the_protocols() -> None:
    """The key actions, and each lane's re-compression (its action, the LPM table's longest
    match and that action), executed as written, give ``nc8``'s result key and the reference
    codec's codes bit for bit, for sums at every power of two and either side of it, zero,
    the extremes and random ones, under several chunks' keys."""
    k = 64
    text = gen.lanes_p4(k)
    cases = [(0, 0, 0, 0, 0, 0), (42, 9, 3, 1, 4096, 7), (2**64 - 1, 65535, 65535, 1, 2**32 - 1,
                                                              2**32 - 1)]  # fmt: skip
    rng = np.random.default_rng(3)
    edges = [0, 1, -1, 2**63 - 1, -(2**63), 3, -3]
    edges += [s * (2**h + d) for h in range(1, 63) for d in (-1, 0, 1) for s in (1, -1)]
    edges += [int(v) for v in rng.integers(-(2**62), 2**62, 64)]
    reference = nc8.codec("numpy")
    for seed, job, slot, version, offset, use in cases:
        fields = _Fields()
        fields.meta.seed, fields.meta.result_use = seed, use
        fields.hdr.nc.job, fields.hdr.nc.slot, fields.hdr.nc.offset = job, slot, offset
        fields.hdr.nc.pool = version
        _run_key(_action(text, "key"), fields)
        key = nc8.result_key(seed, job, slot, version, offset, use)
        assert fields.meta.result_key == key
        for start in range(0, len(edges), k):
            sums = edges[start:start + k]
            expected = reference.recompress(np.array(sums, dtype=np.int64), key)
            got = [_lane_code(text, k, lane, total, fields) for lane, total in enumerate(sums)]
            assert got == expected.tolist(), (key, start)


def test_the_p4_descriptor_is_the_protocols_and_its_fields_come_from_the_entries() -> None:
    """The job handshake on BMv2 (not compiled here): the P4 header has the descriptor's fields
    in ``ncina.proto.descriptor``'s order and widths, the answer is built from the jobs entry
    (which carries e_max) and the local entry (the generation), and the stats count answers."""
    from ncina.proto import descriptor

    text = {p.name: p.read_text() for p in toolchain.sources()}
    body = re.search(r"header descriptor_h \{(.*?)\}", text["headers.p4"], re.S)
    assert body
    widths = [int(w) for w in re.findall(r"bit<(\d+)> \w+;", body.group(1))]
    codes = {"B": 8, "b": 8, "H": 16, "I": 32}
    assert widths == [codes[c] for c in descriptor.DESCRIPTOR.format.lstrip("!")]
    assert "(FORMAT_JOB, _): parse_descriptor;" in text["parser.p4"]
    assert "EV_HANDSHAKES" in text["admission.p4"] and "hdr.desc.e_max = meta.e_max;" in (
        text["reply.p4"]
    )
    assert "hdr.desc.rounding = NC8_ROUNDING;" in text["reply.p4"]
    assert f"const bit<8> NC8_ROUNDING = {nc8.ROUNDING};" in text["headers.p4"]
    assert f"const bit<16> DESCRIPTOR_BYTES = {descriptor.DESCRIPTOR_SIZE};" in text["headers.p4"]
    [job] = entries.place([_job(window_max=12)], generation=9, k=64)
    assert entries.job_entries(job)[0].params["e_max"] == "12"
    assert entries.local_entry("10.0.0.9", 47000, "02:00:00:00:00:09", 9).params == {
        "mac": "02:00:00:00:00:09", "port": "47000", "generation": "9"}
    base = job.index * len(layout.JOB_EVENTS)
    handshakes = base + layout.JOB_EVENTS.index("handshakes")
    answer = descriptor.JOB_DATAGRAM_SIZE
    stats = entries.job_stats(job, {base: (2, 2 * (ETH_IPV4_UDP_HEADERS + answer)),
                                    handshakes: (2, 0)})  # fmt: skip
    assert (stats.handshakes, stats.packets_out, stats.bytes_out) == (2, 2, 2 * answer)


def _p4_ternary(text: str) -> str:
    """``(C ? A : B)`` (an addend of the lanes' store and add) as Python."""
    cond, rest = text.strip()[1:-1].split(" ? ", 1)
    yes, no = rest.split(" : ", 1)
    return f"({yes}) if ({cond}) else ({no})"


def _cell_writes(body: str, codes: list[int], cells: list[int]) -> None:
    """Execute ``store`` or ``add`` (``cells_g.read(meta.cell, ...)``, ``cells_g.write(...,
    [meta.cell + (]A_7 ++ ... ++ A_0[)])``) on ``cells`` as BMv2 would: each addend a
    LANE_BITS number, concatenated, the sum masked to the cell's width. ``codes`` holds the
    packet's 64-bit groups."""
    fields = _Fields()
    fields.hdr.codes = [_Fields(v=v) for v in codes]
    width, lane_mask = gen.GROUP * gen.LANE_BITS, (1 << gen.LANE_BITS) - 1
    for statement in " ".join(body.split()).split(";"):
        statement = _slices(re.sub(r"\(bit<\d+>\)|\b\d+w(?=\d)", "", statement.strip()))
        if read := re.fullmatch(r"cells_(\d+)\.read\(meta\.cell, meta\.slot_index\)", statement):
            fields.meta.cell = cells[int(read.group(1))]
        elif write := re.fullmatch(r"cells_(\d+)\.write\(meta\.slot_index, (.*)\)", statement):
            group, value = write.groups()
            base = 0
            if value.startswith("meta.cell + ("):
                base, value = fields.meta.cell, value[len("meta.cell + ("):-1]
            operand = 0
            for piece in value.split(" ++ "):
                lane = eval(_p4_ternary(piece), {}, fields) if "?" in piece else int(piece)
                operand = operand << gen.LANE_BITS | lane & lane_mask
            cells[int(group)] = (base + operand) % 2**width
        else:
            assert not statement, statement


def _lane_sums(text: str, k: int, codes: np.ndarray, signs: np.ndarray) -> list[int]:
    """Each lane's 64-bit sum after ``store`` then ``add`` of every row of ``codes`` and
    ``signs`` (one worker each), as ``prepare_i`` reads it: the cell's lane less the bias."""
    cells = [0] * gen.groups(k)
    for w in range(len(codes)):
        lanes = [int(s) << 7 | int(c) for s, c in zip(signs[w], codes[w], strict=True)]
        lanes += [0] * (-len(lanes) % gen.GROUP)
        groups = [int.from_bytes(bytes(lanes[g:g + gen.GROUP]), "big")
                  for g in range(0, len(lanes), gen.GROUP)]  # fmt: skip
        _cell_writes(_action(text, "store" if w == 0 else "add"), groups, cells)
    mask = (1 << gen.LANE_BITS) - 1
    return [((cells[i // gen.GROUP] >> gen.LANE_BITS * (i % gen.GROUP) & mask)
             - len(codes) * gen.LANE_BIAS) % 2**64 for i in range(k)]  # fmt: skip


def _exact(codes: np.ndarray, signs: np.ndarray) -> list[int]:
    values = np.where(codes > 0, 2 ** np.maximum(codes - 1, 0).astype(object), 0)
    return [int(s) % 2**64 for s in np.where(signs == 1, -values, values).sum(axis=0)]


def test_generated_lane_sums_are_the_exact_sums_of_the_codes() -> None:
    """``store`` then ``add``, executed as written, leave each lane's exact signed sum of the
    workers' NC8 integers (``ncina.proto.nc8``'s ``+-2^(code - 1)``) in 64-bit two's complement,
    for every uplink code (0..63) and sign, and with the most workers all at the top code of
    one sign (no lane carries into its neighbour: gen.LANE_BITS); and each of CheckCodes' window
    checks (the groups' sums, the narrow parser's code mask) refuses exactly the packets with a
    code above the window."""
    k = 12  # a group and a part of one
    text = gen.lanes_p4(k)
    rng = np.random.default_rng(7)
    for round_ in range(6):
        codes = rng.integers(0, 64, (WORKERS, k))
        codes[0] = np.arange(round_ * k, (round_ + 1) * k) % 64  # every code
        signs = rng.integers(0, 2, (WORKERS, k))
        assert _lane_sums(text, k, codes, signs) == _exact(codes, signs)
    for sign in (0, 1):
        codes = np.full((MAX_WORKERS, k), 63)
        signs = np.full((MAX_WORKERS, k), sign)
        signs[:, 0] = 1 - sign  # its neighbour the other way
        assert _lane_sums(text, k, codes, signs) == _exact(codes, signs)

    check = text[text.index("control CheckCodes"):text.index("control LaneSums")]
    groups = re.search(r"meta\.bad_code = \((.*)\) != 0 \? 1w1 : 1w0;", check).group(1)
    groups = _slices(re.sub(r"\b\d+w(?=0x)", "", groups))
    mask = re.search(r"meta\.bad_code = (\(meta\.codes_seen.*?) \? 1w1\s+: 1w0;", check, re.S)
    mask = re.sub(r"\(bit<\d+>\)", "", " ".join(mask.group(1).split()))
    for max_code in (1, 20, 62, 63):
        for top in (max_code - 1, max_code, max_code + 1):
            fields = _Fields()
            fields.meta.max_code = max_code
            fields.meta.code_room = (127 - max_code) * 0x0101010101010101
            for place in range(k):  # the top code in each lane, the others at most max_code
                lanes = rng.integers(0, max_code + 1, 2 * gen.GROUP) | rng.integers(0, 2, 16) << 7
                lanes[place] = top | rng.integers(0, 2) << 7
                fields.hdr.codes = [_Fields(v=int.from_bytes(bytes(lanes[g:g + 8].tolist()),
                                                              "big")) for g in (0, 8)]
                assert (eval(groups, {}, fields) != 0) == (top > max_code), (max_code, top)
            fields.meta.codes_seen = 0
            for code in (0, top, 1):  # as the parser sets it, lane by lane
                fields.meta.codes_seen |= 1 << code
            assert eval(mask, {}, fields) == (top > max_code), (max_code, top)


def test_a_compile_is_announced_with_a_building_line_and_an_up_to_date_build_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 37: the aggregator's log gets a ``BUILDING`` line before a compile (its
    ``wait_ready`` does not count the compile against the start: test_bmv2_control) and one
    line after; a build found up to date says nothing."""
    from ncina.aggregator.process import BUILDING

    monkeypatch.setenv("NCINA_P4C", str(_fake_p4c(tmp_path / "p4c", WRITE_OUTPUTS)))
    lines: list[str] = []
    toolchain.build(8, tmp_path / "k8", announce=lines.append)
    first, after = lines
    assert first == f"{BUILDING}compiling p4/ncina.p4 K=8 into {tmp_path / 'k8'}", lines
    assert not after.startswith(BUILDING) and after.startswith("compiling p4/ncina.p4 K=8")
    toolchain.build(8, tmp_path / "k8", announce=lines.append)
    assert len(lines) == 2
