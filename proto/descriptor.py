"""The job descriptor: a job's parameters as both sides hold them, its limits, and the handshake
datagram that compares the worker's with the aggregator's (docs/protocol.md, "Job handshake").

Job parameters are set separately on the aggregator (``JobConfig``) and on the workers
(``AllreduceClient``). A mismatch would otherwise show up as silent drops and a timeout at the
deadline, so a worker sends its descriptor before its first chunk and the aggregator answers with
its own for the job; the worker compares them field by field and fails with
:class:`JobMismatchError` naming every parameter that differs and both values.

The limits both sides validate with (:func:`check_job`) are here too, so that a worker cannot be
configured with a job no aggregator accepts.
"""

from __future__ import annotations

import hashlib
import secrets
import struct
from typing import NamedTuple

from ncina.proto.header import (
    FLAG_RESULT,
    FLAG_RETX,
    FLAG_TAG,
    GENERATION_SHIFT,
    HEADER,
    VERSION,
    Format,
)
from ncina.proto.nc8 import ROUNDING, ROUNDING_NAMES, sum_bits
from ncina.proto.profiles import profile_of
from ncina.proto.wire import (
    HEADER_SIZE,
    MAX_JOB_ID,
    MAX_K,
    MAX_POOL_SIZE,
    MAX_WORKERS,
    TAG_SIZE,
)

# ---- validation of a job, shared by JobConfig and AllreduceClient (limits: ncina.proto.wire) ----

WORKERS_WHY = " (a worker bitmap is one 64-bit register word in every backend)"


def range_problem(what: str, value: int | None, low: int, high: int, why: str = "") -> str | None:
    """The message for ``value`` outside ``low..high`` (or not given), naming ``what`` and the
    range; None when it is inside."""
    if value is None:
        return f"{what} is not given ({low}..{high}{why})"
    if not isinstance(value, int) or not low <= value <= high:
        return f"{what} must be in {low}..{high}{why}, not {value}"
    return None


def check_range(what: str, value: int, low: int, high: int, why: str = "") -> None:
    """Raise ``ValueError`` unless ``low <= value <= high``, naming ``what`` and the range."""
    problem = range_problem(what, value, low, high, why)
    if problem:
        raise ValueError(problem)


def check_job(*, job: int, workers: int, k: int, pool_size: int) -> None:
    """Raise ``ValueError`` unless the job's id, worker count, chunk size and pool size are in
    the ranges every backend and the worker accept (the one validator both sides use)."""
    check_range("job id", job, 0, MAX_JOB_ID)
    check_range("workers", workers, 1, MAX_WORKERS, WORKERS_WHY)
    check_range("k (elements per packet)", k, 1, MAX_K)
    check_range("pool size", pool_size, 1, MAX_POOL_SIZE)


# ---- the descriptor and its datagram ----

# status, mode, e_max, e_min, workers, pool size, k, keyed, uplink, compressor hash, rounding.
DESCRIPTOR = struct.Struct("!BBbbHHHBBIB")
DESCRIPTOR_SIZE = DESCRIPTOR.size  # 17
JOB_DATAGRAM_SIZE = HEADER_SIZE + DESCRIPTOR_SIZE  # 33, before a tag

# status: what an answer says (a worker's hello always carries OK).
OK = 0  # the job's descriptor
NO_SUCH_JOB = 1  # no job of that id is installed (the other fields are 0)
NOT_AUTHENTIC = 2  # the hello's tag is missing, wrong, or there for an unkeyed job

# mode: INA with nc8, int or int32 results (the Format values), or server mode.
MODE_SERVER = int(Format.BLOB)
MODE_NAMES = {int(Format.NC8): "ina (nc8 results)", int(Format.INT): "ina (int results)",
              int(Format.INT32): "ina (int32 results)", MODE_SERVER: "server"}  # fmt: skip
RESULT_NAMES = {int(Format.NC8): "nc8", int(Format.INT): "int", int(Format.INT32): "int32"}

# uplink: what the members send (docs/protocol.md, "Hierarchical aggregation"): 0 the mode's own
# (NC8 codes in INA mode, blobs in server mode), 1 exact int partial sums (a spine, whose members
# are leaf aggregators). The byte was reserved (0) before, so older peers read as UPLINK_MODE.
UPLINK_MODE = 0
UPLINK_INT = int(Format.INT)
UPLINK_NAMES = {UPLINK_MODE: "nc8 codes (workers)", UPLINK_INT: "int partial sums (leaves)"}


class Descriptor(NamedTuple):
    """A job as one side holds it (the fields of the descriptor payload, docs/protocol.md)."""

    mode: int  # MODE_NAMES: nc8 or int results (INA), or server mode
    workers: int
    pool_size: int
    k: int  # the largest element count of one chunk
    e_max: int
    e_min: int
    keyed: bool
    compressor: int  # server mode: compressor_hash of the job's compressor; INA: 0
    uplink: int = UPLINK_MODE  # UPLINK_NAMES: what the job's members send
    rounding: int = ROUNDING  # ncina.proto.nc8.ROUNDING_NAMES: the nc8 results' rounding word

    def pack(self, status: int = OK) -> bytes:
        """The 17-byte descriptor payload."""
        return DESCRIPTOR.pack(status, self.mode, self.e_max, self.e_min, self.workers,
                               self.pool_size, self.k, int(self.keyed), self.uplink,
                               self.compressor, self.rounding)  # fmt: skip

    @classmethod
    def unpack(cls, payload: bytes | memoryview) -> tuple[int, Descriptor]:
        """``(status, descriptor)`` of a 17-byte descriptor payload."""
        (status, mode, e_max, e_min, workers, pool, k, keyed, up, comp,
         rounding) = DESCRIPTOR.unpack(payload)  # fmt: skip
        return status, cls(mode, workers, pool, k, e_max, e_min, bool(keyed), comp, up, rounding)


NOWHERE = Descriptor(0, 0, 0, 0, 0, 0, False, 0)
"""The fields of a NO_SUCH_JOB answer."""


def compressor_hash(compressor: object) -> int:
    """32 bits identifying a compressor with every parameter (its ``repr``: the compressors are
    frozen dataclasses), so that two sides with different specs, defaults included, differ."""
    digest = hashlib.blake2b(repr(compressor).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big")


FLAG_PROBE = FLAG_RETX
"""The ``RETX`` bit of a ``job`` datagram (docs/protocol.md, "Job handshake"): on a hello, a
probe (the worker asks whether the aggregator restarted; the hello does not join its rank); on
the answer to a probe, the rank has not joined this start of the aggregator (a restart that may
have drawn the same generation)."""


def pack_job_datagram(
    descriptor: Descriptor, *, job: int, rank: int, status: int = OK, answer: bool = False,
    generation: int = 0, key: bytes | None = None, probe: bool = False, nonce: int = 0,
) -> bytes:
    """A ``job`` datagram: the header (format ``job``, count 1, slot 0, the ``offset`` field the
    hello's ``nonce``; ``RESULT`` and the generation on an answer; ``FLAG_PROBE`` when
    ``probe``) and the descriptor, tagged with ``key`` when given."""
    flags = (FLAG_RESULT | generation << GENERATION_SHIFT if answer else 0) | (
        FLAG_TAG if key is not None else 0
    ) | (FLAG_PROBE if probe else 0)
    datagram = HEADER.pack(VERSION, flags, Format.JOB, descriptor.e_min, job, rank, 0, 1, nonce)
    datagram += descriptor.pack(status)
    if key is not None:
        from ncina.proto.tag import sign

        datagram = sign(key, datagram)
    return datagram


NONCE_BITS = 32
"""A hello's incarnation nonce (docs/protocol.md, "A new set of workers"): the header's
``offset`` field, which a ``job`` datagram leaves unused; 0 is a hello without one."""


def draw_nonce() -> int:
    """A fresh incarnation nonce, 1..2**32-1 from the operating system's entropy: one per
    client, carried by every hello of it (retransmissions, probes and recoveries alike)."""
    return 1 + secrets.randbelow((1 << NONCE_BITS) - 1)


def hello_nonce(datagram: bytes | bytearray | memoryview) -> int:
    """The incarnation nonce of a ``job`` datagram (0: none)."""
    return int.from_bytes(datagram[12:16], "big")


def is_job_datagram(datagram: bytes | bytearray | memoryview) -> bool:
    """Whether a datagram is a version-1 ``job`` datagram (its header says so; the length is
    checked by whoever handles it)."""
    return len(datagram) >= HEADER_SIZE and datagram[0] == VERSION and datagram[2] == Format.JOB


def job_datagram_length(flags: int) -> int:
    """The only length a ``job`` datagram with these flags may have."""
    return JOB_DATAGRAM_SIZE + (TAG_SIZE if flags & FLAG_TAG else 0)


# ---- the worker's comparison ----

FIELDS = (
    ("mode", "mode"),
    ("workers", "workers"),
    ("pool_size", "pool size"),
    ("k", "k (elements per packet)"),
    ("e_max", "window e_max"),
    ("e_min", "window e_min (total workers)"),
    ("uplink", "uplink"),
    ("compressor", "compressor"),
    ("rounding", "nc8 rounding"),
)


class JobMismatchError(RuntimeError):
    """The aggregator's job is not the worker's: ``mismatches`` lists ``(parameter, worker's
    value, aggregator's value)``; the message names each and where the job is. ``sides`` names
    the two ends in the message (a leaf aggregator's handshake with its spine says so)."""

    def __init__(
        self, mismatches: list[tuple[str, str, str]], where: str,
        sides: tuple[str, str] = ("worker", "aggregator"),
    ) -> None:  # fmt: skip
        self.mismatches = mismatches
        self.where = where
        ours_name, theirs_name = sides
        text = "; ".join(f"{name}: {ours_name} {ours}, {theirs_name} {theirs}"
                         for name, ours, theirs in mismatches)  # fmt: skip
        super().__init__(f"{text} ({where})")


def _show(name: str, value: int, compressor_spec: str | None) -> str:
    if name == "mode":
        return MODE_NAMES.get(value, f"mode {value}")
    if name == "result format":
        return RESULT_NAMES[value]
    if name == "uplink":
        return UPLINK_NAMES.get(value, f"uplink {value}")
    if name == "rounding":
        return ROUNDING_NAMES.get(value, f"revision {value}")
    if name == "compressor":
        hashed = f"hash 0x{value:08x}"
        return f"{compressor_spec} ({hashed})" if compressor_spec else hashed
    return str(value)


def mismatches(
    worker: Descriptor, aggregator: Descriptor, compressor_spec: str | None = None
) -> list[tuple[str, str, str]]:
    """Every parameter on which the two descriptors disagree, as ``(name, worker's value,
    aggregator's value)`` in the order of ``FIELDS``; the rounding word's revision is compared
    for nc8 results only (no other mode rounds on the aggregator), the compressor in server mode
    only (an INA aggregator adds NC8 codes whatever produced them), where a worker's ``k`` (its
    chunk) may also be smaller than the aggregator's. ``e_min`` is named only when it is the one
    difference of the window (e_max and workers equal): then the two disagree on the total
    number of workers of a hierarchical job, which sets the window (docs/protocol.md,
    "Hierarchical aggregation"); not when the modes' windows keep sums within other bits
    (int32 results against another mode: the mode is named). Two INA jobs of different
    profiles (``ncina.proto.profiles.profile_of``: the window tells) are named ``profile``,
    last, in place of their windows. ``compressor_spec`` is the worker's spec, named in the
    message beside its hash."""
    out = []
    profiles = [profile_of(d.mode, d.e_max - d.e_min) if d.mode in RESULT_NAMES else None
                for d in (worker, aggregator)]  # fmt: skip
    for attr, name in FIELDS:
        ours, theirs = getattr(worker, attr), getattr(aggregator, attr)
        if attr in ("e_max", "e_min") and None not in profiles and profiles[0] != profiles[1]:
            continue  # the profile is named instead
        if attr == "e_min" and (worker.e_max, worker.workers, sum_bits(worker.mode)) != (
            aggregator.e_max, aggregator.workers, sum_bits(aggregator.mode)
        ):
            continue  # follows from the fields already named
        if attr == "compressor" and not (worker.mode == aggregator.mode == MODE_SERVER):
            continue
        if attr == "rounding" and not (worker.mode == aggregator.mode == int(Format.NC8)):
            continue
        if attr == "mode" and ours in RESULT_NAMES and theirs in RESULT_NAMES:
            attr = name = "result format"  # both INA: only the result format differs
        if attr == "k" and worker.mode == aggregator.mode == MODE_SERVER and ours <= theirs:
            continue  # server mode: a worker's chunk may be smaller than K (its MTU's payloads)
        if ours != theirs:
            spec = compressor_spec if attr == "compressor" else None
            out.append((name, _show(attr, ours, spec), _show(attr, theirs, None)))
    if None not in profiles and profiles[0] != profiles[1]:
        out.append(("profile", *profiles))
    return out


def key_mismatch(worker_keyed: bool, aggregator_keyed: bool) -> tuple[str, str, str]:
    """The mismatch a NOT_AUTHENTIC answer reports."""
    def show(keyed: bool) -> str:
        return "keyed" if keyed else "no key"

    if worker_keyed and aggregator_keyed:
        return ("key", "keyed", "keyed with another key (the worker's tag does not verify)")
    return ("key", show(worker_keyed), show(aggregator_keyed))
