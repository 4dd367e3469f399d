"""A job's profile: the switch design whose arithmetic and limits every backend follows for it.

``default`` is the protocol as docs/protocol.md defines it (64-bit lanes, up to ``MAX_WORKERS``
workers and ``MAX_K`` elements). ``tofino`` is the Tofino program's design (``p4/tofino/``,
docs/tofino.md): 32-bit lanes, at most ``TOFINO_MAX_K`` lanes per pass and
``TOFINO_MAX_WORKERS`` workers, int32, int or nc8 results (nc8 at most ``TOFINO_NC8_MAX_K``
lanes) of NC8 uplinks, no key. The Tofino design's numbers and what it lacks (``LACKS``) are
defined here, once: the Tofino generator, the twin's control plane
(``ncina.aggregator.backends.tofino``), ``JobSpec`` and ``JobConfig`` import them (this layer may
not import the aggregator's).

**Its window.** A tofino job keeps the protocol's window floor (``e_min`` of its ``--window-max``
and total workers) and caps its codes at :func:`tofino_max_code` (``31 - ceil(log2 N)``), so that
N workers' sums of ``+-2^(code - 1)`` stay within a signed 32-bit lane: the window's top is
``e_min + 30 - ceil(log2 N)``, 32 powers of two below the default profile's. A code above it is
``bad_code`` on every backend, as on the switch. The handshake's descriptor carries the window,
so it carries the profile (:func:`profile_of`): a worker and an aggregator of different
profiles are refused, naming it (docs/protocol.md, "Job handshake").
"""

from __future__ import annotations

from ncina.proto.header import Format
from ncina.proto.nc8 import INT32_SUM_BITS, Window, sum_bits

DEFAULT = "default"
TOFINO = "tofino"
PROFILES = (DEFAULT, TOFINO)
"""Every profile's name (``--profile``)."""

TOFINO_MAX_K = 32
"""Lanes one pass of the Tofino pipeline holds: the dense layout's K, 16 pair registers in 12
of 12 stages (``make p4-tofino``; docs/tofino-resources/tofino-k32-dense.json, docs/tofino.md
"Density"), which the v1model twin mirrors. The one-register-per-lane layout holds 12
(``make p4-tofino TOFINO_DENSE=``, docs/tofino.md "Resources")."""
TOFINO_MAX_WORKERS = 30
"""Ranks per job on Tofino: a round's contributors are a 32-bit register word, bit 30 marks a
version never used and bit 31 is the sign of ``held - full``."""
TOFINO_MAX_CODE = 31
"""Largest NC8 code a 32-bit lane can decode: +-2^30."""
TOFINO_NC8_MAX_K = 7
"""Lanes one pass holds in the build with NC8 results (``gen.lanes_p4(k, nc8=True)``): it fits
at K = 7 (12 of 12 stages, 2,984 of 4,096 PHV bits: docs/tofino-resources/tofino-k7-nc8.json);
at K = 8 egress runs out of 32-bit PHV containers, from K = 9 the egress parser passes its 160
bytes (docs/tofino.md, "NC8 results on the switch")."""

LACKS = {
    "tag": "the Tofino design has no keyed hash: a tagged datagram is dropped as bad_tag",
    "restart": "the Tofino design keeps no job epochs: a hello never restarts a job (neither "
    "after --restart-idle nor for a new set of workers' nonce)",
    "joined": "the Tofino design keeps no record of the ranks' hellos: a restart that draws the "
    "same generation is not detected (docs/protocol.md, Generations and notices)",
    "resend_limit": "the Tofino design keeps no per-rank resend budget (rule 2's resend_limit)",
    "transport": "the Tofino program checks no IPv4 header checksum, options or fragments "
    "beyond its parser's (ihl 5, offset 0, UDP), and answers frames from group sources",
    "claim": "the Tofino design lets a chunk newer than a slot version's claim it at once and "
    "identifies a chunk by its offset only (the reference refuses such non-conforming chunks "
    "as chunk_mismatch and keeps the held round: docs/tofino.md, Slots)",
    "wide_codes": "the Tofino design decodes codes up to 31 - ceil(log2 N) only, so that N "
    "workers' sums fit its 32-bit lanes",
    "k": f"the Tofino design holds at most {TOFINO_MAX_K} lanes per pass",
    "workers": f"the Tofino design holds at most {TOFINO_MAX_WORKERS} workers per job",
    "uplinks": "the Tofino design adds NC8 uplinks only",
    "nc8_k": f"the Tofino design re-compresses NC8 results for at most {TOFINO_NC8_MAX_K} lanes "
    "per pass (egress PHV and parse depth; docs/tofino.md)",
}
"""Each feature the Tofino design lacks, and why: a refusal's or a skipped test's one sentence."""


def tofino_max_code(total_workers: int) -> int:
    """The largest code a tofino job of ``total_workers`` takes: codes whose sums over every
    worker fit a signed 32-bit lane (``N * 2^(c - 1) <= 2^30``)."""
    return min(TOFINO_MAX_CODE, TOFINO_MAX_CODE - (total_workers - 1).bit_length())


def job_window(total_workers: int, e_max: int, result_format: int, profile: str) -> Window:
    """The window of a job of ``profile``: docs/protocol.md's for ``total_workers``, ``e_max``
    and the result format; under ``tofino`` the same floor with its codes capped at
    :func:`tofino_max_code`. Raises ``ValueError`` as ``Window.for_job``."""
    return capped(Window.for_job(total_workers, e_max, sum_bits(result_format)), total_workers,
                  profile)  # fmt: skip


def capped(window: Window, total_workers: int, profile: str) -> Window:
    """``window`` (docs/protocol.md's, for ``total_workers``) as a job of ``profile`` has it:
    under ``tofino`` the same floor, its codes capped at :func:`tofino_max_code`."""
    if profile == TOFINO:
        return Window(e_min=window.e_min, span=min(window.span, tofino_max_code(total_workers) - 1))
    return window


CUT = sum_bits(Format.NC8) - INT32_SUM_BITS
"""Powers of two a tofino job's window has fewer than the default profile's (32)."""


def profile_of(mode: int, span: int) -> str:
    """The profile of a job whose descriptor has ``mode`` (a result format) and a window of
    ``span`` (``e_max - e_min``): a window of 64-bit lanes spans at least 62 - 12 powers (4,096
    workers), a tofino one at most 30. int32 results have the same window in both profiles (the
    int32 rule is the design's code cap): their descriptor tells ``default``, and both profiles
    aggregate them alike."""
    return TOFINO if mode != Format.INT32 and span <= INT32_SUM_BITS else DEFAULT


def tofino_max_k(result: Format | str) -> int:
    """Lanes per pass the Tofino design holds for a job of ``result`` results:
    ``TOFINO_NC8_MAX_K`` for nc8 (the build that re-compresses them in egress), else
    ``TOFINO_MAX_K``."""
    return TOFINO_NC8_MAX_K if result in (Format.NC8, "nc8") else TOFINO_MAX_K


def tofino_problems(
    *, job: int, workers: int, k: int, result: Format | str, uplink: Format | str, keyed: bool
) -> list[str]:
    """Why the Tofino design cannot run a job, one sentence per violation (``LACKS``), in the
    order key, uplink, workers, K; empty when it can (every INA result format runs: int32, int
    and nc8, re-compressed in egress by the build with nc8 results, docs/tofino.md, at most
    ``TOFINO_NC8_MAX_K`` lanes)."""
    out = []
    job_name = f"job {job}"
    if keyed:
        out.append(f"{job_name} has a key: {LACKS['tag']}")
    if uplink != Format.NC8:
        up = uplink.name.lower() if isinstance(uplink, Format) else str(uplink)
        out.append(f"{job_name} sends {up} uplinks: {LACKS['uplinks']}")
    if isinstance(workers, int) and workers > TOFINO_MAX_WORKERS:
        out.append(f"{job_name} has {workers} workers: {LACKS['workers']}")
    if isinstance(k, int) and k > TOFINO_MAX_K:
        out.append(f"K={k}: {LACKS['k']}")
    elif isinstance(k, int) and k > tofino_max_k(result):
        out.append(f"K={k} with nc8 results: {LACKS['nc8_k']}")
    return out


DEFAULT_RESULTS = {DEFAULT: "nc8", TOFINO: "int32"}
"""Each profile's result format where a command is given none (``ncina bench allreduce|fabric``,
``make topo``'s profile run): the tofino design's is int32, its lanes' 32-bit sums as they are
(4 bytes an element; docs/tofino.md, "The tofino profile")."""
