"""The conformance corpus: named cases of datagrams and frames every backend must answer alike.

A case is a sequence of steps, each one datagram (the UDP payload) sent by a rank of the corpus
job (or by a stranger, an address that is no member) with a transport: how its Ethernet, IPv4
and UDP headers are made. A plain transport is an ordinary datagram (a UDP socket can send it);
the others need raw frames: bad UDP or IPv4 checksums, a UDP checksum of 0 ("none"), IP options,
IP fragments (in order, out of order, incomplete), bytes after the UDP datagram or after the IP
packet, and lengths that claim more than the frame holds. ``frames`` builds a step's Ethernet
frames with scapy for given addresses.

The cases cover every payload format, each header field at its edges, truncated and oversized
datagrams, the transport's corner cases and seeded loss/duplicate/reorder schedules of whole
reductions. They are written for one aggregator serving ``JOB`` (``WORKERS`` ranks, ``K``
elements, ``POOL`` slots, ``--generation GENERATION``, int, nc8 or int32 results:
``job_arguments``; the int32 job's ``--window-max`` gives it the same ``e_min``)
whose members are learned
from the first case, and are replayed in order: each case takes slots no other case uses.
What each backend must answer is what the Python reference answers (tests/test_conformance.py);
the transport rule is in docs/protocol.md ("Transport").

The same generator makes the corpus within the Tofino design's limits (``shape(TOFINO,
result)``: the design's K and code cap, the job under ``--profile tofino``); it leaves out the
cases the design cannot match, which ``left_out`` lists with their ``profiles.LACKS`` reasons
(docs/tofino.md, "The corpus within the design's limits").

``python -m ncina.proto.corpus FILE`` writes the (default) corpus as JSON
(tests/conformance/corpus.json is that file; the test checks that it is up to date).
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ncina.proto.header import (
    ELEMENT_SIZE,
    FLAG_POOL,
    FLAG_RESULT,
    FLAG_RETX,
    FLAG_TAG,
    GENERATION_SHIFT,
    Format,
)
from ncina.proto.job import job_args
from ncina.proto.nc8 import INT32_SUM_BITS
from ncina.proto.profiles import DEFAULT, DEFAULT_RESULTS, LACKS, job_window, tofino_max_k
from ncina.proto.wire import HEADER_SIZE, TAG_SIZE

SCHEMA = 1
JOB = 4242
WORKERS = 3
K = 16
POOL = 512
RESULTS = ("int", "nc8", "int32")  # the corpus is answered by a job of each result format
GENERATION = 5
STALE = 9  # the generation of an aggregator start before this one
SEED = 1  # --seed: the nc8 results' random stream
STRANGER = -1  # the sender of a step from an address that is no member
E_MAX = 10
E_MIN = E_MAX - (62 - (WORKERS - 1).bit_length())  # docs/protocol.md, "The job's window"
TOP = 62 - (WORKERS - 1).bit_length() + 1  # the largest valid exponent code, span + 1
TOP_INT32 = INT32_SUM_BITS - (WORKERS - 1).bit_length() + 1  # the same of an int32 job's window
E_MAX_INT32 = E_MIN + TOP_INT32 - 1  # the int32 job's --window-max: its window starts at E_MIN
MTU_DATAGRAM = 1500 - 20 - 8  # the largest datagram in one IPv4 packet of MTU 1500


@dataclass(frozen=True)
class Shape:
    """What a corpus is generated for (``shape`` makes one): its jobs' ``profile``
    (``ncina.proto.profiles``), their elements per chunk ``k``, the largest valid code of the
    int and nc8 jobs' window (``top``) and of the int32 job's (``top_int32``)."""

    profile: str
    k: int
    top: int
    top_int32: int


def shape(profile: str = DEFAULT, result: str | None = None) -> Shape:
    """The corpus of ``profile`` for the job of ``result`` results (``RESULTS``; None: the
    profile's default): the default profile's is the same for every result format (``K``,
    ``TOP``, ``TOP_INT32``); the tofino profile's holds as many lanes as the design does for
    ``result`` (``profiles.tofino_max_k``: so its nc8 corpus is shorter) and its windows the
    design's code cap."""
    result = result or DEFAULT_RESULTS[profile]
    k = K if profile == DEFAULT else tofino_max_k(result)
    top = job_window(WORKERS, E_MAX, Format.INT, profile).span + 1
    top_int32 = job_window(WORKERS, E_MAX_INT32, Format.INT32, profile).span + 1
    return Shape(profile, k, top, top_int32)


BEYOND_THE_DESIGN = (
    ("transport_", "transport"),
    ("oversized_fragmented", "transport"),
    ("oversized_count_match", "transport"),
    ("both_versions_interleaved", "claim"),
    ("chunk_mismatch", "claim"),
    ("generation_not_joined", "joined"),
    ("resend_limit", "resend_limit"),
)
"""The cases (by name prefix) a corpus of the tofino profile leaves out, each with the feature
the Tofino design lacks for it (``profiles.LACKS``; docs/tofino.md, "The corpus within the
design's limits", prints the list)."""


@dataclass(frozen=True)
class Step:
    """One datagram from ``sender`` (a rank, or ``STRANGER``) and how it travels.

    ``transport`` keys (all optional; empty: an ordinary datagram):
    ``udp_checksum`` ``"bad"`` or ``"none"`` (0); ``ip_checksum`` ``"bad"``; ``ip_options`` hex
    bytes; ``fragment`` bytes of IP payload per fragment (a multiple of 8) with ``order``, the
    indices of the fragments sent, in sending order (default: all, in order); ``trailer`` bytes
    in the IP payload after the UDP datagram; ``padding`` bytes in the frame after the IP packet;
    ``udp_length`` added to the UDP length field; ``ip_length`` added to the IP total length;
    ``ihl`` the IPv4 header length field.
    """

    sender: int
    datagram: bytes
    transport: dict[str, Any] = field(default_factory=dict)

    @property
    def plain(self) -> bool:
        """Whether an ordinary UDP socket can send this step."""
        return not self.transport

    def to_json(self) -> dict[str, Any]:
        return {"from": self.sender, "datagram": self.datagram.hex(), "transport": self.transport}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Step:
        return cls(data["from"], bytes.fromhex(data["datagram"]), dict(data["transport"]))


@dataclass(frozen=True)
class Case:
    """A named sequence of steps and what it is about."""

    name: str
    about: str
    steps: tuple[Step, ...]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "about": self.about,
                "steps": [s.to_json() for s in self.steps]}  # fmt: skip

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Case:
        return cls(data["name"], data["about"], tuple(Step.from_json(s) for s in data["steps"]))


def datagram(
    *, slot: int, codes: bytes | Sequence[int], rank: int = 0, offset: int | None = None,
    k: int = K, **fields: Any,
) -> bytes:  # fmt: skip
    """An uplink datagram of the corpus job built with the scapy layer (a chunk of ``slot`` at
    offset ``slot * k`` unless ``offset`` is given); ``fields`` override any header field
    (``version``, ``flags``, ``format``, ``emin``, ``job``, ``count`` ...)."""
    from ncina.proto.layers import NcinaHeader
    from scapy.packet import Raw

    payload = bytes(codes)
    header: dict[str, Any] = {
        "flags": 0, "format": Format.NC8, "emin": E_MIN, "job": JOB, "rank": rank,
        "slot": slot, "count": len(payload), "offset": slot * k if offset is None else offset,
    }  # fmt: skip
    header.update(fields)
    return bytes(NcinaHeader(**header) / Raw(payload))


def retransmission(data: bytes) -> bytes:
    """The same datagram with the ``RETX`` flag."""
    return data[:1] + bytes([data[1] | FLAG_RETX]) + data[2:]


class _Slots:
    """Hands out the slots of the pool, slot 0 (the opening reduction's) first."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int = 1) -> int:
        first = self.next
        self.next += n
        if self.next > introduction_slot(WORKERS - 1):  # introductions', barriers', last_slot's
            raise RuntimeError(f"the corpus needs more than {introduction_slot(WORKERS - 1)} "
                               "slots")  # fmt: skip
        return first


def _codes(rnd: random.Random, s: Shape, count: int | None = None) -> list[int]:
    """``count`` (None: ``s.k``) valid codes of both signs, about 20 % zeros, in every result
    format's window (up to ``s.top_int32``; ``window_edges`` has the others' top codes)."""
    return [rnd.choice((0, 0x80)) | rnd.randint(1, s.top_int32) if rnd.random() < 0.8 else 0
            for _ in range(s.k if count is None else count)]  # fmt: skip


def _reduction(s: Shape, slot: int, codes: Sequence[Sequence[int]], **fields: Any) -> list[Step]:
    """Every rank's contribution to ``slot``, rank 0 first."""
    return [Step(r, datagram(k=s.k, slot=slot, codes=c, rank=r, **fields))
            for r, c in enumerate(codes)]  # fmt: skip


def _basics(s: Shape, slots: _Slots) -> Iterator[Case]:
    alone = [Step(r, datagram(k=s.k, slot=barrier_slot(r), codes=[1] * s.k, rank=r))
             for r in range(WORKERS)]
    yield Case("open", "every rank contributes 1s to slot 0: the members are learned; and each "
               "rank alone to its barrier slot (every case's barrier: barrier())",
               (*_reduction(s, slots.take(), [[1] * s.k] * WORKERS), *alone))  # fmt: skip
    edge = [s.top, s.top | 0x80, 1, 0x81, 0, 0x80] + [s.top] * (s.k - 6)
    above = " (bad_code at an int32 job)" if s.top > s.top_int32 else ""
    yield Case("window_edges", "the largest and smallest codes of both signs and both zeros: "
               f"exact int sums up to 3 * 2**{s.top - 1}{above}",
               tuple(_reduction(s, slots.take(), [edge] * 3)))
    edge = [s.top_int32, s.top_int32 | 0x80, 1, 0x81, 0, 0x80] + [s.top_int32] * (s.k - 6)
    yield Case("window_edges_int32", "the int32 window's largest codes: its most positive and "
               "most negative sums, +-3 * 2**28", tuple(_reduction(s, slots.take(), [edge] * 3)))
    rnd = random.Random(11)
    yield Case("short_chunk", "three elements at an arbitrary offset",
               tuple(_reduction(s, slots.take(), [_codes(rnd, s, 3)] * 3, offset=12345)))
    yield Case("one_element", "count 1",
               tuple(_reduction(s, slots.take(), [_codes(rnd, s, 1) for _ in range(3)])))
    yield Case("offset_max", "the largest offset, 2**32 - 1",
               tuple(_reduction(s, slots.take(), [_codes(rnd, s) for _ in range(3)],
                                offset=0xFFFFFFFF)))  # fmt: skip
    yield Case("last_slot", "slot POOL - 1",
               tuple(_reduction(s, POOL - 1, [_codes(rnd, s) for _ in range(3)])))
    slot = slots.take()
    yield Case("pool_version_1", "a reduction in version 1 of a fresh slot",
               tuple(_reduction(s, slot, [_codes(rnd, s) for _ in range(3)], flags=FLAG_POOL)))
    slot = slots.take()
    gen = GENERATION << GENERATION_SHIFT
    # Issue 37: the generation from a rank that said no hello to this start (a restart that
    # drew the same generation) is stale, and changes nothing (the slot is used next).
    early = Step(0, datagram(k=s.k, slot=slot, codes=[1] * s.k, rank=0, flags=gen))
    yield Case("generation_not_joined", "a packet that carries the aggregator's generation from "
               "a rank that said no hello to this start: a restart notice; a probe (a hello with "
               "RETX) is answered with RETX and joins nothing",
               (early, Step(0, _hello(s, 0, probe=True)), early))  # fmt: skip
    yield Case("generation_joined", "every rank's hello joins it to this start",
               tuple(Step(r, _hello(s, r)) for r in range(WORKERS)))
    yield Case("generation_stamped", "uplink packets that carry the aggregator's generation, "
               "from ranks that said hello to this start",
               tuple(_reduction(s, slot, [_codes(rnd, s) for _ in range(3)], flags=gen)))


def _hello(s: Shape, rank: int, probe: bool = False, nonce: int = 0) -> bytes:
    """Rank's hello to the corpus job (a ``probe``: one that does not join the rank) with its
    incarnation ``nonce`` (0: none)."""
    from ncina.proto.descriptor import Descriptor, pack_job_datagram

    mine = Descriptor(mode=int(Format.NC8), workers=WORKERS, pool_size=POOL, k=s.k, e_max=E_MAX,
                      e_min=E_MIN, keyed=False, compressor=0)  # fmt: skip
    return pack_job_datagram(mine, job=JOB, rank=rank, probe=probe, nonce=nonce)


def _single(name: str, about: str, data: bytes, sender: int = 0) -> Case:
    return Case(name, about, (Step(sender, data),))


def _handshakes(s: Shape, slots: _Slots) -> Iterator[Case]:
    """The job handshake (docs/protocol.md, "Job handshake"): hellos answered with the job's
    descriptor, "no such job" or "not authentic"; malformed job datagrams dropped."""
    from ncina.proto.descriptor import Descriptor, pack_job_datagram

    mine = Descriptor(mode=int(Format.NC8), workers=WORKERS, pool_size=POOL, k=s.k, e_max=E_MAX,
                      e_min=E_MIN, keyed=False, compressor=0)  # fmt: skip
    hello = pack_job_datagram(mine, job=JOB, rank=0)
    yield _single("job_hello", "a hello: answered with the job's descriptor", hello)
    yield _single("job_hello_stranger", "a hello of rank 2 from a stranger: answered, no member "
                  "learned", pack_job_datagram(mine, job=JOB, rank=2), sender=STRANGER)
    yield _single("job_hello_unknown_job", "a hello for a job nobody serves: no such job",
                  pack_job_datagram(mine, job=JOB + 1, rank=0))
    yield _single("job_hello_tagged", "a tagged hello to the unkeyed job: not authentic",
                  pack_job_datagram(mine, job=JOB, rank=0, key=bytes(16)))
    yield _single("job_hello_result", "a hello with the RESULT flag",
                  hello[:1] + bytes([hello[1] | FLAG_RESULT]) + hello[2:])
    yield _single("job_short", "a job datagram one byte short", hello[:-1])
    yield _single("job_count_2", "a job datagram of count 2", hello[:11] + b"\x02" + hello[12:])
    yield _single("job_chunk", "a job datagram (format 3) of a chunk's length",
                  datagram(k=s.k, slot=slots.take(), codes=[1] * s.k, format=Format.JOB))


def _header_edges(s: Shape, slots: _Slots) -> Iterator[Case]:
    """One datagram each, to a fresh slot: every header field at and around its edges."""
    good = [1] * s.k
    for version in (0, 2, 255):
        yield _single(f"version_{version}", "an unknown protocol version",
                      datagram(k=s.k, slot=slots.take(), codes=good, version=version))
    for name, flags in (("result", FLAG_RESULT), ("retx", FLAG_RETX), ("pool", FLAG_POOL),
                        ("tag_unkeyed", FLAG_TAG), ("stale", STALE << GENERATION_SHIFT),
                        ("generation_15", 15 << GENERATION_SHIFT), ("all", 0xFF)):  # fmt: skip
        yield _single(f"flags_{name}", f"flags 0x{flags:02x}",
                      datagram(k=s.k, slot=slots.take(), codes=good, flags=flags))
    for fmt in (Format.INT, Format.INT32):
        name = fmt.name.lower()
        yield _single(f"format_{name}_uplink", f"an {name} payload (a result's format) on uplink",
                      datagram(k=s.k, slot=slots.take(), codes=bytes(ELEMENT_SIZE[fmt] * s.k),
                               count=s.k, format=fmt))  # fmt: skip
    for fmt in (5, 255):
        yield _single(f"format_{fmt}", "an undefined payload format",
                      datagram(k=s.k, slot=slots.take(), codes=good, format=fmt))
    yield from _handshakes(s, slots)
    blob = bytes([0, 0, 0, 0, s.k]) + bytes(12)  # a compressor payload's head names K elements
    blobs = (
        ("blob", "a server-mode blob to an INA job", {}),
        ("blob_empty", "a blob without payload", {"codes": b""}),
        ("blob_count_0", "a blob of 0 elements", {"count": 0}),
        ("blob_result", "a blob with the RESULT flag", {"flags": FLAG_RESULT}),
        ("blob_tagged", "a blob with a tag, to an unkeyed job", {"flags": FLAG_TAG}),
        ("blob_unknown_job", "a blob to a job nobody serves", {"job": JOB + 1}),
        ("blob_version_2", "a blob of an unknown version", {"version": 2}),
        ("blob_stale", "a blob of an earlier generation", {"flags": STALE << GENERATION_SHIFT}),
    )
    for name, about, fields in blobs:
        fields = {"codes": blob, "count": s.k, "format": Format.BLOB, **fields}
        yield _single(f"format_{name}", about, datagram(k=s.k, slot=slots.take(), **fields))
    for emin in (E_MIN - 1, E_MIN + 1, -128, 127):
        yield _single(f"emin_{emin}", "another exponent window",
                      datagram(k=s.k, slot=slots.take(), codes=good, emin=emin))
    for job in (JOB + 1, 0, 0xFFFF):
        yield _single(f"job_{job}", "a job nobody serves",
                      datagram(k=s.k, slot=slots.take(), codes=good, job=job))
    for rank in (WORKERS, 0xFFFF):
        yield _single(f"rank_{rank}", "a rank beyond the job's",
                      datagram(k=s.k, slot=slots.take(), codes=good, rank=rank))
    yield _single("rank_of_another_member", "rank 1 from rank 0's address",
                  datagram(k=s.k, slot=slots.take(), codes=good, rank=1))
    yield _single("stranger_as_rank_0", "rank 0 from an address that is no member",
                  datagram(k=s.k, slot=slots.take(), codes=good), sender=STRANGER)
    for slot in (POOL, 0xFFFF):
        yield _single(f"slot_{slot}", "a slot beyond the pool",
                      datagram(k=s.k, slot=slot, codes=good))
    yield _single("count_0", "zero elements and no payload",
                  datagram(k=s.k, slot=slots.take(), codes=b""))
    yield _single("count_0_payload", "count 0 with a payload",
                  datagram(k=s.k, slot=slots.take(), codes=good, count=0))
    yield _single("count_k_plus_1", "K + 1 elements",
                  datagram(k=s.k, slot=slots.take(), codes=[1] * (s.k + 1)))
    yield _single("count_max", "count 65535 with K codes",
                  datagram(k=s.k, slot=slots.take(), codes=good, count=0xFFFF))
    yield _single("payload_short", "one code fewer than count",
                  datagram(k=s.k, slot=slots.take(), codes=[1] * (s.k - 1), count=s.k))
    yield _single("payload_long", "one code more than count",
                  datagram(k=s.k, slot=slots.take(), codes=[1] * (s.k + 1), count=s.k))
    for code in (s.top + 1, 0x7F, 0xFF, (s.top + 1) | 0x80):
        yield _single(f"code_{code:#04x}", "a code above the window",
                      datagram(k=s.k, slot=slots.take(), codes=[code] + [1] * (s.k - 1)))
    slot = slots.take()
    for size in (0, 1, HEADER_SIZE - 1):
        yield _single(f"truncated_{size}", "shorter than the header",
                      datagram(k=s.k, slot=slot, codes=good)[:size])
    yield _single("header_only", "a header of 16 elements without payload",
                  datagram(k=s.k, slot=slots.take(), codes=b"", count=s.k))
    yield _single("tag_bytes_unkeyed", "a tagged datagram (8 tag bytes) to an unkeyed job",
                  datagram(k=s.k, slot=slots.take(), codes=good + [0] * TAG_SIZE, count=s.k,
                           flags=FLAG_TAG))  # fmt: skip
    yield _single("oversized_mtu", "the largest datagram of one 1500-byte IP packet",
                  datagram(k=s.k, slot=slots.take(), codes=[1] * (MTU_DATAGRAM - HEADER_SIZE),
                           count=s.k))  # fmt: skip
    yield _single("oversized_count_match", "count 2000 with 2000 codes",
                  datagram(k=s.k, slot=slots.take(), codes=[1] * 2000))


def _transport(s: Shape, slots: _Slots) -> Iterator[Case]:
    """Rank 0's contribution travels oddly, then ranks 1 and 2 contribute plainly and rank 0
    retransmits plainly: whether the odd one arrived shows in what comes back."""
    rnd = random.Random(23)
    variants: list[tuple[str, str, dict[str, Any]]] = [
        ("udp_checksum_bad", "a wrong UDP checksum", {"udp_checksum": "bad"}),
        ("udp_checksum_none", "UDP checksum 0: none", {"udp_checksum": "none"}),
        ("ip_checksum_bad", "a wrong IPv4 header checksum", {"ip_checksum": "bad"}),
        ("ip_options_nop", "IPv4 options: three NOPs and an end", {"ip_options": "01010100"}),
        ("ip_options_router_alert", "IPv4 option router alert", {"ip_options": "94040000"}),
        ("fragments_in_order", "three fragments, in order", {"fragment": 16}),
        ("fragments_reversed", "three fragments, last first",
         {"fragment": 16, "order": [2, 1, 0]}),
        ("fragments_tiny", "five 8-byte fragments, shuffled",
         {"fragment": 8, "order": [3, 0, 4, 2, 1]}),
        ("fragment_first_only", "the first fragment alone", {"fragment": 16, "order": [0]}),
        ("fragment_middle_missing", "the first and last fragments only",
         {"fragment": 16, "order": [0, 2]}),
        ("fragments_udp_checksum_bad", "fragments of a datagram with a wrong UDP checksum",
         {"fragment": 16, "udp_checksum": "bad"}),
        ("fragments_ip_checksum_bad", "fragments with wrong IPv4 header checksums",
         {"fragment": 16, "ip_checksum": "bad"}),
        ("fragments_ip_options", "fragments with IPv4 options",
         {"fragment": 16, "ip_options": "01010100"}),
        ("udp_trailer", "3 bytes in the IP payload after the UDP datagram", {"trailer": 3}),
        ("ethernet_padding", "20 bytes of Ethernet padding after the IP packet", {"padding": 20}),
        ("udp_length_over", "a UDP length 1 byte beyond the IP payload", {"udp_length": 1}),
        ("udp_length_short", "a UDP length below the UDP header", {"udp_length": -33}),
        ("ip_length_over", "an IP total length beyond the frame", {"ip_length": 4}),
        ("ip_ihl_4", "an IPv4 header length of 16 bytes", {"ihl": 4}),
    ]
    for name, about, transport in variants:
        slot = slots.take()
        codes = [_codes(rnd, s) for _ in range(WORKERS)]
        plain = _reduction(s, slot, codes)
        odd = Step(0, plain[0].datagram, transport)
        steps = (odd, *plain[1:], Step(0, retransmission(plain[0].datagram)))
        yield Case(f"transport_{name}", about, steps)
    slot = slots.take()
    big = datagram(k=s.k, slot=slot, codes=[1] * 4000)
    yield Case("oversized_fragmented", "a 4016-byte datagram in three 1480-byte fragments",
               (Step(0, big, {"fragment": 1480}),))
    yield Case("oversized_fragmented_bad_checksum", "the same with a wrong UDP checksum",
               (Step(0, big, {"fragment": 1480, "udp_checksum": "bad"}),))


def _recovery(s: Shape, slots: _Slots) -> Iterator[Case]:
    """The slot rules of docs/protocol.md under loss, duplicates and reordering."""
    rnd = random.Random(31)
    slot = slots.take()
    codes = [_codes(rnd, s) for _ in range(WORKERS)]
    plain = _reduction(s, slot, codes)
    yield Case("duplicate_before_completion", "rank 0 twice (once as RETX), then the others",
               (plain[0], plain[0], Step(0, retransmission(plain[0].datagram)), *plain[1:]))
    done = _reduction(s, slots.take(), [_codes(rnd, s) for _ in range(3)])
    yield Case("resend_after_completion", "a completed slot's result asked for again",
               (*done, Step(1, retransmission(done[1].datagram))))
    slot = slots.take()
    old, new = [_codes(rnd, s) for _ in range(3)], [_codes(rnd, s) for _ in range(3)]
    first = _reduction(s, slot, old, offset=0)
    second = _reduction(s, slot, new, flags=FLAG_POOL, offset=s.k)
    yield Case("previous_version_resend", "rank 2 lost version 0's result while the others "
               "moved on to version 1",
               (*first, second[0], second[1], Step(2, retransmission(first[2].datagram)),
                second[2]))  # fmt: skip
    slot = slots.take()
    a = _reduction(s, slot, [_codes(rnd, s) for _ in range(3)])
    b = _reduction(s, slot, [_codes(rnd, s) for _ in range(3)], flags=FLAG_POOL, offset=7 * s.k)
    yield Case("both_versions_interleaved", "versions 0 and 1 of one slot in flight at once",
               (a[0], b[0], a[1], b[1], b[2], a[2]))
    slot = slots.take()
    c = _reduction(s, slot, [_codes(rnd, s) for _ in range(3)])
    mismatch = Step(1, datagram(k=s.k, slot=slot, codes=_codes(rnd, s), rank=1,
                                offset=slot * s.k + 1))  # fmt: skip
    yield Case("chunk_mismatch", "rank 1 names another offset for the slot rank 0 started",
               (c[0], mismatch, c[1], c[2]))
    slot = slots.take()
    d = _reduction(s, slot, [_codes(rnd, s) for _ in range(3)])
    stale = Step(1, datagram(k=s.k, slot=slot, codes=[1] * s.k, rank=1,
                             flags=STALE << GENERATION_SHIFT))  # fmt: skip
    yield Case("stale_generation", "a packet of an earlier generation mid-reduction",
               (d[0], stale, d[1], d[2]))
    short = Step(1, datagram(k=s.k, slot=slot, codes=[1], rank=1, flags=STALE << GENERATION_SHIFT))
    yield Case("stale_generation_short", "a stale packet of one code: a restart notice, the "
               "header alone (no amplified reflection)", (short,))
    e = _reduction(s, slots.take(), [_codes(rnd, s) for _ in range(3)])
    yield Case("resend_limit", "rank 0 asks 6 times at once for a result it holds: a burst of 4 "
               "answers, then resend_limit", (*e, *[Step(0, retransmission(e[0].datagram))] * 6))
    for seed in range(3):
        yield Case(f"schedule_{seed}", "seeded loss, duplicates and reordering over reused "
                   "slots (pool versions flip)", tuple(_schedule(s, slots.take(2), seed)))


def _schedule(s: Shape, base: int, seed: int, rounds: int = 8) -> Iterator[Step]:
    """SwitchML rounds over slots ``base`` and ``base + 1``: each round's packets shuffled, some
    lost (sent again later with RETX), some duplicated, results asked for again, and the
    previous round's packets retransmitted late."""
    rnd = random.Random(100 + seed)
    previous: list[Step] = []
    for chunk in range(rounds):
        slot, version = base + chunk % 2, (chunk // 2) % 2
        count = rnd.randint(1, s.k)
        packets = [Step(r, datagram(k=s.k, slot=slot, codes=_codes(rnd, s, count), rank=r,
                                    offset=(base + chunk) * s.k,
                                    flags=FLAG_POOL if version else 0))
                   for r in range(WORKERS)]  # fmt: skip
        sent = [p for p in packets if rnd.random() < 0.8]
        sent += [p for p in sent if rnd.random() < 0.2]  # duplicates
        late = [p for p in previous if rnd.random() < 0.2]  # a previous round's retransmission
        order = sent + [Step(p.sender, retransmission(p.datagram)) for p in late]
        rnd.shuffle(order)
        yield from order
        for p in packets:  # the lost ones, and some that were not lost, again as RETX
            if p not in sent or rnd.random() < 0.2:
                yield Step(p.sender, retransmission(p.datagram))
        previous = packets


def _new_sets(s: Shape, slots: _Slots) -> Iterator[Case]:
    """Issue 38, case 8: hellos with incarnation nonces (docs/protocol.md, "A new set of
    workers"). The barrier slots hold rounds partly filled, so even a rank's new nonce restarts
    nothing here (test_engine and test_reinit check the restart itself): every backend must keep
    the rounds and take the ranks' chunks."""
    rnd = random.Random(38)
    nonces = [Step(r, _hello(s, r, nonce=0x1000 + r)) for r in range(WORKERS)]
    yield Case("hello_nonces", "hellos with nonces, one said again (the same nonce), a probe and "
               "a stranger's hello with other nonces, a rank's new nonce while rounds are partly "
               "filled: nothing restarts, the ranks' chunks still count",
               (*nonces, nonces[1], Step(0, _hello(s, 0, probe=True, nonce=0x2000)),
                Step(STRANGER, _hello(s, 0, nonce=0x3000)), Step(0, _hello(s, 0, nonce=0x4000)),
                *_reduction(s, slots.take(), [_codes(rnd, s) for _ in range(WORKERS)],
                            flags=GENERATION << GENERATION_SHIFT)))  # fmt: skip


def _all(s: Shape) -> list[Case]:
    """Every case of the corpus of ``s``, in replay order (the opening reduction first)."""
    slots = _Slots()
    cases = [*_basics(s, slots), *_header_edges(s, slots), *_transport(s, slots),
             *_recovery(s, slots), *_new_sets(s, slots)]  # fmt: skip
    names = [c.name for c in cases]
    if len(set(names)) != len(names):
        raise RuntimeError("corpus case names must be unique")
    return cases


def generate(s: Shape | None = None) -> list[Case]:
    """The corpus of ``s`` (None: the default profile's), in replay order (the opening
    reduction first): every case within its profile's limits (``left_out`` names the others)."""
    s = s or shape()
    return [c for c in _all(s) if not _lacks(s, c.name)]


def left_out(s: Shape) -> list[tuple[str, str]]:
    """The cases the corpus of ``s`` leaves out, each with the profile's reason (``LACKS``)."""
    return [(c.name, LACKS[lack]) for c in _all(s) if (lack := _lacks(s, c.name))]


def _lacks(s: Shape, name: str) -> str | None:
    """The ``LACKS`` feature a case needs that the profile of ``s`` lacks, or None."""
    if s.profile == DEFAULT:
        return None
    return next((lack for prefix, lack in BEYOND_THE_DESIGN if name.startswith(prefix)), None)


def barrier_slot(rank: int) -> int:
    """The slot ``rank`` alone contributes to in the opening case (a round that never
    completes), out of the slots ``_Slots`` hands out and below ``last_slot``'s."""
    return POOL - 2 - rank


def introduction_slot(rank: int) -> int:
    """The slot ``rank`` alone contributes to before a replay of the profile corpus (a round
    that never completes), below the barrier slots and out of the slots ``_Slots`` hands out."""
    return barrier_slot(WORKERS - 1) - 1 - rank


def introductions(s: Shape) -> list[Step]:
    """What a replay of the corpus within the Tofino design's limits sends before its first
    case, from every rank: a contribution to its ``introduction_slot``. The twin learns a rank
    through a digest and its control plane's entries, and drops a result's copy for a rank not
    learned yet (docs/tofino.md, "How the twin learns members"), so the opening reduction's
    results would depend on how fast its control plane is; the reference replays them too."""
    return [Step(r, datagram(k=s.k, slot=introduction_slot(r), codes=[1] * s.k, rank=r))
            for r in range(WORKERS)]  # fmt: skip


def barrier(rank: int, s: Shape | None = None) -> bytes:
    """What a replay sends from ``rank`` after each case: its contribution to its barrier slot
    again, a duplicate of an incomplete round, answered by a notice that comes after
    everything the case made (rule 3 has no budget, unlike rule 2's resends)."""
    k = (s or shape()).k
    return retransmission(datagram(slot=barrier_slot(rank), codes=[1] * k, rank=rank, k=k))


def window_max(result: str | None) -> int:
    """The corpus job's ``--window-max`` for ``result``: ``E_MAX``, for int32 ``E_MAX_INT32``
    (its window, narrower, then starts at the same ``E_MIN``: the datagrams serve every job)."""
    return E_MAX_INT32 if result == "int32" else E_MAX


def job_arguments(result: str | None = None, s: Shape | None = None) -> list[str]:
    """The ``ncina aggregator`` options of the corpus job with ``result`` (one of ``RESULTS``;
    None: without ``--result``) for the corpus of ``s`` (None: the default profile's); add
    ``--listen`` and ``--stats``. Its hellos restart nothing during a replay
    (``--restart-idle`` an hour), whatever the machine's pace."""
    s = s or shape()
    window = E_MAX_INT32 if result == "int32" else None
    profile = None if s.profile == DEFAULT else s.profile
    return [*job_args(job=JOB, workers=WORKERS, k=s.k, pool_size=POOL, result=result or None,
                      window_max=window, profile=profile),
            "--generation", str(GENERATION), "--seed", str(SEED), "--restart-idle", "3600"]


def dump(cases: Sequence[Case]) -> str:
    """The corpus as JSON text (one case per line, for readable diffs)."""
    lines = [json.dumps(c.to_json(), sort_keys=True) for c in cases]
    head = json.dumps({"schema": SCHEMA, "job": job_arguments(), "results": list(RESULTS)})
    return "\n".join([head, *lines]) + "\n"


def load(text: str) -> list[Case]:
    """Cases from ``dump``'s text."""
    head, *lines = text.splitlines()
    if json.loads(head)["schema"] != SCHEMA:
        raise ValueError(f"corpus schema is not {SCHEMA}")
    return [Case.from_json(json.loads(line)) for line in lines]


def frames(
    step: Step, *, src_mac: str, dst_mac: str, src: tuple[str, int], dst: tuple[str, int],
    ip_id: int,
) -> list[bytes]:  # fmt: skip
    """The Ethernet frames of ``step`` from ``src`` (IPv4 address, UDP port) to ``dst``, in
    sending order, built with scapy; ``ip_id`` is the IPv4 identification (unique per step, so
    fragments of different steps never meet in a reassembly queue)."""
    from scapy.layers.inet import IP, UDP, fragment
    from scapy.layers.l2 import Ether
    from scapy.packet import Raw

    t = step.transport
    udp = bytearray(bytes(IP(src=src[0], dst=dst[0]) / UDP(sport=src[1], dport=dst[1])
                          / Raw(step.datagram))[20:])  # fmt: skip
    if t.get("udp_checksum") == "bad":
        udp[6:8] = (int.from_bytes(udp[6:8], "big") + 1 & 0xFFFF or 1).to_bytes(2, "big")
    elif t.get("udp_checksum") == "none":
        udp[6:8] = b"\0\0"
    if "udp_length" in t:
        udp[4:6] = (len(udp) + t["udp_length"]).to_bytes(2, "big")
    body = bytes(udp) + bytes(t.get("trailer", 0))
    options = bytes.fromhex(t.get("ip_options", ""))
    packet = IP(src=src[0], dst=dst[0], id=ip_id, proto=17, options=options) / Raw(body)
    if "fragment" in t:
        pieces = [bytes(f) for f in fragment(IP(bytes(packet)), fragsize=t["fragment"])]
        packets = [pieces[i] for i in t.get("order", range(len(pieces)))]
    else:
        packets = [bytes(packet)]
    out = []
    for raw in packets:
        ip = bytearray(raw)
        if "ip_length" in t:
            ip[2:4] = (len(ip) + t["ip_length"]).to_bytes(2, "big")
        if "ihl" in t:
            ip[0] = 0x40 | t["ihl"]
        if "ip_length" in t or "ihl" in t or t.get("ip_checksum") == "bad":
            ip[10:12] = b"\0\0"
            checksum = _ones_complement(bytes(ip[: (ip[0] & 0xF) * 4 or 20]))
            if t.get("ip_checksum") == "bad":
                checksum = checksum + 1 & 0xFFFF or 1
            ip[10:12] = checksum.to_bytes(2, "big")
        frame = bytes(Ether(src=src_mac, dst=dst_mac, type=0x0800)) + bytes(ip)
        out.append(frame + bytes(t.get("padding", 0)))
    return out


def _ones_complement(data: bytes) -> int:
    """The Internet checksum (RFC 1071) of ``data``."""
    if len(data) % 2:
        data += b"\0"
    total = sum(int.from_bytes(data[i : i + 2], "big") for i in range(0, len(data), 2))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def main(argv: Sequence[str] | None = None) -> int:
    """Write the corpus to the file named by the only argument."""
    args = sys.argv[1:] if argv is None else list(argv)
    if len(args) != 1:
        print("usage: python -m ncina.proto.corpus FILE", file=sys.stderr)
        return 2
    Path(args[0]).write_text(dump(generate()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
