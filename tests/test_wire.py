"""The wire's sizes and limits (ncina.proto.wire), and the C and P4 copies of them.

The C engines and the P4 program cannot import Python, so they keep their own ``#define``s and
``const``s; the tables below pin each one to the value it copies, so that none can drift.
A copy that is renamed or moved to another file is still found (by name, in every source file);
one that disappears fails the test until its row is updated.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from ncina.proto import header, nc8, wire
from ncina.proto.descriptor import check_job
from ncina.proto.header import Format, largest_k

ROOT = Path(__file__).resolve().parents[1]
C_FOLDERS = ("proto", "worker", "aggregator")

# C name -> the Python value it must equal.
C_EQUAL = {
    "NCE_HDR_LEN": wire.HEADER_SIZE,
    "NCE_TAG_LEN": wire.TAG_SIZE,
    "NCE_MAX_WORKERS": wire.MAX_WORKERS,
    "NCE_MAX_MTU": wire.MAX_MTU,
    "NCE_IPV4_UDP_LEN": wire.IPV4_UDP_HEADERS,
    "NCE_MAX_K": wire.MAX_K,
    "NCW_HEADER": wire.HEADER_SIZE,
    "NCW_TAG": wire.TAG_SIZE,
    "NCD_L2L4_LEN": wire.ETH_IPV4_UDP_HEADERS,
    "NCE_INT32_SUM_BITS": nc8.INT32_SUM_BITS,
    "NCE_FMT_INT32": header.Format.INT32,
}
# C buffer name -> the least it must hold.
C_AT_LEAST = {
    "RX_BYTES": wire.MAX_DATAGRAM,  # backends/socket: any datagram
    "NCW_RX_SIZE": wire.MAX_DATAGRAM,  # worker fast path: any datagram
    "TX_BYTES": wire.MAX_MTU - wire.IPV4_UDP_HEADERS,  # backends/socket: the largest result
}
# P4 constant (p4/headers.p4) -> the Python value it must equal.
P4_EQUAL = {
    "UDP_HEADER_BYTES": wire.UDP_HEADER,
    "NCINA_HEADER_BYTES": wire.HEADER_SIZE,
    "TAG_BYTES": wire.TAG_SIZE,
    "FRAME_OVERHEAD": wire.ETH_IPV4_UDP_HEADERS,
}
# Names from system headers the #defines above are written with (DPDK's rte_ether.h).
C_EXTERNAL = {"RTE_ETHER_HDR_LEN": wire.ETHERNET_HEADER}

DEFINE = re.compile(r"^\s*#\s*define\s+(\w+)\s+(.+?)\s*(?:/\*.*)?$", re.M)
CONST = re.compile(r"^\s*const\s+bit<\d+>\s+(\w+)\s*=\s*(\w+)\s*;", re.M)


def evaluate(text: str, known: dict[str, int]) -> int | None:
    """The integer value of a ``#define``'s body made of integers, known names, ``+ - * << ( )``;
    ``None`` for anything else (a macro with arguments, a cast, a string)."""
    tokens = re.findall(r"0[xX][0-9a-fA-F]+|\d+[uUlL]*|\w+|<<|[-+*()]|\S", text)
    out = []
    for token in tokens:
        if token[0].isdigit():
            out.append(str(int(token.rstrip("uUlL"), 0)))
        elif token in known:
            out.append(str(known[token]))
        elif token in ("+", "-", "*", "<<", "(", ")"):
            out.append(token)
        else:
            return None
    return eval(" ".join(out), {"__builtins__": {}})  # only integers and operators are left


def c_defines() -> dict[str, dict[str, int]]:
    """Every integer ``#define`` of the C sources: name -> {file: value}."""
    found: dict[str, dict[str, int]] = {}
    for folder in C_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.[ch]")):
            known = dict(C_EXTERNAL)
            for name, body in DEFINE.findall(path.read_text()):
                value = evaluate(body, known)
                if value is not None:
                    known[name] = value
                    found.setdefault(name, {})[str(path.relative_to(ROOT))] = value
    return found


def test_evaluate() -> None:
    assert evaluate("(RTE_ETHER_HDR_LEN + 20 + 8)", C_EXTERNAL) == 42
    assert evaluate("2048u", {}) == 2048
    assert evaluate("(4 << 20)", {}) == 4 << 20
    assert evaluate("CMSG_SPACE(sizeof(int))", {}) is None
    assert evaluate('"text"', {}) is None


@pytest.mark.parametrize("name", sorted(C_EQUAL))
def test_c_copy_equals_wire(name: str) -> None:
    defines = c_defines()
    assert name in defines, f"#define {name} is gone: update tests/test_wire.py's C_EQUAL"
    assert defines[name] == dict.fromkeys(defines[name], C_EQUAL[name])


def test_no_c_source_writes_the_largest_k_as_a_number() -> None:
    """The C limits are written from the sizes they follow from (``NCE_MAX_K`` from the MTU and
    the headers, the DPDK generator's from the engine's), never as a number of their own."""
    literal = re.compile(rf"\b{wire.MAX_K}\b")
    found = [str(path.relative_to(ROOT)) for folder in C_FOLDERS
             for path in sorted((ROOT / folder).rglob("*.[ch]"))
             if literal.search(path.read_text())]  # fmt: skip
    assert found == []


@pytest.mark.parametrize("name", sorted(C_AT_LEAST))
def test_c_buffer_holds_wire(name: str) -> None:
    defines = c_defines()
    assert name in defines, f"#define {name} is gone: update tests/test_wire.py's C_AT_LEAST"
    for path, value in defines[name].items():
        assert value >= C_AT_LEAST[name], f"{path}: {name} {value} < {C_AT_LEAST[name]}"


def test_p4_copy_equals_wire() -> None:
    consts = {name: int(value, 0) for name, value in
              CONST.findall((ROOT / "p4" / "headers.p4").read_text())}
    assert {name: consts.get(name) for name in P4_EQUAL} == P4_EQUAL


def test_sizes() -> None:
    """Hand-counted: Ethernet 14, IPv4 20, UDP 8, ncina header 16 (docs/protocol.md)."""
    assert header.HEADER.size == wire.HEADER_SIZE == 16
    assert (wire.IPV4_UDP_HEADERS, wire.ETH_IPV4_UDP_HEADERS) == (28, 42)
    assert wire.ETH_IPV4_UDP_NCINA_HEADERS == 58


def test_payload_room_and_max_k() -> None:
    assert wire.payload_room(1500) == 1456
    assert wire.payload_room(1500, tagged=True) == 1448
    assert wire.payload_room(40) == -4
    assert wire.MAX_K == 9172 == largest_k(wire.MAX_MTU, Format.NC8)
    assert largest_k(1500, Format.INT, tagged=True) == 1448 // 8


def test_limits_are_the_validators() -> None:
    """``check_job`` accepts exactly up to the wire's limits."""
    check_job(job=wire.MAX_JOB_ID, workers=wire.MAX_WORKERS, k=wire.MAX_K,
              pool_size=wire.MAX_POOL_SIZE)
    for field, limit in (("job", wire.MAX_JOB_ID), ("workers", wire.MAX_WORKERS),
                         ("k", wire.MAX_K), ("pool_size", wire.MAX_POOL_SIZE)):
        args = {"job": 1, "workers": 2, "k": 4, "pool_size": 8, field: limit + 1}
        with pytest.raises(ValueError, match=str(limit)):
            check_job(**args)
