"""The worker's C data path: one INA all-reduce per C call (``transfer.c``, ``timing.c``,
``window.c``).

``AllreduceClient`` uses it by default in INA mode (``data_path="c"``); the Python loop
(``ncina.worker.transfer.Transfer``) stays the reference, selectable with ``data_path="python"``
or ``NCINA_DATA_PATH=python``. The C code does what ``Transfer`` does (slot window, pool versions,
self-clocking under the congestion window, RTO and RETX, generations, notices, the tag), and
fuses the NC8 encode into the send and the decode into the receive; the whole transfer runs
with the GIL released (cffi releases it for the duration of every call). The extension is
built by ``ncina.common.cbuild`` from this folder's C files and ``proto/``'s ``nc8.c`` and
``blake2b.c``; :func:`load` raises ``RuntimeError`` saying why when it cannot be built.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Protocol

import numpy as np

from ncina.common.cbuild import build_extension

HERE = Path(__file__).resolve().parent
HEADERS = ("timing.h", "window.h", "transfer.h")
SOURCES = ("timing.c", "window.c", "transfer.c")
PROTO_SOURCES = ("nc8.c", "blake2b.c")
PROTO_HEADERS = ("nc8.h", "blake2b.h")
STAT_KEYS = (  # the counters of struct ncw_stats, named as the client's stats
    "packets_sent", "packets_received", "bytes_sent", "bytes_received", "retransmissions",
    "bytes_retransmitted", "timeouts", "results_ignored", "notices", "bad_tag", "saturated",
    "send_refused", "held_back",
)
TIMER_FIELDS = ("initial", "cap", "floor", "rto", "srtt", "rttvar", "samples", "outliers",
                "streak")  # fmt: skip
# The congestion window's state (``window.CongestionWindow``'s attributes, struct ncw_cwnd).
WINDOW_FIELDS = ("pool", "adaptive", "cwnd", "base", "delay", "round_min", "round_results",
                 "round_size", "slow_start", "saved", "saved_slow_start", "stalls")  # fmt: skip
FLAGS = ("adaptive", "slow_start", "saved_slow_start")  # the WINDOW_FIELDS that are booleans
GSO_ENV = "NCINA_UDP_GSO"  # "0": send every datagram on its own (no UDP_SEGMENT)
GRO_ENV = "NCINA_UDP_GRO"  # "0": receive every datagram on its own (no UDP_GRO)
# ncw_run's results, as transfer.h defines them (load() checks); negative ones are -errno.
DONE, AGAIN, TIMEOUT, RESTARTED = 0, 1, 2, 3
_CONSTANT = re.compile(r"#define NCW_[A-Z]+ -?\d+\b")  # integer constants cffi can take


def udp_batching() -> tuple[bool, bool]:
    """Whether a C data path sends runs as UDP GSO and receives UDP GRO buffers: both unless
    ``NCINA_UDP_GSO=0`` / ``NCINA_UDP_GRO=0`` (the workers' transfer, the fabric's echo)."""
    return os.environ.get(GSO_ENV, "1") != "0", os.environ.get(GRO_ENV, "1") != "0"


class Timer(Protocol):
    """The RTO state the C timer copies in and out (``timing.RtoEstimator``'s attributes)."""

    initial: float
    cap: float
    floor: float
    rto: float
    srtt: float
    rttvar: float
    samples: int
    outliers: int
    streak: int


class Window(Protocol):
    """The congestion window state the C window copies in and out
    (``window.CongestionWindow``'s attributes)."""

    pool: int
    adaptive: bool
    cwnd: float
    base: float
    delay: float
    round_min: float
    round_results: int
    round_size: int
    slow_start: bool
    saved: float
    saved_slow_start: bool
    stalls: int


@dataclass
class Outcome:
    """How one C transfer ended."""

    status: int
    """``DONE``, ``TIMEOUT``, ``RESTARTED`` or ``-errno``."""
    saturated: int
    """Elements clipped to the top of the window by the encoder (counted in the stats too)."""
    seen_generation: int
    """With ``RESTARTED``: the generation that is not the client's."""
    outstanding: list[int]
    """The slots still waiting for a result (with ``TIMEOUT``)."""
    waiting: list[tuple[int, int | None]]
    """Per outstanding slot: its chunk's element count, and the bitmap of the ranks the
    aggregator holds for the chunk from its latest notice about it (None: no such notice)."""
    bad_code: tuple[int, int] | None
    """The first flat index of an NC8 result code above 64 and the code, or None."""


def _proto_dir() -> Path:
    """The folder of the proto C sources (the repository's proto/, or the installed package)."""
    import ncina.proto

    return Path(ncina.proto.__file__).resolve().parent


def cdef() -> str:
    """The declarations of timing.h and transfer.h that cffi parses: everything but the
    preprocessor lines, except the integer constants."""
    lines = []
    for name in HEADERS:
        for line in (HERE / name).read_text().splitlines():
            if not line.lstrip().startswith("#") or _CONSTANT.match(line):
                lines.append(line)
    return "\n".join(lines)


@cache
def load() -> ModuleType:
    """Build (cached in ``~/.cache/ncina``) and import the extension; ``RuntimeError`` naming
    what is missing when it cannot be built."""
    proto = _proto_dir()
    module = build_extension(
        "ncina_worker",
        cdef(),
        [*(HERE / s for s in SOURCES), *(proto / s for s in PROTO_SOURCES)],
        preamble='#include "transfer.h"\n',
        extra_compile_args=("-O3", "-std=gnu11", "-Wall", "-Wextra"),
        include_dirs=[HERE, proto],
        depends=[*(HERE / h for h in HEADERS), *(proto / h for h in PROTO_HEADERS)],
    )
    lib = module.lib
    if (lib.NCW_DONE, lib.NCW_AGAIN, lib.NCW_TIMEOUT, lib.NCW_RESTARTED) != (
        DONE, AGAIN, TIMEOUT, RESTARTED
    ):
        raise RuntimeError("worker/cpath.py's result codes disagree with transfer.h")
    return module


class CTransfer:
    """The C state of one client: its socket, job, window and buffers (allocated once).

    ``slot_uses`` is the client's array of per-slot use counts (int64, shared with the Python
    path and updated in place: a use's pool version and offset derive from it); ``key`` the
    job's key or None.
    """

    def __init__(
        self,
        sock: socket.socket,
        aggregator: tuple[str, int],
        *,
        job: int,
        rank: int,
        pool_size: int,
        k: int,
        e_min: int,
        span: int,
        result_format: int,
        key: bytes | None,
        slot_uses: np.ndarray,
    ) -> None:
        module = load()
        self.ffi, self.lib = module.ffi, module.lib
        ffi = self.ffi
        if slot_uses.dtype != np.int64 or slot_uses.shape != (pool_size,):
            raise ValueError(f"slot_uses must be int64 of shape ({pool_size},)")
        # Kept alive here: the C state points into them.
        self._slot_uses = slot_uses
        self._key = ffi.new("uint8_t[]", key) if key else ffi.NULL
        cfg = ffi.new("struct ncw_config *")
        cfg.fd = sock.fileno()
        cfg.addr = int.from_bytes(socket.inet_aton(aggregator[0]), "little")
        cfg.port = aggregator[1]
        cfg.job, cfg.rank, cfg.pool_size, cfg.k = job, rank, pool_size, k
        cfg.e_min, cfg.span, cfg.result_format = e_min, span, result_format
        cfg.key, cfg.key_size = self._key, len(key) if key else 0
        cfg.slot_uses = ffi.from_buffer("int64_t[]", slot_uses, require_writable=True)
        cfg.gso, cfg.gro = udp_batching()
        self._cfg = cfg
        state = self.lib.ncw_open(cfg)
        if state == ffi.NULL:
            errno = ffi.errno
            raise OSError(errno, f"cannot set up the C data path (k {k}, pool {pool_size})")
        self.state = ffi.gc(state, self.lib.ncw_close)

    def first_nonfinite(self, x: np.ndarray) -> int:
        """The first index of float32 ``x`` that is NaN or infinite, or ``x.size``."""
        return int(self.lib.ncw_first_nonfinite(self.ffi.from_buffer("float[]", x), x.size))

    @property
    def generation(self) -> int:
        """The aggregator's generation as the C state knows it (0: not known yet)."""
        return int(self.state.generation)

    def counters(self) -> dict[str, int]:
        """The counters of the last transfer (named as the client's stats)."""
        stats = self.state.stats
        return {name: int(getattr(stats, name)) for name in STAT_KEYS}

    def run(
        self,
        x: np.ndarray,
        out: np.ndarray,
        key: int,
        timer: Timer,
        window: Window,
        generation: int,
        deadline: float,
        divisor: int = 1,
        keep: np.ndarray | None = None,
    ) -> Outcome:
        """All-reduce float32 ``x`` (1-D, non-empty, finite: the caller checks) into ``out``
        with NC8 stream key ``key``, each result divided by ``divisor`` (a float32 division, as
        ``sum / np.float32(divisor)``); the undivided results also go into ``keep`` when given
        (NC8 results: their ``x.size`` uint8 codes, int results: ``x.size`` float32 sums).
        ``timer`` and ``window`` are read before and updated after, ``generation`` is the
        client's. Waits are resumed after a signal once Python has handled it (a
        ``KeyboardInterrupt`` propagates from here)."""
        ffi, lib, state = self.ffi, self.lib, self.state
        state.stats = ffi.new("struct ncw_stats *")[0]
        for name in TIMER_FIELDS:
            setattr(state.timer, name, getattr(timer, name))
        if window.pool != state.cfg.pool_size:
            raise ValueError(f"a window of {window.pool} slots for a pool of "
                             f"{state.cfg.pool_size}")  # fmt: skip
        for name in WINDOW_FIELDS:
            setattr(state.cwnd, name, getattr(window, name))
        state.generation = generation
        state.cfg.deadline = deadline
        state.divisor = divisor
        if keep is not None and keep.nbytes < x.size * (4 if state.cfg.result_format else 1):
            raise ValueError(f"keep holds {keep.nbytes} bytes, too few for {x.size} results")
        kept = ffi.NULL if keep is None else ffi.from_buffer(keep, require_writable=True)
        state.keep = kept  # keep, the caller's, outlives the call
        try:
            lib.ncw_gro(state, 1)  # best effort: a kernel without it gives one datagram a buffer
            status = lib.ncw_begin(
                state,
                ffi.from_buffer("float[]", x),
                ffi.from_buffer("float[]", out, require_writable=True),
                x.size,
                key,
            )
            while status in (DONE, AGAIN) and state.done < state.chunks:
                status = lib.ncw_run(state)  # Python handles pending signals between calls
        finally:
            state.keep = ffi.NULL
            off = lib.ncw_gro(state, 0)  # the Python side reads one datagram a buffer
            if off < 0:
                raise OSError(-off, f"cannot switch UDP_GRO off: {os.strerror(-off)}")
            for name in TIMER_FIELDS:
                setattr(timer, name, getattr(state.timer, name))
            for name in WINDOW_FIELDS:
                value = getattr(state.cwnd, name)
                setattr(window, name, bool(value) if name in FLAGS else value)
        outstanding, waiting = [], []
        k = state.cfg.k
        for slot in range(state.cfg.pool_size):
            s = state.slots[slot]
            if s.chunk >= 0:
                outstanding.append(slot)
                start = s.chunk * k
                noticed = s.notice_offset == int.from_bytes(bytes(s.want[12:16]), "big")
                waiting.append((min(k, x.size - start), int(s.notice_held) if noticed else None))
        bad = None if state.bad_code_index < 0 else (int(state.bad_code_index), state.bad_code)
        return Outcome(int(status), int(state.stats.saturated), int(state.seen_generation),
                       outstanding, waiting, bad)  # fmt: skip
