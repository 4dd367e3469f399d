"""Micro-benchmark of BMv2 on the shapes of ncina's P4 program: what one wide operation costs
against the narrow ones it would replace (issue 35: lanes side by side in wide fields).

Each variant is a small v1model program, generated here, that parses a frame (Ethernet, an
8-byte control header, 64 payload bytes: the 64 NC8 codes of a K = 64 chunk), does one kind of
work R times per packet, and sends the frame back out of its port. ``simple_switch`` (no P4Runtime,
no root: ``--use-files``, the port's packets read from and written to pcap files) runs each
variant on the same N frames; the figure is the switch process's CPU time per packet (user +
system, from /proc: a loaded machine stretches the wall clock, much less the CPU time) above the
``base`` variant's, which parses the Ethernet and control headers and echoes. Variants:

- ``parse_lanes``: the payload as 64 one-byte lane headers, one parser state each, as p4/'s
  generated LaneParser (extract, set the code's bit in a 128-bit mask, compare the count);
  ``parse_lanes_extract``: the 64 extracts alone (no mask, no select);
  ``parse_wideW``: the payload as 512/W headers of one ``bit<W>`` field (W = 64, 512);
- ``idle_headers``: ``base`` with 128 more one-byte headers in the header vector, never valid
  (what a header stack that a packet leaves unused costs: the int results' and the lanes'
  stacks beside the groups);
- ``rawadd_W``: 64 times ``r.read(s, i); r.write(i, s + x)`` on a ``register<bit<W>>`` with a
  ``bit<W>`` operand from the packet (W = 64 .. 512): does one add on ``bit<W>`` cost what one
  on ``bit<64>`` does?
- ``add_narrow``: p4/'s per-lane add (LaneSums.add): per lane a ``bit<64>`` register read and a
  write of ``sign ? sum - v : sum + v`` with ``v = (1 << code) >> 1``;
  ``add_packedL``: the same 64 lanes as 64/L registers of ``bit<64 L>``, each one read and
  one write of ``sum + (a_0 ++ ... ++ a_{L-1})`` with each lane's biased addend
  ``a = sign ? B - v : B + v`` (B = 2^62: every addend non-negative, so no lane borrows from
  its neighbour);
- ``slice_narrow``: per lane the re-compression's first step as now, ``sum_i.read`` into a
  metadata field; ``slice_packedL``: one wide read per L lanes, then per lane an assignment of
  its 64-bit slice minus the bias times the contributions.

Run: ``PATH=/opt/p4/bin:$PATH .venv/bin/python tools/bmv2_microbench.py`` (about 2 minutes;
``--packets``, ``--repeat``, ``--only NAME,...``); prints one JSON document (µs per packet above
``base``, and per repetition of the variant's work). docs/bmv2.md, "Wide lanes", has the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

K = 64  # lanes per packet, as the benchmark's K = 64
SLOTS = 16
BIAS = 1 << 62

PRELUDE = """#include <core.p4>
#include <v1model.p4>
header eth_h { bit<48> dst; bit<48> src; bit<16> type; }
header ctl_h { bit<8> idx; bit<8> count; bit<48> pad; }
header lane_h { bit<1> sign; bit<7> code; }
"""


@dataclass(frozen=True)
class Variant:
    """One program: extra headers, the payload's parse states, the ingress's work."""

    name: str
    reps: int  # repetitions of the measured operation per packet
    headers: str = ""  # header types and the struct fields (`FIELDS:` line) they add
    fields: str = ""
    parse: str = "transition accept;"  # after ctl
    states: str = ""
    meta: str = ""
    controls: str = ""  # registers and actions in ingress
    apply: str = ""


def _lane_states(mask: bool) -> str:
    out = []
    for i in range(K):
        nxt = f"lane_{i + 1}" if i + 1 < K else "accept"
        body = [f"packet.extract(hdr.lanes[{i}]);"]
        if mask:
            body.append(f"meta.codes_seen = meta.codes_seen | (bit<128>)1 << "
                        f"(bit<8>)hdr.lanes[{i}].code;")  # fmt: skip
            body.append(f"transition select(hdr.ctl.count) {{ {i + 1}: accept; default: {nxt}; }}")
        else:
            body.append(f"transition {nxt};")
        out.append(f"state lane_{i} {{ " + " ".join(body) + " }")
    return "\n".join(out)


def _lanes(mask: bool, name: str, reps: int, meta: str = "", **kw: str) -> Variant:
    return Variant(name, reps, fields=f"lane_h[{K}] lanes;", parse="transition lane_0;",
                   states=_lane_states(mask), meta=f"bit<128> codes_seen; {meta}",
                   **kw)  # fmt: skip


def _wide_headers(width: int) -> dict[str, str]:
    n = 512 // width
    states = "\n".join(
        f"state w_{j} {{ packet.extract(hdr.w[{j}]); transition "
        f"{f'w_{j + 1}' if j + 1 < n else 'accept'}; }}"
        for j in range(n)
    )
    return {"headers": f"header w_h {{ bit<{width}> v; }}", "fields": f"w_h[{n}] w;",
            "parse": "transition w_0;", "states": states}  # fmt: skip


def _decode(i: int) -> str:
    return f"((bit<64>)1 << (bit<8>)hdr.lanes[{i}].code >> 1)"


def parse_wide(width: int) -> Variant:
    return Variant(f"parse_wide{width}", 512 // width, **_wide_headers(width))


def raw_add(width: int) -> Variant:
    """64 read-add-writes of register<bit<width>> with a packet operand of width bits."""
    n = 512 // width
    regs = "\n".join(f"register<bit<{width}>>({SLOTS}) r_{i};" for i in range(K))
    body = "\n".join(
        f"r_{i}.read(meta.s, (bit<32>)hdr.ctl.idx); "
        f"r_{i}.write((bit<32>)hdr.ctl.idx, meta.s + hdr.w[{i % n}].v);"
        for i in range(K)
    )
    return Variant(f"rawadd_{width}", K, meta=f"bit<{width}> s;",
                   controls=f"{regs}\naction work() {{ {body} }}", apply="work();",
                   **_wide_headers(width))  # fmt: skip


def add_narrow() -> Variant:
    regs = "\n".join(f"register<bit<64>>({SLOTS}) sum_{i};" for i in range(K))
    body = "\n".join(
        f"sum_{i}.read(meta.s, (bit<32>)hdr.ctl.idx); sum_{i}.write((bit<32>)hdr.ctl.idx, "
        f"hdr.lanes[{i}].sign == 1 ? meta.s - {_decode(i)} : meta.s + {_decode(i)});"
        for i in range(K)
    )
    return _lanes(True, "add_narrow", K, controls=f"{regs}\naction work() {{ {body} }}",
                  apply="work();", meta="bit<64> s;")  # fmt: skip


def _addend(i: int) -> str:
    return f"(hdr.lanes[{i}].sign == 1 ? 64w{BIAS} - {_decode(i)} : 64w{BIAS} + {_decode(i)})"


def _packed_controls(per: int, addend: Callable[[int], str]) -> str:
    """K/per registers of bit<64 per> and the action ``work`` that adds each one's ``per``
    lanes (lane g*per + j in bits [64 j + 63 : 64 j]: the first lane lowest), one read and one
    write a register; ``addend(i)`` is lane i's 64-bit addend."""
    regs = "\n".join(f"register<bit<{64 * per}>>({SLOTS}) sum_{g};" for g in range(K // per))
    body = []
    for g in range(K // per):
        operand = " ++ ".join(addend(g * per + j) for j in reversed(range(per)))
        body.append(f"sum_{g}.read(meta.s, (bit<32>)hdr.ctl.idx); "
                    f"sum_{g}.write((bit<32>)hdr.ctl.idx, meta.s + ({operand}));")  # fmt: skip
    return f"{regs}\naction work() {{ {' '.join(body)} }}"


def add_packed(per: int) -> Variant:
    """K lanes as K/per registers of bit<64 per>, one read and one write each."""
    return _lanes(True, f"add_packed{per}", K // per, controls=_packed_controls(per, _addend),
                  apply="work();", meta=f"bit<{64 * per}> s;")  # fmt: skip


def _addend_wide(i: int) -> str:
    """Lane ``i``'s biased addend, its code and sign sliced out of its 64-bit group header."""
    g, r = divmod(i, 8)
    byte = 8 * (7 - r)  # the group's first lane is its most significant byte (wire order)
    value = f"((bit<64>)1 << (bit<8>)hdr.w[{g}].v[{byte + 6}:{byte}] >> 1)"
    return f"(hdr.w[{g}].v[{byte + 7}:{byte + 7}] == 1 ? 64w{BIAS} - {value} : 64w{BIAS} + {value})"


def add_packed_wide(per: int) -> Variant:
    """``add_packed``, the codes parsed as eight 64-bit groups and sliced per lane; the window
    check as one comparison per group (a code above ``max`` sets bit 7 of its byte in
    ``(v & 0x7f..7f) + (127 - max) * 0x01..01``)."""
    check = " ".join(
        f"meta.bad = meta.bad | (((hdr.w[{j}].v & 64w0x7f7f7f7f7f7f7f7f) + meta.room) "
        f"& 64w0x8080808080808080);"
        for j in range(8)
    )
    return Variant(f"add_packed{per}_wide", K // per,
                   meta=f"bit<{64 * per}> s; bit<64> room; bit<64> bad;",
                   controls=_packed_controls(per, _addend_wide),
                   apply=f"meta.room = (bit<64>)(8w127 - hdr.ctl.count) * 64w0x0101010101010101; "
                   f"{check} work();", **_wide_headers(64))  # fmt: skip


def slice_narrow() -> Variant:
    regs = "\n".join(f"register<bit<64>>({SLOTS}) sum_{i};" for i in range(K))
    acts = "\n".join(
        f"action get_{i}() {{ sum_{i}.read(meta.m, (bit<32>)hdr.ctl.idx); "
        f"meta.acc = meta.acc ^ meta.m; }}"
        for i in range(K)
    )
    return Variant("slice_narrow", K, meta="bit<64> m; bit<64> acc;",
                   controls=f"{regs}\n{acts}",
                   apply=" ".join(f"get_{i}();" for i in range(K)))  # fmt: skip


def slice_packed(per: int) -> Variant:
    """One wide read per `per` lanes, then each lane's slice, unbiased, as its own action."""
    width = 64 * per
    regs = "\n".join(f"register<bit<{width}>>({SLOTS}) sum_{g};" for g in range(K // per))
    acts = []
    calls = []
    for g in range(K // per):
        acts.append(f"action load_{g}() {{ sum_{g}.read(meta.w, (bit<32>)hdr.ctl.idx); }}")
        calls.append(f"load_{g}();")
        for j in range(per):
            i = g * per + j
            acts.append(f"action get_{i}() {{ meta.m = meta.w[{64 * j + 63}:{64 * j}] - "
                        f"meta.bias; meta.acc = meta.acc ^ meta.m; }}")  # fmt: skip
            calls.append(f"get_{i}();")
    return Variant(f"slice_packed{per}", K,
                   meta=f"bit<{width}> w; bit<64> m; bit<64> acc; bit<64> bias;",
                   controls="\n".join([regs, *acts]),
                   apply=f"meta.bias = (bit<64>)hdr.ctl.count << 62; {' '.join(calls)}")


def variants() -> list[Variant]:
    out = [
        Variant("base", 1),
        _lanes(True, "parse_lanes", K),
        _lanes(False, "parse_lanes_extract", K),
        parse_wide(64),
        parse_wide(512),
        Variant("idle_headers", 128, fields="lane_h[128] spare;"),
    ]
    out += [raw_add(w) for w in (64, 128, 256, 512)]
    out += [add_narrow(), add_packed(4), add_packed(8), add_packed_wide(8)]
    out += [slice_narrow(), slice_packed(4), slice_packed(8)]
    return out


def program(v: Variant) -> str:
    """The variant's v1model program."""
    return f"""{PRELUDE}
{v.headers}
struct headers_t {{ eth_h eth; ctl_h ctl; {v.fields} }}
struct meta_t {{ {v.meta} }}
parser P(packet_in packet, out headers_t hdr, inout meta_t meta, inout standard_metadata_t sm) {{
    state start {{ packet.extract(hdr.eth); packet.extract(hdr.ctl); {v.parse} }}
    {v.states}
}}
control V(inout headers_t hdr, inout meta_t meta) {{ apply {{ }} }}
control I(inout headers_t hdr, inout meta_t meta, inout standard_metadata_t sm) {{
    counter(1, CounterType.packets) seen;
    {v.controls}
    apply {{ seen.count(0); sm.egress_spec = sm.ingress_port; {v.apply} }}
}}
control E(inout headers_t hdr, inout meta_t meta, inout standard_metadata_t sm) {{ apply {{ }} }}
control C(inout headers_t hdr, inout meta_t meta) {{ apply {{ }} }}
control D(packet_out packet, in headers_t hdr) {{ apply {{ packet.emit(hdr); }} }}
V1Switch(P(), V(), I(), E(), C(), D()) main;
"""


def frames(n: int, seed: int = 0) -> list[bytes]:
    """``n`` frames: Ethernet, control (slot index, count K), 64 NC8 codes (codes 1..19, random
    signs, as the benchmark's load)."""
    rng = random.Random(seed)
    eth = bytes.fromhex("020000000002" "020000000001" "88b5")
    out = []
    for _ in range(n):
        codes = bytes(rng.randint(1, 19) | rng.randint(0, 1) << 7 for _ in range(K))
        out.append(eth + bytes([rng.randrange(SLOTS), K]) + bytes(6) + codes)
    return out


def write_pcap(path: Path, packets: list[bytes]) -> None:
    with path.open("wb") as f:
        f.write(struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 65535, 1))
        for p in packets:
            f.write(struct.pack("<IIII", 0, 0, len(p), len(p)) + p)


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _seen(port: int) -> int:
    """Packets the program's ingress counted (counter ``I.seen``, over the Thrift CLI)."""
    out = subprocess.run(["simple_switch_CLI", "--thrift-port", str(port)],
                         input="counter_read I.seen 0\n", capture_output=True, text=True,
                         timeout=60).stdout  # fmt: skip
    match = re.search(r"(\d+) packets\)", out)
    if match is None:
        raise RuntimeError(f"cannot read the switch's counter: {out.strip()[-200:]}")
    return int(match.group(1))


def run_switch(json_path: Path, work: Path, packets: list[bytes], timeout: float) -> float:
    """CPU seconds simple_switch took to take all ``packets`` from its input file through
    ingress (its CPU time once it has stopped working; the ingress counter must hold them all:
    BMv2 drops what its input queue cannot hold, and the output pcap is not flushed)."""
    (work / "p1_out.pcap").unlink(missing_ok=True)
    write_pcap(work / "p1_in.pcap", packets)
    port = _free_port()
    proc = subprocess.Popen(
        ["simple_switch", "--use-files", "0", "-i", "1@p1", "--thrift-port", str(port),
         str(json_path)],
        cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + timeout
        last = -1.0
        while True:  # idle once the CPU time stops growing (BMv2's idle threads sleep)
            time.sleep(0.5)
            cpu = _cpu_s(proc.pid)
            if cpu - last < 0.015 or proc.poll() is not None or time.monotonic() > deadline:
                break
            last = cpu
        seen = _seen(port)
        if seen != len(packets):
            raise RuntimeError(f"{json_path.parent.name}: ingress saw {seen} of {len(packets)}")
        return cpu
    finally:
        proc.kill()
        proc.wait()


def compile_variant(v: Variant, work: Path) -> Path:
    d = work / v.name
    d.mkdir(exist_ok=True)
    (d / "p.p4").write_text(program(v))
    subprocess.run(["p4c-bm2-ss", "-o", str(d / "p.json"), str(d / "p.p4")], check=True,
                   capture_output=True)  # fmt: skip
    return d / "p.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--packets", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=3, help="runs per variant, interleaved")
    parser.add_argument("--only", default="", help="comma-separated variant names (and base)")
    parser.add_argument("--keep", type=Path, help="keep the programs and pcaps in this folder")
    args = parser.parse_args(argv)
    for tool in ("p4c-bm2-ss", "simple_switch"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} is not on PATH (export PATH=/opt/p4/bin:$PATH)")
    chosen = [v for v in variants()
              if not args.only or v.name == "base" or v.name in args.only.split(",")]  # fmt: skip
    work = args.keep or Path(tempfile.mkdtemp(prefix="ncina-microbench-"))
    work.mkdir(parents=True, exist_ok=True)
    builds: dict[str, Path] = {v.name: compile_variant(v, work) for v in chosen}
    packets = frames(args.packets)
    cpu: dict[str, list[float]] = {v.name: [] for v in chosen}
    for _ in range(args.repeat):
        for v in chosen:
            cpu[v.name].append(run_switch(builds[v.name], builds[v.name].parent, packets,
                                          timeout=600.0))  # fmt: skip
    us: Callable[[float], float] = lambda s: round(s / args.packets * 1e6, 3)  # noqa: E731
    base = statistics.median(cpu["base"])
    result = {"packets": args.packets, "repeat": args.repeat, "lanes": K,
              "base_us_per_packet": us(base), "variants": {}}  # fmt: skip
    for v in chosen:
        if v.name == "base":
            continue
        extra = statistics.median(cpu[v.name]) - base
        result["variants"][v.name] = {
            "reps": v.reps,
            "us_per_packet_above_base": us(extra),
            "us_per_rep": us(extra / v.reps),
            "cpu_s_runs": [round(c, 2) for c in cpu[v.name]],
        }
    if not args.keep:
        shutil.rmtree(work)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
