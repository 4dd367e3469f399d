"""The Tofino program (p4/tofino/, docs/tofino.md): its generated parts everywhere, its compile
and fit with p4c-barefoot where that is installed (skipped with the reason otherwise).

The compile is done once per session, at the smallest useful K (4: every lane step appears
more than once), in a temporary folder.
"""

from __future__ import annotations

import json
import re
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest
from ncina.aggregator.backends.bmv2 import layout
from ncina.aggregator.backends.bmv2.toolchain import ToolchainError
from ncina.aggregator.backends.tofino import gen as gen_tofino
from ncina.aggregator.backends.tofino import toolchain as tofino
from ncina.proto import nc8
from ncina.proto.profiles import TOFINO_MAX_CODE, TOFINO_MAX_K, TOFINO_MAX_WORKERS, TOFINO_NC8_MAX_K

SMALL_K = 4


def test_decode_entries_are_the_codes_integers() -> None:
    """Each decode table maps a byte to what the reference adds: +-2^(code - 1) (two's
    complement in 32 bits), for every code a 32-bit lane decodes."""
    entries = gen_tofino.decode_entries()
    codes = np.array([sign << 7 | code for sign, code, _ in entries], dtype=np.uint8)
    want = nc8.codec("numpy").codes_to_int(codes)
    got = [value - (1 << 32) if value >> 31 else value for _, _, value in entries]
    assert got == want.tolist()
    assert len(entries) == 2 * (TOFINO_MAX_CODE + 1)


def _first_match(flags: dict[str, int]) -> str:
    """What Admission.verdicts answers for ``flags`` (every other key field 0)."""
    for fields, action in gen_tofino.VERDICT_ROWS:
        if all(flags.get(name, 0) == value for name, value in fields.items()):
            return action
    return "accept"


@pytest.mark.parametrize(
    ("flags", "event"),
    [
        ({"truncated": 1, "f_len": 1}, "EV_G_TRUNCATED"),
        ({"f_format": 1, "f_len": 1}, "EV_G_BAD_FORMAT"),  # no job: global, format first
        ({"job_hit": 1, "f_count0": 1, "f_len": 1}, "EV_BAD_COUNT"),
        ({"job_hit": 1, "handshake": 1, "tag": 1}, "STATUS_NOT_AUTHENTIC"),
        ({"job_hit": 1, "tag": 1, "result": 1, "f_rank": 1}, "EV_BAD_TAG"),
        ({"job_hit": 1, "f_rank": 1, "f_emin": 1}, "EV_NON_MEMBER"),
        ({"job_hit": 1, "f_emin": 1, "f_slot": 1}, "EV_WINDOW_MISMATCH"),
        ({"job_hit": 1, "f_generation": 1, "generation": 3}, "EV_STALE_GENERATION"),
        ({"job_hit": 1, "f_generation": 1, "generation": 0}, "EV_BAD_FLAGS"),
        ({"job_hit": 1, "codes_bad": 1}, "EV_BAD_CODE"),
        ({"job_hit": 1, "generation": 3}, "accept"),
    ],
)
def test_verdict_rows_pick_the_first_failed_check(flags: dict[str, int], event: str) -> None:
    assert event in _first_match(flags)


def test_generated_program_has_k_lanes_and_the_layouts_counters(tmp_path: Path) -> None:
    k = 6
    config, lanes = gen_tofino.write(k, tmp_path)
    text = config.read_text()
    defines = dict(re.findall(r"#define (\w+) (\S+)\n", text))
    assert int(defines["NCINA_K"]) == k
    assert int(defines["NCINA_MAX_WORKERS"]) == TOFINO_MAX_WORKERS
    for i, name in enumerate(layout.JOB_EVENTS):
        assert int(defines[f"EV_{name.upper()}"]) == i
    body = lanes.read_text()
    assert sorted({int(i) for i in re.findall(r"table decode_(\d+)", body)}) == list(range(k))
    assert sorted({int(i) for i in re.findall(r"sums_(\d+);", body)}) == list(range(k))
    # One action per count makes a result's first `count` lanes int lanes.
    for c in range(1, k + 1):
        widen = re.search(rf"action widen_{c}\(\) {{\n(.*?)\n    }}", body, re.S)
        assert widen and widen.group(1).count("setValid()") == c
    assert f"hdr.lanes[{k - 1}]" in text and f"hdr.lanes[{k}]" not in text  # parser states


def test_dense_window_rows_refuse_codes_above_the_window_as_the_default_check_does() -> None:
    """The dense window check's ternary rows, for every code magnitude and every code_offset
    byte: a row matches exactly when the default layout's check (code + code_offset has bit 7
    set) says above, for the codes a 32-bit lane decodes and the offsets a job has (below 128,
    where that 8-bit sum cannot wrap); codes above MAX_CODE always, code 0 never, any other
    code for an offset of 128 or more."""
    rows = gen_tofino.window_rows()
    for offset in range(256):
        for code in range(128):
            hit = any(offset & om == ov and code & cm == cv for (ov, om), (cv, cm) in rows)
            if code > TOFINO_MAX_CODE:
                want = True
            elif offset >= 128:
                want = code != 0
            else:
                want = code != 0 and (code + offset) >> 7 & 1 == 1
            assert hit == want == gen_tofino.code_above_window(code, offset), (offset, code)


@pytest.mark.parametrize(("lo", "hi"), [(0, 127), (1, 31), (32, 127), (5, 5), (3, 17), (97, 126)])
def test_ternary_cover_matches_exactly_the_range(lo: int, hi: int) -> None:
    rows = gen_tofino.ternary_cover(lo, hi, 7)
    for x in range(128):
        assert sum(x & mask == value for value, mask in rows) == (lo <= x <= hi), x


def test_dense_layout_adds_lane_pairs_in_one_register(tmp_path: Path) -> None:
    """The dense layout: K/2 pair registers, pair j adding lanes j (lo) and j + K/2 (hi) in one
    register action; the decoded integer is written into the lane's int32 result, which the
    parser made valid with the lane; Tofino 1 reads the upper sums in the harvest pass."""
    k = 18
    config, lanes = gen_tofino.write(k, tmp_path, dense=True)
    text, body = config.read_text(), lanes.read_text()
    assert "#define NCINA_DENSE 1" in text and f"#define NCINA_LANE_PAIRS {k // 2}" in text
    assert "lane_values_t" not in text  # no 32-bit metadata per lane
    for i in range(k):
        assert f"pkt.extract(hdr.lanes[{i}]); hdr.sums[{i}].setValid();" in text
        assert f"hdr.sums[{i}].value = v;" in body
    assert len(re.findall(r"Register<lane_pair_t, bit<16>>\(NCINA_SLOTS, \{0, 0\}\) sums_\d+;",
                          body)) == k // 2  # fmt: skip
    for j in range(k // 2):
        add = re.search(rf"\) add_{j} = {{.*?\n    }};", body, re.S)
        assert add and f"value.lo + hdr.sums[{j}].value" in add.group(0)
        assert f"value.hi + hdr.sums[{j + k // 2}].value" in add.group(0)
        assert f"hdr.sums[{j + k // 2}].value = harvest_{j}.execute(meta.slot_index);" in body
        assert f"(VERDICT_HARVEST, _, _, _, _, _): do_harvest_{j}();" in body
        # No pins (they made the compile run for hours): placed before the replies.
        assert f"@placement_priority(1)\n    table pair_{j} {{" in body
    assert "@stage(" not in body
    # The window check: a ternary table per GROUP lanes, each its own bad_code flag, each a
    # verdict row of its own (bad_code, after every other check).
    groups = -(-k // gen_tofino.GROUP)
    assert len(re.findall(r"table codes_\d+ \{", body)) == groups
    verdicts = re.search(r"#define VERDICT_ENTRIES (.*)\n", text).group(1)
    assert verdicts.count("EV_BAD_CODE") == groups
    with pytest.raises(ValueError, match="even"):
        gen_tofino.write(5, tmp_path, dense=True)



def test_lanes_are_header_stacks_of_at_most_32(tmp_path: Path) -> None:
    """A header stack's validity bits take one PHV container (32 bits): K = 40 in one stack
    did not compile (codes, and the dense layout's int32 results), so lanes from 32 on are
    further stacks, parsed, read, written and emitted in lane order; up to 32, one stack."""
    k = 40
    config, lanes = gen_tofino.write(k, tmp_path, dense=True)
    text, body = config.read_text(), lanes.read_text()
    assert "#define NCINA_LANE_HEADERS lane_h[32] lanes; lane_h[8] lanes1;" in text
    assert "#define NCINA_EMIT_LANES pkt.emit(hdr.lanes); pkt.emit(hdr.lanes1);" in text
    assert "#define NCINA_SUM_HEADERS sum_lane_h[32] sums; sum_lane_h[8] sums1;" in text
    assert "#define NCINA_EMIT_SUMS pkt.emit(hdr.sums); pkt.emit(hdr.sums1);" in text
    for i in range(k):
        s, n = ("", i) if i < 32 else ("1", i - 32)
        assert gen_tofino.sum_lane(i) == f"hdr.sums{s}[{n}]"
        assert gen_tofino.code_lane(i) == f"hdr.lanes{s}[{n}]"
        assert f"pkt.extract(hdr.lanes{s}[{n}]); hdr.sums{s}[{n}].setValid();" in text
        assert f"state parse_sum_{i} {{ pkt.extract(hdr.sums{s}[{n}]);" in text
        assert f"hdr.sums{s}[{n}].value = v;" in body
        assert f"key = {{ hdr.lanes{s}[{n}].code: exact; }}" in body
        assert f'hdr.lanes{s}[{n}].code[6:0]: ternary @name("code_{i}");' in body
    assert "value.hi + hdr.sums1[4].value" in body  # pair 16: lanes 16 and 36
    assert not re.search(r"(lanes|sums)1?\[(3[2-9]|[4-9]\d)\]", text + body)
    one = gen_tofino.config_p4(32, dense=True)
    assert "#define NCINA_LANE_HEADERS lane_h[32] lanes;\n" in one and "lanes1" not in one


def _p4_constants() -> dict[str, int]:
    text = (Path(__file__).parent.parent / "p4" / "tofino" / "headers.p4").read_text()
    return {name: int(value, 0) for name, value in
            re.findall(r"const bit<\d+> (\w+) = (\w+);", text)}  # fmt: skip


def _slot_decision(relation: int, there_incomplete: int, here_incomplete: int,
                   seen_there: int, seen_here: int) -> str | None:  # fmt: skip
    """The lanes' work that Slots' decision (p4/tofino/slots.p4) sets, for the tallies."""
    c = _p4_constants()
    if relation == c["OFFSET_NEWER"]:
        return None if there_incomplete else "first"
    if relation == c["OFFSET_SAME"]:
        if not here_incomplete:
            return None if seen_there else "read"  # late (L3), or the result again
        return None if seen_here else "add"  # a duplicate, or a contribution
    return None  # older (late), or the slot rules never ran (relation 0)


@pytest.mark.parametrize("twin", [False, True], ids=["tna", "twin"])
def test_dense_pair_rows_do_what_the_slot_decision_decides(twin: bool, tmp_path: Path) -> None:
    """Each pair's table is keyed on the decision's inputs (so that the pairs need not wait a
    stage for its answer): for every verdict, relation, completeness of both versions and
    rank seen or not, the generated const entries (first match) pick the operation the
    decision's lane_op names, the harvest row the upper sums (the TNA program on Tofino 1; the
    v1model twin has no harvest pass), and nothing otherwise."""
    c = _p4_constants()
    if twin:
        text = gen_tofino.twin_lanes_p4(4)
    else:
        text = gen_tofino.write(4, tmp_path, dense=True)[1].read_text()
    table = re.search(r"table pair_1 \{.*?\n    \}\n", text, re.S).group(0)
    keys = re.findall(r"(\S+): ternary @name", table)
    assert keys == [field for field, _, _ in gen_tofino.PAIR_KEY]
    assert "meta.lane_op" not in keys  # the decision's answer: a stage later
    entries = re.findall(r"\(([^()]*)\): do_(\w+)_1\(\);", table)
    assert len(entries) == len(gen_tofino.PAIR_ROWS) + (not twin)
    rows = [([None if v == "_" else c.get(v, None) if v in c else int(v)
              for v in values.split(", ")], op) for values, op in entries]  # fmt: skip
    rank_bit = 1 << 7
    verdicts = (c["VERDICT_ACCEPT"], c["VERDICT_DROP"], c["VERDICT_STALE"], c["VERDICT_HARVEST"])
    relations = (0, c["OFFSET_OLDER"], c["OFFSET_NEWER"], c["OFFSET_SAME"])
    seen = (0, rank_bit)
    checked = 0
    for verdict in verdicts:
        for relation in relations:
            if verdict != c["VERDICT_ACCEPT"] and relation:
                continue  # the slot rules run for accepted packets only
            for there, here, seen_there, seen_here in np.ndindex(2, 2, 2, 2):
                key = (verdict, relation, there, here, seen[seen_there], seen[seen_here])
                got = next((op for values, op in rows if all(
                    v is None or v == x for v, x in zip(values, key, strict=True))), None)
                if verdict == c["VERDICT_HARVEST"]:
                    want = None if twin else "harvest"
                else:
                    want = _slot_decision(relation, there, here, seen[seen_there],
                                          seen[seen_here])  # fmt: skip
                assert got == want, key
                checked += 1
    assert checked == (len(relations) + len(verdicts) - 1) * 16


@pytest.fixture(scope="session")
def small_build() -> tuple[tofino.Resources, Path]:
    """The K = 4 build for Tofino and its folder (compiled once per session)."""
    reason = tofino.missing()
    if reason:
        pytest.skip(reason)
    # The default folder (build/p4-tofino/): the suite's P4 warm-up (tests/p4_warmup.py) may
    # have compiled it already, from the same sources (their digest decides, as for a user).
    directory = tofino.BUILD_DIR / f"tofino-k{SMALL_K}"
    try:
        return tofino.build(SMALL_K, "tofino"), directory
    except ToolchainError as exc:
        pytest.fail(str(exc))


def test_program_compiles_and_fits_tofino(small_build: tuple[tofino.Resources, Path]) -> None:
    res, _ = small_build
    assert res.fits, res.line()
    assert 1 <= res.stages <= tofino.STAGES["tofino"]
    # One stateful ALU per register: offsets, held, mirror and one per lane (members and
    # counters take none).
    assert res.stateful_alus == SMALL_K + 3
    assert 0 < res.phv_bits <= res.phv_capacity
    assert res.sram_blocks > 0 and res.tcam_blocks > 0


def test_dense_layout_compiles_and_fits_tofino() -> None:
    """The dense layout (pair registers, int32 results, the harvest pass through the
    recirculation port) at K = 4, compiled for Tofino (about a minute): it fits, with one
    stateful ALU per pair register (offsets, held, mirror and K/2 pairs). Its K = 32 build
    takes about 15 minutes (3.5 for Tofino 2; docs/tofino.md, "Density"): not run here."""
    reason = tofino.missing()
    if reason:
        pytest.skip(reason)
    try:
        res = tofino.build(SMALL_K, "tofino", dense=True)  # build/p4-tofino/, as above
    except ToolchainError as exc:
        pytest.fail(str(exc))
    assert res.fits and res.dense, res.line()
    assert res.stateful_alus == SMALL_K // 2 + 3


def test_build_is_reused_and_reports_the_same(
    small_build: tuple[tofino.Resources, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    res, directory = small_build
    # Up to date: the compiler is not run again (a missing one would be an error).
    monkeypatch.setattr(tofino, "missing", lambda: "must not compile")
    assert tofino.build(SMALL_K, "tofino", directory) == res


def test_missing_compiler_is_one_sentence(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("NCINA_P4C_TOFINO", "/nonexistent/p4c-barefoot")
    assert tofino.main(["--k", "4", "--force"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "p4c-barefoot is not installed" in err


def test_make_p4_tofino_builds_the_dense_layout_whose_fit_is_committed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``make p4-tofino`` (the toolchain without a layout or K) builds the dense layout at
    DENSE_K lanes, ``--one-per-lane`` at 12; the committed fit report of that build fits
    Tofino's 12 stages with a stateful ALU per pair (K/2 + 3), every pair after the tallies."""
    calls = []

    def build(k: int, target: str, **kwargs: bool) -> tofino.Resources:
        calls.append((k, target, kwargs["dense"]))
        raise ToolchainError("not compiled here")

    monkeypatch.setattr(tofino, "build", build)
    assert tofino.main([]) == 1 and tofino.main(["--one-per-lane"]) == 1
    assert calls == [(tofino.DENSE_K, "tofino", True), (tofino.DEFAULT_K, "tofino", False)]
    capsys.readouterr()
    k = tofino.DENSE_K
    report = json.loads((tofino.REPORTS / tofino.report_name(k, "tofino", True)).read_text())
    res = report["resources"]
    assert report["fits"] and res["k"] == k and res["dense"]
    assert res["stages"] <= res["device_stages"] == tofino.STAGES["tofino"]
    assert res["stateful_alus"] == k // 2 + 3
    tallies = next(s["stage"] for s in report["stages"] if "slots.tallies" in s["tables"])
    pairs = {t: s["stage"] for s in report["stages"] for t in s["tables"] if "pair_" in t}
    assert sorted(pairs) == sorted(f"sums.pair_{j}" for j in range(k // 2))
    assert min(pairs.values()) > tallies


def test_the_committed_two_pass_report_fits_64_elements_in_12_stages() -> None:
    """The committed fit report of ``make p4-tofino TOFINO_K=64`` (two passes, CI compiles it
    after the suite: .ci/run) fits Tofino's 12 stages with the design's stages in the order
    docs/tofino.md gives: the 16 paired decode tables where DECODE_STAGES pins them, all before
    the slot rules' first table and the window check whole before ``verdicts``; a stateful ALU
    per pair (REGION / 2) and for the offsets, held and mirror registers; every pair after the
    tallies."""
    k = tofino.PASSES_K
    report = json.loads((tofino.REPORTS / tofino.report_name(k, "tofino", True, passes=2))
                        .read_text())  # fmt: skip
    res = report["resources"]
    assert report["fits"] and res["k"] == k and res["dense"] and res["passes"] == 2
    assert res["stages"] <= res["device_stages"] == tofino.STAGES["tofino"]
    assert res["stateful_alus"] == gen_tofino.REGION // 2 + 3
    stage = {t.split(".")[-1]: s["stage"] for s in report["stages"] for t in s["tables"]}
    for m in range(gen_tofino.REGION // 2):
        assert stage[f"decode_{m}"] == gen_tofino.DECODE_STAGES[m // gen_tofino.DECODE_PER_STAGE]
    first_rule = min(stage[t] for t in stage if t.startswith("tbl_slots"))
    assert max(stage[f"decode_{m}"] for m in range(gen_tofino.REGION // 2)) < first_rule
    window = [stage[t] for t in stage if re.fullmatch(r"codes_\d+", t)]
    assert window and max(window) < stage["verdicts"] < first_rule
    pairs = [stage[f"pair_{j}"] for j in range(gen_tofino.REGION // 2)]
    assert min(pairs) > stage["tallies"]


# --- the v1model twin (p4/twin/, docs/tofino.md "The v1model twin") ---------------------------

P4 = Path(__file__).resolve().parent.parent / "p4"


def _between(text: str, start: str, end: str) -> str:
    return text[text.index(start):text.index(end, text.index(start))]


def test_the_twins_slot_rules_are_the_tna_programs_text() -> None:
    """From the slot actions to the tallies' decisions, p4/twin/slots.p4 is p4/tofino/slots.p4
    character for character: only the register accesses are written for v1model."""
    tna, twin = ((P4 / d / "slots.p4").read_text() for d in ("tofino", "twin"))
    actions = ("    action late() {", "    apply {")
    assert _between(tna, *actions) == _between(twin, *actions)
    rules = ("        tallies.apply();", "\n}\n")
    assert _between(tna, *rules) == _between(twin, *rules)


@pytest.mark.parametrize("k", [2, 8, TOFINO_MAX_K])
def test_the_twin_generates_the_dense_tna_programs_tables(k: int) -> None:
    """The twin's config.p4 is the dense TNA program's, and its CheckCodes (exact decode tables
    into the int32 lanes, the window check per 8 lanes) too but for the validity keys, which
    BMv2 takes as a bit<1>; its pair registers are k/2 64-bit cells, each pair's table has the
    TNA program's key and rows (but for the harvest pass's) and its actions the TNA register
    actions' bodies, lanes j (lo) and j + k/2 (hi); the twin takes K up to the lanes one
    Tofino pass holds, an odd K's jobs on the build for K + 1."""
    def check_codes(text: str) -> str:
        body = _between(text, "control CheckCodes", "\n}\n")
        body = re.sub(r"\(bit<1>\)(hdr\.lanes\[\d+\]\.isValid\(\)): ternary @name\(\"valid_\d+\"\)",
                      r"\1: ternary", body)  # fmt: skip
        return body.replace("1w1, 7w0x", "true, 7w0x")

    tna, twin = gen_tofino.lanes_p4(k, dense=True), gen_tofino.twin_lanes_p4(k)
    assert check_codes(twin) == check_codes(tna) and "1w1, 7w0x" in twin
    pairs = k // 2
    assert len(re.findall(r"register<bit<64>, bit<32>>\(NCINA_SLOTS\) sums_\d+;", twin)) == pairs
    def table(text: str, j: int) -> tuple[list[str], list[tuple[str, str]]]:
        body = re.search(rf"table pair_{j} \{{.*?\n    \}}\n", text, re.S).group(0)
        return (re.findall(r"(\S+): ternary @name", body),
                re.findall(rf"\(([^()]*)\): do_(\w+)_{j}\(\);", body))  # fmt: skip

    for j in range(pairs):
        (tna_keys, tna_rows), (twin_keys, twin_rows) = table(tna, j), table(twin, j)
        assert twin_keys == tna_keys and twin_rows == [r for r in tna_rows if r[1] != "harvest"]
        for name in ("first", "add", "read"):
            tna_body = re.search(rf"\) {name}_{j} = {{.*?\n    }};", tna, re.S).group(0)
            twin_body = re.search(rf"action do_{name}_{j}\(\) {{.*?\n    }}", twin, re.S).group(0)
            for line in re.findall(r"value\.(?:lo|hi) = .*;", tna_body):
                assert line in twin_body
            assert f"hdr.sums[{j}].value = value.lo;" in twin_body
            assert f"hdr.sums[{j + pairs}].value = value.hi;" in twin_body
    assert f"value.hi + hdr.sums[{pairs}].value" in twin
    assert gen_tofino.twin_k(7) == 8 and gen_tofino.twin_k(TOFINO_MAX_K) == TOFINO_MAX_K
    with pytest.raises(ValueError, match=f"at most {TOFINO_MAX_K}"):
        gen_tofino.check_twin_k(TOFINO_MAX_K + 1)


def test_the_generated_nc8_recompression_is_the_reference_codecs() -> None:
    """NC8 results of the Tofino design (``lanes_p4(nc8=True)``, egress ``Recompress``) and its
    twin: the generated highest-set-bit rows and shifts, the lane constants xored into the
    rounding word and the saturating compare, run here step by step on 32-bit sums, give
    ``ncina.proto.nc8``'s codes for every lane, key and sum within +-2^31 (the twin's tables
    are the TNA program's text, for the TOFINO_NC8_MAX_K lanes a nc8 job may have)."""
    k = 8
    tna, twin = gen_tofino.lanes_p4(k, nc8=True), gen_tofino.twin_lanes_p4(k)
    table = re.compile(r"table high_\d+ \{.*?\n    \}", re.S)
    generic = re.sub(r"hdr\.wide\[\d+\]\.low", "magnitude", tna)
    tables = {m.group(0) for m in table.finditer(generic)}
    assert len(tables) == k
    # the twin re-compresses TOFINO_NC8_MAX_K lanes (a nc8 job of more is refused)
    assert {t for t in tables if int(re.match(r"table high_(\d+)", t).group(1))
            < TOFINO_NC8_MAX_K} == {m.group(0) for m in table.finditer(twin)}  # fmt: skip
    assert k > TOFINO_NC8_MAX_K and "high_7" not in twin
    rows = [(int(value, 16), int(mask, 16), int(h)) for value, mask, h in re.findall(
        r"32w0x([0-9A-F]{8}) &&& 32w0x([0-9A-F]{8}): high_0_(\d+)\(\)", tna)]  # fmt: skip
    assert len(rows) == 32
    terms = {int(i): int(c, 16) for i, c in re.findall(
        r"hdr\.wide\[(\d+)\]\.high = meta\.key \^ 32w0x([0-9A-F]{8});", tna)}  # fmt: skip
    assert sorted(terms) == list(range(k))

    def switch_code(total: int, lane: int, key: int) -> int:
        sign = 0x80 if total < 0 else 0
        magnitude = abs(total)
        hits = [h for value, mask, h in rows if magnitude & mask == value]
        if not hits:
            return sign  # |S| = 0 (0x00)
        [h] = hits
        threshold = 0 if h == 0 else (magnitude << (32 - h)) & 0xFFFFFFFF
        word = key ^ terms[lane]
        return sign | (h + 1 + (max(threshold - word, 0) != 0))

    rng = np.random.default_rng(33)
    codec = nc8.codec("numpy")
    for _ in range(40):
        key = int(rng.integers(0, 2**32))
        bits = rng.integers(0, 32, k)
        sums = np.array([int(rng.integers(-(1 << b), 1 << b)) for b in bits], dtype=np.int64)
        sums[0], sums[1] = (1 << 30) if _ % 2 else -(1 << 30), 0  # the cap, and zero
        want = codec.recompress(sums, key)
        assert [switch_code(int(s), i, key) for i, s in enumerate(sums)] == list(want)


def _crc(poly: gen_tofino.CrcPolynomial, data: bytes) -> int:
    """The CRC of ``data`` that ``poly``'s parameters define, bit by bit (most significant bit
    first; ``reversed``: each input byte and the result reflected)."""
    def reflect(value: int, bits: int) -> int:
        return int(f"{value:0{bits}b}"[::-1], 2)

    assert not poly.msb and not poly.extended  # a 32-bit coefficient, x^32 implied
    register = poly.init
    for byte in data:
        register ^= (reflect(byte, 8) if poly.reversed else byte) << 24
        for _ in range(8):
            top = register & 0x80000000
            register = (register << 1) & 0xFFFFFFFF
            if top:
                register ^= poly.coeff
    return (reflect(register, 32) if poly.reversed else register) ^ poly.xor


def test_the_nc8_rounding_word_is_zlibs_crc32_by_construction() -> None:
    """The build with NC8 results declares its CRC-32 (``HashAlgorithm_t.CUSTOM`` with an
    explicit ``CRCPolynomial``, the installed headers' argument order), and those parameters
    compute zlib's CRC-32: what every backend's rounding word is (``ncina.proto.nc8``)."""
    poly = gen_tofino.ROUNDING_CRC
    text = "\n".join(gen_tofino.recompress_p4(2))
    declared = re.search(r"CRCPolynomial<bit<32>>\((32w0x\w+), (\w+), (\w+), (\w+), "
                         r"(32w0x\w+), (32w0x\w+)\) crc32;", text)  # fmt: skip
    assert declared, text
    values = [int(v[3:], 16) if v.startswith("32w") else v == "true" for v in declared.groups()]
    assert gen_tofino.CrcPolynomial(*values) == poly
    assert "Hash<bit<32>>(HashAlgorithm_t.CUSTOM, crc32) crc;" in text
    assert "HashAlgorithm_t.CRC32" not in text
    rng = np.random.default_rng(4)
    for n in (0, 1, 4, 25, 100):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert _crc(poly, data) == zlib.crc32(data)
    assert _crc(poly, b"123456789") == 0xCBF43926  # CRC-32's check value
    assert _crc(poly._replace(reversed=False), b"123456789") == 0xFC891918  # not BZIP2's


def test_make_p4_tofino_nc8_builds_the_nc8_results_variant_whose_fit_is_committed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``make p4-tofino TOFINO_NC8=1`` (the toolchain's ``--nc8``) builds one register per lane
    with NC8 results at TOFINO_NC8_MAX_K lanes, not the dense layout; its committed fit report
    (``tofino-k7-nc8.json``) fits Tofino's 12 stages with egress's per-lane tables for every
    lane (highest set bit, round-up bit)."""
    calls = []

    def build(k: int, target: str, **kwargs: bool) -> tofino.Resources:
        calls.append((k, target, kwargs["dense"], kwargs["nc8"]))
        raise ToolchainError("not compiled here")

    monkeypatch.setattr(tofino, "build", build)
    assert tofino.main(["--nc8"]) == 1 and tofino.main(["--nc8", "--k", "8"]) == 1
    assert calls == [(TOFINO_NC8_MAX_K, "tofino", False, True), (8, "tofino", False, True)]
    with pytest.raises(SystemExit):
        tofino.main(["--nc8", "--dense"])
    capsys.readouterr()
    name = tofino.report_name(TOFINO_NC8_MAX_K, "tofino", False, nc8=True)
    assert name == "tofino-k7-nc8.json"
    report = json.loads((tofino.REPORTS / name).read_text())
    res = report["resources"]
    assert report["fits"] and res["nc8"] and not res["dense"] and res["k"] == TOFINO_NC8_MAX_K
    assert res["stages"] <= res["device_stages"] == tofino.STAGES["tofino"]
    tables = {t for s in report["stages"] for t in s["tables"]}
    for step in ("high", "round"):
        assert {t for t in tables if t.startswith(f"recompress.{step}_")} == {
            f"recompress.{step}_{i}" for i in range(TOFINO_NC8_MAX_K)}


# --- the member digest (docs/tofino.md "How the twin learns members") -------------------------


def _preprocessed(tmp_path: Path, dense: bool, nc8: bool, k: int = 0, passes: int = 1) -> str:
    """p4/tofino/ncina.p4 through the C preprocessor as p4c-barefoot sees it for Tofino, with
    the generated config.p4 and lanes.p4 (K ``k``, default 12, or 32 dense; ``passes``) and
    empty stand-ins for core.p4 and tna.p4."""
    gen_tofino.write(k or (32 if dense else 12), tmp_path, dense, nc8, passes)
    for stub in ("core.p4", "tna.p4", "t2na.p4"):
        (tmp_path / stub).write_text("")
    return subprocess.run(
        ["cpp", "-P", "-nostdinc", "-undef", "-D__TARGET_TOFINO__=1", "-I", str(tmp_path),
         str(tofino.SOURCE_DIR / tofino.MAIN)], check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip


def _block(text: str, opening: str) -> str:
    """The braced body that follows ``opening`` (a regular expression) in ``text``."""
    found = re.search(opening, text)
    assert found, opening
    start = text.index("{", found.end())
    depth = 0
    for end in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth == 0:
            return text[start + 1:end]
    raise AssertionError(f"unbalanced braces after {opening}")


def _writes(body: str, field: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(field)}\s*=(?!=)", body) is not None


@pytest.mark.parametrize(("dense", "nc8"), [(True, False), (False, False), (False, True)])
def test_the_member_digest_packs_the_packets_own_source_not_replys(
    tmp_path: Path, dense: bool, nc8: bool
) -> None:
    """The ingress deparser packs the member digest after the whole ingress control ran, Reply
    included, which rewrites the source address of a packet that is answered (the one that
    completes a slot: a job's last rank in its first round). Every field packed must be the
    packet's as it came in: a header field no ingress control writes, or metadata copied once
    from the packet's field by an action whose table is applied before any control that writes
    that field. (Packing hdr.eth.src, hdr.ipv4.src and hdr.udp.src_port reported such a rank
    with the aggregator's own address.)"""
    text = _preprocessed(tmp_path, dense, nc8)
    deparser = _block(text, r"control NcinaIngressDeparser\b")
    packed = re.search(r"\.pack\(\{(.*?)\}\)", deparser, re.S)
    assert packed
    fields = [f.strip() for f in packed.group(1).split(",")]
    ingress = _block(text, r"control NcinaIngress\(")
    apply = _block(ingress, r"\n    apply ")
    controls = {name: _block(text, rf"control {name}\(")
                for name in re.findall(r"\ncontrol (\w+)\(", text)}  # fmt: skip

    def instances(body: str) -> dict[str, str]:
        return {i: c for c, i in re.findall(r"\b(\w+)\(\) (\w+);", body) if c in controls}

    def written(control: str, field: str) -> bool:
        """Whether ``control``, or a control it applies, writes ``field``."""
        body = controls[control]
        return _writes(body, field) or any(written(c, field) for c in instances(body).values())

    def writers(field: str) -> list[int]:
        """Where the ingress control's apply block applies a control that writes ``field``."""
        return [m.start() for i, c in instances(ingress).items() if written(c, field)
                for m in re.finditer(rf"\b{i}\.apply\(", apply)]  # fmt: skip

    sources = []
    for field in fields:
        if not field.startswith("meta."):
            assert not writers(field) and not _writes(ingress, field), (
                f"{field} is packed after ingress rewrote it")
            sources.append(field)
            continue
        copies = re.findall(rf"(?<![\w.]){re.escape(field)}\s*=\s*([\w.]+);", text)
        assert len(copies) == 1 and copies[0].startswith("hdr."), (field, copies)
        action = re.search(rf"action (\w+)\([^)]*\) {{[^}}]*?{re.escape(field)}\s*=", ingress)
        assert action, f"{field} is not copied by an action of the ingress control"
        table = re.search(rf"table (\w+) {{[^}}]*?actions = {{[^}}]*\b{action.group(1)}\b",
                          ingress)  # fmt: skip
        assert table, action.group(1)
        copied = apply.index(f"{table.group(1)}.apply()")
        assert all(copied < w for w in writers(copies[0])), f"{field} is copied too late"
        sources.append(copies[0])
    assert sources == ["hdr.nc.job", "hdr.nc.rank", "hdr.eth.src", "hdr.ipv4.src",
                       "hdr.udp.src_port"]  # fmt: skip


def _selected(select: str, values: tuple[str, ...]) -> str:
    """The state a parser ``select``'s rows (``_block``'s body) go to for ``values``, by
    their names (a row's ``_`` and ``default`` match anything)."""
    for keys, state in re.findall(r"\n\s*\(?([\w ,.]+?)\)?: (\w+);", select):
        row = [key.strip() for key in keys.split(",")]
        if row == ["default"] or all(k in ("_", v) for k, v in zip(row, values, strict=True)):
            return state
    raise AssertionError(f"no row of the select matches {values}")


@pytest.mark.parametrize(("dense", "k", "passes"), [(True, 32, 1), (True, 64, 2), (False, 12, 1)],
                         ids=["dense", "two-pass", "one-per-lane"])  # fmt: skip
def test_a_frame_switched_at_l2_leaves_with_the_headers_it_came_with(
    tmp_path: Path, dense: bool, k: int, passes: int
) -> None:
    """The parser takes any UDP datagram's first bytes as an ncina header and its lanes, and
    the dense layouts' parser makes each lane's int32 result header valid with it. A datagram
    between two hosts that looks like a chunk then left the switch with its codes replaced by
    4-byte integers (issue 33, found by reading: LaneSums invalidated the codes of anything
    sent, sums kept), and egress recomputed any switched frame's IPv4 checksum. Now (ncina.p4
    through cpp): both of Forward's actions invalidate every header the parser makes valid
    without extracting it; LaneSums trades codes for sums only on the aggregator's own
    datagrams; egress parses nothing of a switched frame (OUT_FORWARD, OUT_FLOOD) but the
    bridge, while a reply's IPv4 header is still parsed for its checksum. (The twin shares
    Forward and the parser's states: tests/test_switching.py sends such frames through it.)"""
    text = _preprocessed(tmp_path, dense, False, k, passes)
    parser = _block(text, r"parser NcinaIngressParser\(")
    made_valid = set(re.findall(r"(hdr\.\w+\[\d+\])\.setValid\(\);", parser))
    assert len(made_valid) == (gen_tofino.REGION if dense else 0)
    forward = _block(text, r"control Forward\(")
    for action in ("to_port", "flood"):
        body = _block(forward, rf"action {action}\(")
        assert set(re.findall(r"(hdr\.\w+\[\d+\])\.setInvalid\(\);", body)) == made_valid
    if dense:
        apply = _block(_block(text, r"control LaneSums\("), r"\n    apply ")
        ours = "meta.ours == 1" if passes == 1 else "meta.lane_op != LANE_NONE"
        assert re.search(rf"if \({re.escape(ours)}\) {{\s*as_sums\(\);\s*}}\s*$", apply)
    egress = _block(_block(text, r"parser NcinaEgressParser\("), r"state start ")
    select = _block(egress, r"transition select\(")
    wide = () if dense else ("0",)
    for send in ("OUT_FORWARD", "OUT_FLOOD"):
        assert _selected(select, (send, *wide)) == "accept"
    assert _selected(select, ("OUT_REPLY", *wide)) == "parse_frame"
    assert "hdr.ipv4.checksum = ipv4_checksum.update(" in text


# --- 64 elements per packet: two passes (docs/tofino.md, "64 elements per packet") -----------


def _parser_states(config: str) -> dict[str, tuple[list[str], str]]:
    """The generated parser states (config.p4's macros): name -> (the headers it extracts, in
    order, and its transition text)."""
    states = {}
    joined = re.sub(r" \\\n\s*", " ", config)
    pattern = r"state (\w+) \{ (.*?transition (?:select\([^)]*\) \{[^}]*\}|\w+;)) \}"
    for name, body in re.findall(pattern, joined):
        states[name] = (re.findall(r"pkt\.extract\(hdr\.(\w+(?:\[\d+\])?)\)", body),
                        body[body.index("transition"):])  # fmt: skip
    return states


def _walk(states: dict[str, tuple[list[str], str]], state: str, count: int) -> list[str]:
    """The headers the generated states extract from ``state`` on, for ``count`` lanes: a
    count select accepts at its value."""
    out: list[str] = []
    while state != "accept":
        extracted, transition = states[state]
        out += extracted
        if (m := re.match(r"transition select\(hdr\.nc\.count\) \{ (\d+): accept; "
                          r"default: (\w+); \}", transition)):  # fmt: skip
            state = "accept" if int(m.group(1)) == count else m.group(2)
        else:
            state = re.match(r"transition (\w+);", transition).group(1)
    return out


def test_two_passes_carry_64_lanes_to_one_result_in_lane_order(tmp_path: Path) -> None:
    """The two-pass layout at K = 64 (generated states; parser.p4 picks the first one: by the
    count from the wire, by the pass header's verdict from the recirculation port, which the
    test reads there): the first pass parses all
    the codes, lanes 0-31 as one block and 32-63 into `lanes` (decoded into `sums`); what each
    pass emits (config.p4's emit order, the headers it leaves valid) is what the next one
    parses: the second pass gets lanes 0-31's codes and 32-63's sums (`upper`), its harvest
    both regions' sums (`rest`, `sums`), the last harvest lanes 0-31 with 32-63 behind them as
    payload: the result is the count's int32 lanes in lane order, as the one-pass build gives
    two 32-lane chunks, for every count from 33 to 64; 32 lanes at most take one pass."""
    c = _p4_constants()
    assert (c["VERDICT_SECOND_FIRST"], c["VERDICT_SECOND_ADD"], c["VERDICT_SECOND_READ"]) == tuple(
        c["VERDICT_HARVEST"] + c[op] for op in ("LANE_FIRST", "LANE_ADD", "LANE_READ"))
    k, region = 2 * gen_tofino.REGION, gen_tofino.REGION
    config, _ = gen_tofino.write(k, tmp_path, dense=True, passes=2)
    text = config.read_text()
    defines = dict(re.findall(r"#define (\w+) (.*)\n", text))
    assert defines["NCINA_PASSES"] == "2" and defines["NCINA_LANE_PAIRS"] == "16"
    assert defines["NCINA_REGION"] == "32"
    assert defines["NCINA_LANE_HEADERS"] == "lane_h[32] lanes; code_block_h block;"
    assert defines["NCINA_SUM_HEADERS"] == (
        "sum_lane_h[32] sums; sum_lane_h[32] rest; sum_lane_h[32] upper;")
    assert re.search(r"header code_block_h \{\n(    bit<8> c\d+;\n){32}\}", text)
    emitted = re.findall(r"pkt\.emit\(hdr\.(\w+)\);",
                         defines["NCINA_EMIT_LANES"] + defines["NCINA_EMIT_SUMS"])  # fmt: skip
    states = _parser_states(text)

    def emit(valid: dict[str, list[str]]) -> list[str]:
        # The frame behind the ncina header: each valid header's lanes, in the emit order.
        return [lane for name in emitted for lane in valid.get(name, [])]

    parser = (Path(__file__).parent.parent / "p4" / "tofino" / "parser.p4").read_text()
    for verdict, first in (("VERDICT_HARVEST, 1 .. NCINA_K", "parse_sum_0"),
                           ("VERDICT_HARVEST_SECOND, _", "parse_rest_0"),
                           ("VERDICT_SECOND_FIRST .. VERDICT_SECOND_READ, _", "parse_low_lane_0"),
                           ):  # fmt: skip
        assert f"({verdict}): {first};" in parser
    assert "1 .. NCINA_REGION: parse_lane_0;" in parser and "default: parse_block;" in parser
    codes = [f"code{i}" for i in range(k)]
    sums = [f"sum{i}" for i in range(k)]
    for count in (33, 50, 64):
        high = count - region
        # Pass 1, from the wire: every code (the window check); lanes 32-63 decoded.
        assert _walk(states, "parse_block", count) == ["block"] + [
            f"lanes[{i}]" for i in range(high)]
        frame = emit({"block": codes[:region], "sums": sums[region:count]})
        # Pass 2 (VERDICT_SECOND_*): lanes 0-31's codes (decoded into `sums`), 32-63's sums.
        assert frame == codes[:region] + sums[region:count]
        assert _walk(states, "parse_low_lane_0", count) == [
            f"lanes[{i}]" for i in range(region)] + [f"upper[{i}]" for i in range(high)]
        frame = emit({"sums": sums[:region], "upper": frame[region:]})
        # Pass 3 (VERDICT_HARVEST_SECOND): both regions' sums; lanes 48-63 read.
        assert frame == sums[:count]
        assert _walk(states, "parse_rest_0", count) == [
            f"rest[{i}]" for i in range(region)] + [f"sums[{i}]" for i in range(high)]
        frame = emit({"rest": frame[:region], "sums": frame[region:]})
        # Pass 4 (VERDICT_HARVEST): lanes 0-31's sums (16-31 read); 32-63's stay payload.
        assert _walk(states, "parse_sum_0", count) == [f"sums[{i}]" for i in range(region)]
        frame = emit({"sums": frame[:region]}) + frame[region:]
        assert frame == sums[:count]
    # Up to 32 lanes a packet takes the one-pass build's path: lanes 0-31, their harvest.
    for count in (1, 20, 32):
        assert _walk(states, "parse_lane_0", count) == [f"lanes[{i}]" for i in range(count)]
        assert emit({"sums": sums[:count]}) == sums[:count]
        assert _walk(states, "parse_sum_0", count) == [f"sums[{i}]" for i in range(count)]
    for i in range(region):
        assert f"state parse_lane_{i} {{ pkt.extract(hdr.lanes[{i}]); hdr.sums[{i}].setValid();" \
            in text


def test_two_pass_paired_decode_gives_both_lanes_integers_for_every_byte() -> None:
    """The two-pass layout's decode tables, two lanes each (16 logical tables for 32 lanes):
    simulated as exact matches from the generated text for every pair of bytes, a table writes
    lane 2m's integer and lane 2m + 1's (``decode_entries``, the one-lane tables' rows) when
    lane 2m's byte is a decodable code, whatever lane 2m + 1's byte (an invalid last lane of an
    odd count holds any byte); a byte of lane 2m no row holds writes 0 (the window check drops
    its packet), as the one-lane table did."""
    body = gen_tofino.pass_lanes_p4(2 * gen_tofino.REGION)
    one_lane = {sign << 7 | code: value for sign, code, value in gen_tofino.decode_entries()}
    bits = gen_tofino.MAGNITUDE_BITS
    for m in (0, 5, 15):
        table = re.search(rf"    table decode_{m} \{{.*?\n    \}}\n", body, re.S).group(0)
        a, b = f"hdr.sums[{2 * m}].value", f"hdr.sums[{2 * m + 1}].value"
        assert re.search(rf"action set_w{m}\(bit<32> a, bit<32> b\) \{{\n\s+{re.escape(a)} = a;"
                         rf"\n\s+{re.escape(b)} = b;", body)  # fmt: skip
        assert f"hdr.lanes[{2 * m}].code: exact" in table
        assert f"hdr.lanes[{2 * m + 1}].code[7:7]: exact" in table
        assert f"hdr.lanes[{2 * m + 1}].code[{bits - 1}:0]: exact" in table
        assert f"default_action = set_w{m}(0, 0);" in table
        stage = gen_tofino.DECODE_STAGES[m // gen_tofino.DECODE_PER_STAGE]
        assert re.search(rf"@stage\({stage}\)\n    table decode_{m} ", body)
        rows = {}
        for key, data in re.findall(rf"\((8w.*?)\): set_w{m}\((.*?)\);", table):
            first, sign, low = (int(x.split("w")[1], 16) for x in key.split(", "))
            assert (first, sign, low) not in rows
            rows[first, sign, low] = tuple(int(x.split("w")[1], 16) for x in data.split(", "))
        assert len(rows) == len(one_lane) ** 2 == int(re.search(r"size = (\d+);", table)[1])
        for first in range(256):
            for second in range(256):
                got = rows.get((first, second >> 7, second & ((1 << bits) - 1)), (0, 0))
                if first in one_lane:
                    want_b = one_lane[second & 0x80 | second & ((1 << bits) - 1)]
                    assert got == (one_lane[first], want_b), (first, second)
                else:
                    assert got == (0, 0), (first, second)


def test_two_pass_layout_checks_every_code_and_adds_32_lanes_per_pass(tmp_path: Path) -> None:
    """The two-pass layout's lanes.p4: the window check covers all 64 codes (a table per
    GROUP lanes, a verdict row each), the 16 decode tables (two lanes each) and 16 pairs serve
    either pass's lanes (pair j: lanes j and j + 16 of the pass), the pair registers hold two
    index regions;
    the pragmas that K = 40 needed are there above 32 lanes, not at 32 (the one-pass build's
    text, and K = 64 for one pass stays one pass)."""
    k = 2 * gen_tofino.REGION
    config, lanes = gen_tofino.write(k, tmp_path, dense=True, passes=2)
    text, body = config.read_text(), lanes.read_text()
    assert sorted(int(g) for g in re.findall(r"table codes_(\d+) \{", body)) == list(range(4))
    for i in range(32):  # lanes 0-31 or 32-63 one by one, lanes 0-31 as the block
        assert f'hdr.lanes[{i}].code[6:0]: ternary @name("code_{i}");' in body
        assert f'hdr.block.c{i}[6:0]: ternary @name("block_{i}");' in body
    table = re.search(r"table codes_1 \{.*?\n    \}\n", body, re.S).group(0)
    assert table.count("hdr.block.isValid(): ternary;") == 1
    rows = [[tuple(int(x, 16) for x in re.findall(r"w0x(\w+)", f)) for f in row.split(", ")]
            for row in re.findall(r"\((8w.*?)\): above_1\(\);", table)]  # fmt: skip
    assert len(rows) == 2 * gen_tofino.GROUP * len(gen_tofino.window_rows())
    offsets, codes = np.arange(256)[:, None], np.arange(128)[None, :]
    want = np.array([[gen_tofino.code_above_window(int(c), int(o)) for c in codes[0]]
                     for o in offsets[:, 0]])  # fmt: skip
    # Key fields: code_offset, (valid, code) per lane, the block's valid, its codes.
    for position in (2, 2 + 2 * 5, 18, 18 + 7):  # one code on the grid, the others 0
        hit = np.zeros((256, 128), bool)
        for (ov, om), *fields in rows:
            p, (cv, cm) = next((i + 1, f) for i, f in enumerate(fields) if len(f) == 2)
            hit |= (offsets & om == ov) & ((codes if p == position else 0) & cm == cv)
        assert (hit == want).all(), position
    verdicts = re.search(r"#define VERDICT_ENTRIES (.*)\n", text).group(1)
    assert verdicts.count("EV_BAD_CODE") == 4
    decode = re.search(r"control Decode\(inout headers_t hdr\) \{.*?\n\}\n", body, re.S).group(0)
    assert sorted(int(i) for i in re.findall(r"table decode_(\d+)", decode)) == list(range(16))
    assert "if (hdr.lanes[0].isValid()) {" in decode and "table decode_" not in body.replace(
        decode, "")
    assert len(re.findall(r"Register<lane_pair_t, bit<16>>\(NCINA_PASSES \* NCINA_SLOTS, "
                          r"\{0, 0\}\) sums_\d+;", body)) == 16  # fmt: skip
    for j in range(16):
        add = re.search(rf"\) add_{j} = {{.*?\n    }};", body, re.S).group(0)
        assert f"value.lo + hdr.sums[{j}].value" in add
        assert f"value.hi + hdr.sums[{j + 16}].value" in add
        for verdict, op in (("SECOND_FIRST", "first"), ("SECOND_ADD", "add"),
                            ("SECOND_READ", "read"), ("HARVEST", "harvest"),
                            ("HARVEST_SECOND", "harvest")):  # fmt: skip
            assert f"(VERDICT_{verdict}, _, _, _, _, _): do_{op}_{j}();" in body
    assert "sums1" not in body and "hdr.sums[32]" not in body and "hdr.lanes[32]" not in body
    # The pairs' index: the slot's, moved to its second region by Regions (the next test).
    sums = re.search(r"control LaneSums\(.*?\n\}\n", body, re.S).group(0)
    assert sums.count("execute(meta.slot_index)") == 4 * 16
    assert "regions" not in sums and not _writes(sums, "meta.slot_index")
    assert "if (meta.lane_op != LANE_NONE) {\n            as_sums();" in body
    pragmas = re.findall(r'@pa_container_size\("ingress", "([^"]+)", (\d+)\)',
                         re.search(r"#define NCINA_PHV_PRAGMAS (.*)\n", text).group(1))  # fmt: skip
    assert pragmas == [(f"hdr.nc.{f}", str(n)) for f, n in gen_tofino.PASS_NC_SIZES.items()] + [
        (f"hdr.sums[{i}].value", "32") for i in range(32)] + [
        (f"hdr.block.c{i}", "16") for i in range(32)] + [
        (field, "16") for field in gen_tofino.PASS_16BIT]
    assert tuple(gen_tofino.PASS_NC_SIZES) == gen_tofino.NC_BYTES_8BIT
    one_pass = re.search(r"#define NCINA_PHV_PRAGMAS (.*)\n", gen_tofino.config_p4(40, dense=True))
    assert one_pass.group(1).count("@pa_container_size") == 4  # K = 40 in one pass: the header's
    assert "NCINA_PHV_PRAGMAS" not in gen_tofino.config_p4(32, dense=True)
    assert "NCINA_PASSES" not in gen_tofino.config_p4(k, dense=True)
    for bad in ((40, 2), (64, 3)):
        with pytest.raises(ValueError, match=r"two passes|1 or 2 passes"):
            gen_tofino.write(bad[0], tmp_path, dense=True, passes=bad[1])


def test_each_pass_indexes_its_lanes_region_ready_before_the_tallies(tmp_path: Path) -> None:
    """The two-pass program (ncina.p4 through cpp): the pairs' index is the slot's index moved
    to its lanes' region by ``Regions``, which the slot rules apply right after the offsets
    register has read the slot's index and before the tallies (applied after the slot rules'
    block it took a stage after the tallies: 15 of 12 stages); a later pass's comes in the
    pass header, as the pass that sent it round wrote it. Evaluated for the passes of a
    packet of more than 32 lanes (lanes 32-63 at slot + NCINA_SLOTS, then 0-31 at the slot; a
    result's harvests 48-63, then 16-31) and of at most 32 (the slot, its harvest there)."""
    text = _preprocessed(tmp_path, dense=True, nc8=False, k=64, passes=2)
    slots = layout.SLOTS
    rules = _block(_block(text, r"control Slots\("), r"\n    apply ")
    assert (rules.index("meta.relation = claim.execute(meta.slot_index);")
            < rules.index("regions.apply(hdr, meta);") < rules.index("tallies.apply();"))
    assert rules.count("regions.apply(") == 1 and not _writes(rules, "meta.slot_index")
    regions = _block(text, r"control Regions\(")
    assert "meta.slot_index = meta.slot_index + offset;" in regions
    assert re.search(r"key = \{ hdr\.block\.isValid\(\): exact", regions)
    assert f"const entries = {{ true: region({slots}); }}" in regions
    assert "const default_action = region(0);" in regions
    ingress = _block(text, r"control NcinaIngress\(")
    admission = _block(text, r"control Admission\(")
    assert "meta.slot_index = hdr.harvest.slot;" in _block(admission, r"action from_harvest\(")
    assert "hdr.harvest.slot = hdr.bridge.slot;" in _block(text, r"control Rewrite\(")

    def moved(action: str, slot: int, region: int = 0) -> int:
        # The pass header's slot as `action` writes it from the pass's index.
        expr = re.search(r"hdr\.bridge\.slot = ([^;]+);", _block(ingress, rf"action {action}\(")
                         ).group(1).replace("(bit<16>)", "")  # fmt: skip
        terms = re.split(r" ([-+]) ", expr)
        env = {"meta.slot_index": slot, "region": region}
        value = env[terms[0]]
        for op, term in zip(terms[1::2], terms[2::2], strict=True):
            x = env[term] if term in env else int(term)
            value = value + x if op == "+" else value - x
        return value & 0xFFFF

    apply = _block(ingress, r"\n    apply ")
    calls = {(verdict, int(region.replace("(bit<16>)", "")))
             for verdict, region in re.findall(r"to_pass\((VERDICT_\w+), ([^;]*)\);", apply)}
    assert calls == {("VERDICT_HARVEST", -slots), ("VERDICT_HARVEST_SECOND", slots),
                     ("VERDICT_HARVEST", 0)}  # fmt: skip
    for slot in (0, 5, slots - 1):
        first = slot + slots  # lanes 32-63: Regions' row for a block
        second = moved("to_second", first)  # lanes 0-31
        assert second == slot
        third = moved("to_pass", second, slots)  # a result's harvest of 48-63
        assert third == slot + slots
        assert moved("to_pass", third, -slots) == slot  # then 16-31
        assert moved("to_pass", slot, 0) == slot  # at most 32 lanes: its harvest


def _run_assignments(body: str, env: dict[str, str]) -> dict[str, str]:
    """``env`` after the plain assignments of an action's ``body`` (``x = y;`` and local
    declarations ``type x = y;``), run in order as P4 runs them; other statements ignored."""
    env = dict(env)
    for target, source in re.findall(r"^\s*(?:[\w<>]+ )?([\w.]+) = ([\w.]+);", body, re.M):
        env[target] = env.get(source, source)
    return env


def test_two_pass_member_digest_packs_the_source_reply_swapped_out(tmp_path: Path) -> None:
    """The two-pass program has no PHV for a copy of the source address from stage 0 on (4
    flags went unallocated with one): its member digest packs meta.local_*, which hold the
    packet's own source address by the deparser whatever the packet's path. Reply's actions
    swap the aggregator's address (local_*) with the source they rewrite; a digest packet
    Reply does not answer (meta.send OUT_NONE: Reply runs only otherwise) copies its source
    there; nothing else in ingress writes local_* after the lookup that sets them."""
    text = _preprocessed(tmp_path, dense=True, nc8=False, k=64, passes=2)
    packed = re.search(r"\.pack\(\{(.*?)\}\)", _block(text, r"control NcinaIngressDeparser\b"),
                       re.S)  # fmt: skip
    assert packed
    fields = [f.strip() for f in packed.group(1).split(",")]
    assert fields == ["hdr.nc.job", "hdr.nc.rank", "meta.local_mac", "meta.local_ip",
                      "meta.local_port"]  # fmt: skip
    source = {"hdr.eth.src": "sender mac", "hdr.ipv4.src": "sender ip",
              "hdr.udp.src_port": "sender port"}  # fmt: skip
    ours = {"meta.local_mac": "our mac", "meta.local_ip": "our ip", "meta.local_port": "our port"}
    wanted = dict(zip(fields[2:], source.values(), strict=True))
    reply = _block(text, r"control Reply\(")
    ingress = _block(text, r"control NcinaIngress\(")
    for action in ("to_sender", "to_group"):
        after = _run_assignments(_block(reply, rf"action {action}\("), source | ours)
        assert {f: after[f] for f in wanted} == wanted, action
        assert {f: after[f] for f in source} == dict(zip(source, ours.values(), strict=True))
    after = _run_assignments(_block(ingress, r"action keep_source\("), source | ours)
    assert {f: after[f] for f in wanted} == wanted
    apply = _block(ingress, r"\n    apply ")
    # keep_source runs where Reply does not, for every packet of the slot rules' branch (a
    # digest packet: a verdict of a packet from the wire, never a pass's LANE_HARVEST).
    digest = _enclosing(apply, apply.index("dprsr.digest_type = DIGEST_MEMBER;"))
    assert digest[-1] == "meta.unknown_rank == 1 && meta.verdict == VERDICT_ACCEPT"
    assert _enclosing(apply, apply.index("meta.ours = 1;")) == digest[:1]
    assert apply.count("keep_source();") == 1
    assert _enclosing(apply, apply.index("keep_source();")) == [
        "meta.ours == 1", "else of meta.lane_op == LANE_HARVEST", "else of meta.send != OUT_NONE"]
    for call in re.finditer(r"reply\.apply\(", apply):
        assert apply[:call.start()].rstrip().endswith("if (meta.send != OUT_NONE) {")
    writers = {name for name, body in re.findall(r"action (\w+)\([^)]*\) \{(.*?)\n    \}", text,
                                                  re.S) if any(_writes(body, f) for f in wanted)}
    assert writers == {"aggregator", "keep_source", "to_sender", "to_group"}


def _ternary_key(keys: str) -> list[tuple[int, int] | None]:
    """A generated const entry's key (``8w0x1 &&& 8w0xFF, _, ...``): ``(value, mask)`` per
    field, None for a field the row does not care about."""
    return [None if k == "_" else tuple(int(x.split("w")[1], 0) for x in k.split(" &&& "))
            for k in keys.split(", ")]  # fmt: skip


def _header_flags(rows: list[tuple[list[tuple[int, int] | None], list[int]]],
                  key: tuple[int, ...]) -> dict[str, int]:  # fmt: skip
    """What the two-pass layout's ``header_checks`` writes for ``key`` (HEADER_CHECK_KEY's
    values): its first matching row's, else its default action's (bad_version)."""
    for match, values in rows:
        if all(m is None or v & m[1] == m[0] for m, v in zip(match, key, strict=True)):
            return dict(zip(gen_tofino.HEADER_FLAGS, values, strict=True))
    return {"bad_version": 1}


def test_two_pass_header_checks_give_the_verdict_the_if_per_flag_gives(tmp_path: Path) -> None:
    """The two-pass layout computes admission's checks that need no lookup in one ternary table
    of their first failure (``header_checks``, generated rows), where one pass has an ``if`` per
    flag (each a logical table of stages 1 to 3: docs/tofino.md, "64 elements per packet").
    Only ``verdicts`` reads those flags, so the table must give the verdict the ``if``s give:
    checked for every combination of UDP lengths at and around each boundary (the handshake's,
    a blob's, room 0 to 8, a chunk's NC8 and int payload with and without a tag, the top bit of
    the room), ncina versions, formats, counts, the tag flag, the parser's error, with and
    without the job and the RESULT flag; the NC8 and int lengths (``measures``' differences)
    are modelled as the one-pass ``if``s in both (the two-pass ``verdicts`` checks them in its
    own rows: the next test). The table is parsed from the generated config.p4, and the ``if``s are
    admission.p4's, transcribed here; builds of one pass keep them (no table)."""
    c = _p4_constants()
    config, _ = gen_tofino.write(64, tmp_path, dense=True, passes=2)
    text = config.read_text()
    entries = re.search(r"#define HEADER_CHECK_ENTRIES (.*)\n", text).group(1)
    rows = []
    for keys, values in re.findall(r"\(([^()]*)\): header_flags\(([^()]*)\);", entries):
        rows.append((_ternary_key(keys), [int(v) for v in values.split(", ")]))
    assert len(rows) == len(gen_tofino.header_check_rows()) == int(
        re.search(r"#define NCINA_HEADER_CHECK_ROWS (\d+)", text).group(1))
    assert "table header_checks" not in _preprocessed(tmp_path / "one", True, False)
    datagram = c["UDP_HEADER_BYTES"] + c["NCINA_HEADER_BYTES"]
    tag, descriptor = c["TAG_BYTES"], c["DESCRIPTOR_BYTES"]
    nc8, integer, blob, job = (c[f"FORMAT_{f}"] for f in ("NC8", "INT", "BLOB", "JOB"))

    def lengths(flags: dict[str, int], room: int, fmt: int, count: int, tagged: int) -> None:
        # The NC8 and int payloads' lengths, the one-pass `if`s (measures' differences).
        excess = {nc8: (room - count) & 0xFFFF, integer: (room - (count << 3)) & 0xFFFF}
        if fmt in excess and excess[fmt] != (tag if tagged else 0):
            flags["f_len"] = 1

    def original(udp_len: int, version: int, fmt: int, count: int, tagged: int,
                 short: int) -> dict[str, int]:  # fmt: skip
        room = (udp_len - datagram) & 0xFFFF
        f = dict.fromkeys(gen_tofino.HEADER_FLAGS, 0)
        f["truncated"] = room >> 15
        f["bad_version"] = int(version != c["NCINA_VERSION"])
        if fmt == job:
            f["handshake"] = 1
            f["f_hs_len"] = int(bool(short) or room != descriptor + (tag if tagged else 0))
            f["f_hs_count"] = int(count != 1)
        else:
            f["f_format"] = int(fmt > blob)
            f["f_count0"] = int(count == 0)
            f["f_len"] = int(bool(short) or (tagged == 1 and room >> 3 == 0))
        lengths(f, room, fmt, count, tagged)
        if fmt == blob and room == (tag if tagged else 0):
            f["f_len"] = 1
        f["f_not_nc8"] = int(fmt != nc8)
        return f

    lens = {0, 23, 32791, 32792, 0xFFFF} | {datagram + r for r in (0, 1, 7, 8, 9, 16)}
    lens |= {datagram + descriptor + t + d for t in (0, tag) for d in (-1, 0, 1)}
    lens |= {datagram + n + t for n in (4, 32) for t in (0, tag)}
    checked = 0
    for udp_len in sorted(lens):
        for version in (0, 1, 2):
            for fmt in (nc8, integer, blob, job, c["FORMAT_INT32"], 0xFF):
                for count in (0, 1, 4):
                    for tagged in (0, 1):
                        for short in (0, 1):
                            key = (udp_len, version, fmt, count, tagged, short)
                            new = _header_flags(rows, key)
                            lengths(new, (udp_len - datagram) & 0xFFFF, fmt, count, tagged)
                            old = original(*key)
                            for job_hit in (0, 1):
                                for result in (0, 1):
                                    more = {"job_hit": job_hit, "result": result, "tag": tagged}
                                    assert _first_match({**new, **more}) == _first_match(
                                        {**old, **more}), (key, more, new, old)
                                    checked += 1
    assert checked == len(lens) * 3 * 6 * 3 * 2 * 2 * 4


def test_two_pass_header_checks_come_first_reading_only_headers(tmp_path: Path) -> None:
    """``header_checks`` needs nothing before it (its key: headers and the parser's error, no
    metadata), so the two-pass program applies it first in admission, under no condition and
    pinned to stage 0: after the harvest branch it went to stage 1, where its TCAM pushed a
    window-check table into stage 3 and ``verdicts`` into 4 (docs/tofino.md, "64 elements per
    packet")."""
    text = _preprocessed(tmp_path, dense=True, nc8=False, k=64, passes=2)
    admission = _block(text, r"control Admission\(")
    checks = _block(admission, r"\n    apply ")
    first = re.search(r"\S[^;]*;", checks).group(0)
    assert first == "header_checks.apply();"
    assert _enclosing(checks, checks.index(first)) == []
    found = re.search(r"(@stage\(0\)\s+)?table header_checks ", admission)
    assert found and found.group(1), "pinned to stage 0"
    key = re.search(r"key = \{([^}]*)\}", _block(admission, r"table header_checks ")).group(1)
    fields = re.findall(r"([\w.\[\]:]+): ternary", key)
    assert fields and all(f.startswith(("hdr.", "prsr.")) for f in fields), fields


def test_two_pass_verdicts_read_the_lookups_and_differences_the_one_pass_ifs_read(
    tmp_path: Path,
) -> None:
    """The two-pass ``verdicts`` has no flags for the checks the one-pass program makes after
    ``measures`` (an ``if`` each, a logical table each in stages 2 and 3: docs/tofino.md, "64
    elements per packet"): its key holds what those ``if``s read, and its rows (generated:
    ``gen_tofino.pass_verdict_rows``) each check's condition. So its first match must be the
    one-pass verdict over the flags the ``if``s compute: checked for 20,000 keys drawn (fixed
    seed) from every boundary of each field, every row of VERDICT_ROWS reached. The rows are
    parsed from the generated config.p4, the ``if``s are admission.p4's, transcribed here; the
    key's order is admission.p4's (``@name``s)."""
    import random

    c = _p4_constants()
    config, _ = gen_tofino.write(64, tmp_path, dense=True, passes=2)
    text = config.read_text()
    more = re.findall(r"meta\.checks\.(codes_bad_\d+): ternary;", text)  # the window check's
    entries = re.search(r"#define VERDICT_ENTRIES (.*)\n", text).group(1)
    rows = []
    for keys, action in re.findall(r"\(([^()]*)\): ((?:global|verdict)\([^()]*\));", entries):
        match = _ternary_key(keys)  # the fields a row cares about, as (index, value, mask)
        rows.append(([(i, v, m) for i, x in enumerate(match) if x for v, m in [x]], action))
    assert len(rows) == int(re.search(r"#define NCINA_VERDICT_ROWS (\d+)", text).group(1))
    names = [name for name, _ in gen_tofino.PASS_VERDICT_KEY] + more
    assert all(len(match) and max(i for i, _, _ in match) < len(names) for match, _ in rows)
    admission = _block(_preprocessed(tmp_path / "p4", dense=True, nc8=False, k=64, passes=2),
                       r"control Admission\(")
    key = re.search(r"key = \{([^}]*)\}", _block(admission, r"table verdicts ")).group(1)
    declared = [m.group(2) or m.group(1).split(".")[-1] for m in re.finditer(
        r"([\w.\[\]:]+): ternary(?: @name\(\"(\w+)\"\))?;", key)]
    aliases = {"result_flag": "result", "tag_flag": "tag"}
    assert [aliases.get(n, n) for n in declared] == names
    between = _block(admission, r"\n    apply ").split("measures.apply();")[1]
    between = between.split("verdicts.apply();")[0]
    assert re.findall(r"\bif \((.*)\)", between) == ["!hdr.harvest.isValid()"], between

    tag, nc8, integer = c["TAG_BYTES"], c["FORMAT_NC8"], c["FORMAT_INT"]
    formats = [nc8, integer, c["FORMAT_BLOB"], c["FORMAT_JOB"], c["FORMAT_INT32"], 0xFF, nc8 ^ 0x80]
    excess = [0, tag, 0x8000, 0xFFFF] + [w ^ (1 << b) for w in (0, tag) for b in range(16)]
    choices = {"format": formats, "nc8_excess": excess, "int_excess": excess,
               "emin_diff": [0, 0, 1, 0x80, 0x10], "slot_high": [0, 0, 1, 0x20],
               "generation_flag": [0, 0, 1, 8, 0xF], "generation_diff": [0, 0, 1, 8, 0xF],
               "generation": [0, 3]}  # fmt: skip

    def original(f: dict[str, int]) -> str:
        # admission.p4's ifs after measures (one pass), then VERDICT_ROWS over the flags
        flags = dict(f)
        want = tag if f["tag"] else 0
        if ((f["format"] == nc8 and f["nc8_excess"] != want)
                or (f["format"] == integer and f["int_excess"] != want)):
            flags["f_len"] = 1
        flags["f_rank"] = int(f["no_rank"] == 1 or f["rank_room"] == 0)
        flags["f_address"] = int(f["unknown_rank"] == 0 and f["not_member"] == 1)
        flags["f_emin"] = int(f["emin_diff"] != 0)
        flags["f_slot"] = int(f["slot_high"] != 0 or f["slot_room"] == 0)
        flags["f_count"] = int(f["count_room"] == 1)
        flags["f_generation"] = int(f["generation_flag"] != 0 and f["generation_diff"] != 0)
        action = _first_match(flags)
        if action == "accept" and any(flags[n] for n in more):  # the window's further flags
            return gen_tofino.VERDICT_ROWS[-1][1]
        return action

    def two_pass(f: dict[str, int]) -> str:
        values = [f[n] for n in names]
        for match, action in rows:
            if all(values[i] & m == v for i, v, m in match):
                return action
        return "accept"

    rng = random.Random(33)
    reached = set()
    for _ in range(20_000):
        f = {n: rng.choice(choices[n]) if n in choices else int(rng.random() < 0.12)
             for n in names}  # fmt: skip
        f["job_hit"], f["rank_room"], f["slot_room"] = (int(rng.random() < 0.9) for _ in "abc")
        want = original(f)
        assert two_pass(f) == want, f
        reached.add(want)
    assert reached == {action for _, action in gen_tofino.VERDICT_ROWS} | {"accept"}


def test_two_pass_admission_keeps_its_differences_in_place_of_what_they_subtract(
    tmp_path: Path,
) -> None:
    """The two-pass program keeps admission's differences rank - workers, slot - pool,
    k - count and room - int_bytes in the field each subtracts (ingress's PHV is full: four
    16-bit containers fewer). That is right only if nothing reads those fields after
    ``measure`` but the checks of the difference (``verdicts``' key: its rows check them): each
    is written once before (the job's entry, ``prepare``), then by ``measure``, and read
    nowhere else in the program."""
    text = _preprocessed(tmp_path, dense=True, nc8=False, k=64, passes=2)
    admission = _block(text, r"control Admission\(")
    measure = _block(admission, r"action measure\(")
    checks = _block(admission, r"table verdicts ")
    differences = {"meta.workers": ("hdr.nc.rank - meta.workers", "meta.workers[15:15]: ternary"),
                   "meta.pool": ("hdr.nc.slot - meta.pool", "meta.pool[15:15]: ternary"),
                   "meta.k": ("meta.k - hdr.nc.count", "meta.k[15:15]: ternary"),
                   "meta.int_bytes": ("meta.room - meta.int_bytes", "meta.int_bytes: ternary")}
    for field, (difference, check) in differences.items():
        assert f"{field} = {difference};" in measure
        assert check in checks
    first = _block(admission, r"action set_job\(") + _block(text, r"action sizes\(")
    for field in differences:
        def uses(body: str, field: str = field) -> int:
            return len(re.findall(rf"(?<![\w.]){re.escape(field)}(?![\w])", body))
        assert uses(first) == 1
        assert uses(text) == uses(first) + uses(measure) + uses(checks), field
    for field in ("meta.rank_room", "meta.slot_room", "meta.count_room", "meta.int_excess"):
        assert f"{field} =" not in text


def _enclosing(body: str, at: int) -> list[str]:
    """The conditions of the blocks of ``body`` (an apply block) that enclose position ``at``,
    outermost first: an ``if``'s condition, ``else of <condition>`` for its else block."""
    stack: list[str] = []
    closed = ""  # the condition of the block that closed last
    for brace in re.finditer(r"[{}]", body[:at]):
        if brace.group() == "}":
            closed = stack.pop()
            continue
        line = body[body.rfind("\n", 0, brace.start()) + 1:brace.start()]
        if condition := re.search(r"\bif \((.*)\)\s*$", line):
            stack.append(condition.group(1))
        else:
            stack.append(f"else of {closed}" if re.search(r"\belse\s*$", line) else "")
    return [c for c in stack if c]


def test_two_pass_admission_and_decode_tables_are_no_blocks_tofino_1_places_whole(
    tmp_path: Path,
) -> None:
    """Tofino 1 has no long branches: the compiler places every table under a condition before
    any table that follows the condition's block (p4c-barefoot's table placement). A condition
    around admission for a pass from the recirculation port, and one around the 32 decode
    tables, made both blocks of several stages that could not share a stage's middle: the
    decode tables waited for admission's verdict (stages 3 and 4, 15 of 12). So the two-pass
    program applies admission under no condition and each decode table (two lanes, 2m and
    2m + 1) under lane 2m's validity (the parser makes a lane's result header valid with the
    lane's code: the other tests). A
    pass from the recirculation port still takes from admission only what its pass header
    says: the tables before the slot rules that write what ``from_harvest`` writes, or what the
    counters test (``job_hit``, ``global_event``), run only for a packet from the wire."""
    text = _preprocessed(tmp_path, dense=True, nc8=False, k=64, passes=2)
    ingress = _block(text, r"control NcinaIngress\(")
    apply = _block(ingress, r"\n    apply ")
    admission = _block(text, r"control Admission\(")
    checks = _block(admission, r"\n    apply ")
    decode = _block(_block(text, r"control Decode\("), r"\n    apply ")
    assert _enclosing(apply, apply.index("admission.apply(")) == []
    assert _enclosing(apply, apply.index("decode.apply(")) == []
    for m in range(gen_tofino.REGION // 2):
        assert _enclosing(decode, decode.index(f"decode_{m}.apply();")) == [
            f"hdr.lanes[{2 * m}].isValid()"]
    harvest = _block(admission, r"action from_harvest\(")
    fields = {*re.findall(r"([\w.]+) = ", harvest), "meta.job_hit", "meta.global_event"}
    assert {"meta.verdict", "meta.slot_index", "meta.job_index", "meta.send"} < fields
    assert _enclosing(checks, checks.index("from_harvest();")) == ["hdr.harvest.isValid()"]
    before = apply[:apply.index("admission.apply(")]
    writers = {}
    for body, where in ((ingress, before), (admission, checks)):
        assert not any(_writes(where, f) for f in fields - {"hdr.bridge.ingress_port"})
        for table in re.findall(r"\b(\w+)\.apply\(\)", where):
            if not re.search(rf"\btable {table} \{{", body):
                continue  # a control's
            declared = _block(body, rf"\btable {table} ")
            listed = re.search(r"actions = \{([^}]*)\}", declared).group(1)
            actions = [_block(body, rf"action {a}\(") for a in re.findall(r"\w+", listed)
                       if re.search(rf"action {a}\(", body)]  # fmt: skip
            if any(_writes(a, f) for a in actions for f in fields):
                writers[table] = _enclosing(where, where.index(f"{table}.apply()"))
    assert set(writers) == {"local_address", "jobs", "verdicts"}
    for table, conditions in writers.items():
        assert any("!hdr.harvest.isValid()" in c or c == "else of hdr.harvest.isValid()"
                   for c in conditions), (table, conditions)  # fmt: skip


def test_second_pass_rows_repeat_the_first_pass_decision_on_lanes_0_to_31(
    tmp_path: Path,
) -> None:
    """A pair's table in the two-pass layout: for every verdict a pass can carry (the first
    pass's admission verdicts with the slot decision's inputs, the second pass's
    VERDICT_SECOND_*, the harvests' VERDICT_HARVEST and _SECOND), the first matching row does
    what the decision said: the second pass's rows the operation the first pass's lane_op
    named (their relation is 0: the slot rules never run there), the harvests read the upper
    sums, the first pass's rows as in one pass."""
    c = _p4_constants()
    _, lanes = gen_tofino.write(64, tmp_path, dense=True, passes=2)
    table = re.search(r"table pair_5 \{.*?\n    \}\n", lanes.read_text(), re.S).group(0)
    entries = re.findall(r"\(([^()]*)\): do_(\w+)_5\(\);", table)
    assert len(entries) == len(gen_tofino.PAIR_ROWS) + 1 + len(gen_tofino.PASS_ROWS)
    rows = [([None if v == "_" else c[v] if v in c else int(v) for v in values.split(", ")],
             op) for values, op in entries]  # fmt: skip

    def first(key: tuple[int, ...]) -> str | None:
        return next((op for values, op in rows if all(
            v is None or v == x for v, x in zip(values, key, strict=True))), None)

    for op in ("FIRST", "ADD", "READ"):
        for bits in np.ndindex(2, 2, 2, 2):
            key = (c[f"VERDICT_SECOND_{op}"], 0, *bits)
            assert first(key) == op.lower(), key
            for harvest in ("VERDICT_HARVEST", "VERDICT_HARVEST_SECOND"):
                assert first((c[harvest], 0, *bits)) == "harvest"
    rank_bit = 1 << 3
    for relation in (0, c["OFFSET_OLDER"], c["OFFSET_NEWER"], c["OFFSET_SAME"]):
        for there, here, seen_there, seen_here in np.ndindex(2, 2, 2, 2):
            key = (c["VERDICT_ACCEPT"], relation, there, here, seen_there * rank_bit,
                   seen_here * rank_bit)  # fmt: skip
            assert first(key) == _slot_decision(*key[1:]), key


def test_make_p4_tofino_at_64_lanes_builds_two_passes_on_tofino(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``make p4-tofino TOFINO_K=64`` (the toolchain with ``--k 64``) builds the two-pass layout
    for Tofino 1, one pass for Tofino 2 (a register action hands back both words, 20 stages);
    ``--passes`` says it outright; two passes elsewhere are refused in one sentence."""
    calls = []

    def build(k: int, target: str, **kwargs: bool) -> tofino.Resources:
        calls.append((k, target, kwargs["passes"]))
        raise ToolchainError("not compiled here")

    monkeypatch.setattr(tofino, "build", build)
    assert tofino.main(["--k", "64"]) == 1
    assert tofino.main(["--k", "64", "--target", "tofino2"]) == 1
    assert tofino.main(["--k", "64", "--passes", "1"]) == 1 and tofino.main([]) == 1
    assert calls == [(64, "tofino", 2), (64, "tofino2", 1), (64, "tofino", 1), (32, "tofino", 1)]
    assert tofino.report_name(64, "tofino", True, passes=2) == "tofino-k64-dense-2pass.json"
    monkeypatch.undo()
    with pytest.raises(ValueError, match="Tofino 1"):
        tofino.build(64, "tofino2", dense=True, passes=2)
    with pytest.raises(ValueError, match="dense layout only"):
        tofino.build(64, "tofino", passes=2)
    capsys.readouterr()

