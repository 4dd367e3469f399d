"""What an aggregator knows about a job: ``JobConfig``, its validation, and address parsing.

A job is configured once (today from the command line, later from a control API) and then read by
the slot state machine of every backend, so every limit a backend relies on is checked here, with a
message that says what to change.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ncina.proto.compressors.base import Compressor, largest_fitting
from ncina.proto.descriptor import WORKERS_WHY, check_job, check_range
from ncina.proto.header import ELEMENT_SIZE, UPLINK_FORMATS, Format
from ncina.proto.job import DEFAULT_POOL_SIZE, DEFAULT_WINDOW_MAX, JobSpec
from ncina.proto.nc8 import Window, int32_refusal, sum_bits
from ncina.proto.profiles import DEFAULT, PROFILES, TOFINO, job_window, tofino_problems
from ncina.proto.tag import check_key, key_from_hex
from ncina.proto.wire import (
    ETH_IPV4_UDP_NCINA_HEADERS,
    ETHERNET_HEADER,
    MAX_MTU,
    MAX_TOTAL_WORKERS,
    MAX_WORKERS,
    MIN_MTU,
    TAG_SIZE,
    payload_room,
)

from ncina.common.address import Address, parse_address

MAX_SEED = (1 << 64) - 1
"""A job's seed is a 64-bit unsigned word (a `bit<64>` in the P4 program, `uint64_t` in C)."""

# The job limits (MAX_WORKERS, MAX_K, MAX_POOL_SIZE, MAX_JOB_ID) and the link MTUs an aggregator
# accepts (MIN_MTU..MAX_MTU, IPv4 bytes) are the wire's (ncina.proto.wire); the worker validates
# with the same (ncina.proto.descriptor.check_job). The defaults and the default K are the job's
# (ncina.proto.job).


@dataclass(frozen=True)
class JobConfig:
    """One job: its id, ``workers`` ranks, chunk size ``k``, result format, window and pool.

    ``members`` maps a rank to its configured address; ranks not in it are learned from their
    first valid packet. Construct with ``JobConfig.create`` (which derives the window); direct
    construction validates the same way.

    Hierarchical aggregation (docs/protocol.md, "Hierarchical aggregation"): ``total_workers``
    is the number of workers of the whole tree, whose window every aggregator and worker of the
    job uses (None: ``workers``, a one-level job); ``uplink_format`` ``INT`` makes a spine, whose
    ``workers`` members are leaf aggregators sending exact partial sums of ``total_workers /
    workers`` workers each.

    ``profile`` (``ncina.proto.profiles``): ``tofino`` runs the job as the Tofino design does,
    on every backend: its window's codes capped so that sums fit 32-bit lanes, and its limits,
    refused with the design's sentences.
    """

    job: int
    workers: int
    k: int
    result_format: Format
    window: Window
    pool_size: int = DEFAULT_POOL_SIZE
    members: Mapping[int, Address] = field(default_factory=dict)
    seed: int | None = None
    # The job's shared secret for the authentication tag (docs/protocol.md); None: untagged.
    key: bytes | None = field(default=None, repr=False)
    total_workers: int | None = None
    uplink_format: Format = Format.NC8
    profile: str = DEFAULT

    def __post_init__(self) -> None:
        check_job(job=self.job, workers=self.workers, k=self.k, pool_size=self.pool_size)
        object.__setattr__(self, "uplink_format", Format(self.uplink_format))
        if self.uplink_format not in UPLINK_FORMATS:
            raise ValueError(
                f"an INA job's uplink is nc8 or int, not {self.uplink_format.name.lower()}"
            )
        total = self.total
        check_range("total workers", total, self.workers, MAX_TOTAL_WORKERS,
                    f" (at least the {self.workers} workers of this aggregator)")  # fmt: skip
        if self.uplink_format == Format.INT and total % self.workers:
            raise ValueError(
                f"a spine's {total} total workers must be a multiple of its {self.workers} "
                "leaves (every leaf serves as many workers: their partial sums are bounded "
                "by it)"
            )
        if self.seed is not None:
            check_range("seed", self.seed, 0, MAX_SEED)
        object.__setattr__(self, "result_format", Format(self.result_format))
        if self.result_format not in ELEMENT_SIZE:
            raise ValueError(
                f"{self.result_format.name.lower()} is not an INA result format (nc8, int or "
                "int32)"
            )
        if self.result_format == Format.INT32:
            refusal = int32_refusal(total, self.window.span)
            if refusal is not None:
                raise ValueError(refusal)
        if self.profile not in PROFILES:
            raise ValueError(f"a job's profile is one of {', '.join(PROFILES)}, not {self.profile}")
        if self.profile == TOFINO:
            problems = tofino_problems(
                job=self.job, workers=self.workers, k=self.k, result=self.result_format,
                uplink=self.uplink_format, keyed=self.key is not None)  # fmt: skip
            if problems:
                raise ValueError("the tofino profile cannot run this job: " + "; ".join(problems))
        # The e_max the window derives from: its floor plus the full span (a tofino window
        # caps its top code, docs/protocol.md's derivation keeps its floor).
        window_max = self.window.e_min + Window.for_job(total, 0, sum_bits(self.result_format)).span
        expected = job_window(total, window_max, self.result_format, self.profile)
        if self.window != expected:
            raise ValueError(
                f"window {self.window} is not the one docs/protocol.md derives for "
                f"{total} workers and e_max {self.window.e_max}: {expected}"
            )
        for rank in self.members:
            if not 0 <= rank < self.workers:
                raise ValueError(
                    f"member rank {rank} is out of range: job {self.job} has ranks "
                    f"0..{self.workers - 1}"
                )
        object.__setattr__(self, "members", MappingProxyType(dict(self.members)))
        if self.key is not None:
            check_key(self.key)

    @classmethod
    def create(
        cls,
        *,
        job: int,
        workers: int,
        k: int,
        result_format: Format | str,
        pool_size: int = DEFAULT_POOL_SIZE,
        window_max: int = DEFAULT_WINDOW_MAX,
        members: Iterable[tuple[int, Address]] = (),
        seed: int | None = None,
        key: bytes | str | None = None,
        total_workers: int | None = None,
        uplink_format: Format | str = Format.NC8,
        profile: str = DEFAULT,
    ) -> JobConfig:
        """Validate the parameters and build the job, deriving its window from ``workers`` and
        ``window_max`` (e_max) as docs/protocol.md specifies; ``key`` is the tag's secret, as
        bytes or hex text. Raises ``ValueError``."""
        if isinstance(key, str):
            key = key_from_hex(key)
        if isinstance(result_format, str):
            try:
                result_format = Format[result_format.upper()]
            except KeyError:
                names = ", ".join(f.name.lower() for f in ELEMENT_SIZE)
                raise ValueError(
                    f"unknown result format {result_format!r} (one of {names})"
                ) from None
        check_range("workers", workers, 1, MAX_WORKERS, WORKERS_WHY)
        if isinstance(uplink_format, str):
            uplink_format = Format[uplink_format.upper()]
        result_format = Format(result_format)
        if total_workers is not None:
            check_range("total workers", total_workers, workers, MAX_TOTAL_WORKERS,
                        f" (at least the {workers} workers of this aggregator)")  # fmt: skip
        try:
            window = job_window(total_workers or workers, window_max, result_format, profile)
        except ValueError as exc:
            raise ValueError(f"no exponent window with e_max {window_max}: {exc}") from None
        by_rank: dict[int, Address] = {}
        for rank, address in members:
            if rank in by_rank:
                raise ValueError(f"member rank {rank} is given twice")
            by_rank[rank] = address
        return cls(
            job=job,
            workers=workers,
            k=k,
            result_format=result_format,
            window=window,
            pool_size=pool_size,
            members=by_rank,
            seed=seed,
            key=key,
            total_workers=total_workers,
            uplink_format=uplink_format,
            profile=profile,
        )

    @classmethod
    def from_spec(
        cls, spec: JobSpec, *, members: Iterable[tuple[int, Address]] = (), seed: int | None = None
    ) -> JobConfig:
        """The aggregator's job of ``spec`` (whose defaults, default K and validation are the
        job's, ``ncina.proto.job``), with what only the aggregator holds: the members' fixed
        addresses and the seed of its result rounding."""
        return cls.create(
            job=spec.job, workers=spec.workers, k=spec.k, result_format=spec.result,
            pool_size=spec.pool_size, window_max=spec.window_max, members=members, seed=seed,
            key=spec.key, total_workers=spec.total_workers, uplink_format=spec.uplink,
            profile=spec.profile,
        )  # fmt: skip

    @property
    def total(self) -> int:
        """The workers whose sum the job's results are: ``total_workers``, else ``workers``."""
        return self.total_workers if self.total_workers is not None else self.workers

    def describe(self, results: str | None = None) -> str:
        """One line naming the job's settings, for logs and readiness lines; ``results`` says
        what the results are when it is not the result format (server mode)."""
        window = self.window
        results = results or f"{self.result_format.name.lower()} results"
        return (
            f"job {self.job}: {self.workers} "
            + ("leaves" if self.uplink_format == Format.INT else "workers")
            + (f" of {self.total} workers in total" if self.total != self.workers else "")
            + f", k={self.k}, "
            f"{results}, pool {self.pool_size}, "
            f"window 2^{window.e_min}..2^{window.e_max}"
            + (", tagged" if self.key is not None else "")
            + (f", {self.profile} profile" if self.profile != DEFAULT else "")
        )

    def result_seed(self) -> int:
        """The seed of the job's nc8 result rounding (docs/protocol.md, "Re-compression"):
        ``seed``, or without one a fresh random 64-bit seed (a backend asks once per job)."""
        return self.seed if self.seed is not None else secrets.randbits(64)

    @property
    def result_frame_size(self) -> int:
        """Bytes of the largest result frame on the wire, Ethernet header included."""
        return self.frame_size(self.result_format)

    def frame_size(self, fmt: Format) -> int:
        """Bytes of a frame of K elements of ``fmt`` (the job's tag included), Ethernet header
        included: the result's, or a leaf's int partial sums'."""
        tag = TAG_SIZE if self.key is not None else 0
        return ETH_IPV4_UDP_NCINA_HEADERS + self.k * ELEMENT_SIZE[fmt] + tag

    def check_mtu(self, mtu: int, fmt: Format | None = None) -> None:
        """Raise ``ValueError`` unless a full result frame (or one of K ``fmt`` elements) fits
        a link of this MTU (IP bytes)."""
        self.check_frame_room(mtu + ETHERNET_HEADER, f"MTU {mtu} + {ETHERNET_HEADER}",
                              " at this MTU", fmt)  # fmt: skip

    def check_frame_room(
        self, room: int, limit: str, scope: str = "", fmt: Format | None = None
    ) -> None:
        """Raise ``ValueError`` unless a full result frame (or one of K ``fmt`` elements),
        Ethernet header included, fits ``room`` bytes (a link's MTU, a data plane's packet
        buffer). The message names the limit (``limit``, with ``scope`` after "the largest k")
        and the largest K that fits it."""
        fmt = self.result_format if fmt is None else fmt
        frame = self.frame_size(fmt)
        if frame <= room:
            return
        size = ELEMENT_SIZE[fmt]
        largest = (room - (frame - self.k * size)) // size
        name = fmt.name.lower()
        raise ValueError(
            f"a result frame of k={self.k} {name} elements is {frame} bytes, "
            f"more than {limit}; the largest k for {name} results{scope} is {largest}"
        )


def check_mtu_range(mtu: int) -> None:
    """Raise ``ValueError`` unless ``mtu`` is a link MTU an aggregator accepts."""
    check_range("--mtu", mtu, MIN_MTU, MAX_MTU, " (IPv4's minimum to a jumbo frame)")


def check_server_mtu(config: JobConfig, compressor: Compressor, mtu: int) -> None:
    """Server mode: raise ``ValueError`` unless the compressor's largest payload of ``k``
    elements (``Compressor.max_payload_size``) fits a result frame on a link of this MTU.

    Workers cut their chunks so that every payload fits their MTU (at most ``k`` elements), and a
    server result of ``count`` elements is bounded like the uplink payload of ``count``; this
    check makes ``k`` itself a chunk that fits, so that a worker at the default chunk size needs
    no smaller one.
    """
    room = payload_room(mtu, config.key is not None)
    if compressor.max_payload_size(config.k) <= room:
        return
    raise ValueError(
        f"a {compressor.name} result of k={config.k} elements may take "
        f"{compressor.max_payload_size(config.k)} payload bytes, more than the {room} a frame "
        f"has at MTU {mtu}; the largest k for {compressor.name} at this MTU is "
        f"{largest_fitting(compressor, room, config.k)}"
    )


def parse_member(text: str) -> tuple[int, Address]:
    """``RANK=HOST:PORT`` (the ``--member`` option) to ``(rank, address)``."""
    rank_text, sep, address = text.partition("=")
    if not sep:
        raise ValueError(f"{text!r} is not RANK=HOST:PORT")
    try:
        rank = int(rank_text)
    except ValueError:
        raise ValueError(f"{text!r}: rank {rank_text!r} is not a number") from None
    if rank < 0:
        raise ValueError(f"{text!r}: rank must not be negative")
    return rank, parse_address(address, port_zero=False)
