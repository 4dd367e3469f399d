"""Admission: the job a datagram names and the job's checks, steps 6 and 8-15 of
docs/protocol.md, "Order of checks" (step 7, the tag, and 10, membership, are ``members.py``'s;
admission asks it at 10, in its place in the order).

Step 6 is the lookup of the header's job id in the jobs the aggregator holds
(``Aggregator.jobs``; ``UNKNOWN_JOB`` when there is none). ``admit`` takes a well-formed datagram
of an installed job and says whether it may enter the slot rules: flags, format, membership,
window, slot and count bounds, generation, payload. The C engine's ``admission.c`` and P4's
``admission.p4`` check in the same order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from ncina.aggregator.backends.python.members import NON_MEMBER
from ncina.proto.header import (
    BAD_COUNT,
    BAD_FLAGS,
    BAD_FORMAT,
    FLAG_RESULT,
    GENERATION_MASK,
    GENERATION_SHIFT,
    Format,
    Header,
)

from ncina.common.address import Address

if TYPE_CHECKING:
    from ncina.aggregator.backends.python.slots import JobSlots

# Drop reasons of the job-level checks (the parse-level ones are in ncina.proto.header).
UNKNOWN_JOB = "unknown_job"
WINDOW_MISMATCH = "window_mismatch"
BAD_SLOT = "bad_slot"
STALE_GENERATION = "stale_generation"
BAD_CODE = "bad_code"
BAD_PAYLOAD = "bad_payload"

# Step 15's reason by the job's uplink format: an NC8 code above the window, a spine's int
# partial sum beyond what a leaf can sum (hierarchy.py), or a server-mode blob that does not
# decode to ``count`` elements.
_UNDECODABLE = {
    int(Format.NC8): BAD_CODE, int(Format.INT): BAD_CODE, int(Format.BLOB): BAD_PAYLOAD,
}


def admit(
    job: JobSlots, header: Header, payload: memoryview | bytes, source: Address
) -> str | np.ndarray:
    """Steps 8-15 for a datagram of ``job`` (steps 1-7 passed) from ``source``: the first
    failing check's drop reason, or the contribution the slot rules take (``job.decode`` of the
    payload). ``STALE_GENERATION`` is the one failure answered, by a notice (``reply.notice``)."""
    _, flags, fmt, emin, _, rank, slot, count, _ = header
    if flags & FLAG_RESULT:
        return BAD_FLAGS  # 8
    if fmt != job.uplink_format:
        return BAD_FORMAT  # 9
    if rank >= job.workers or not job.members.accepts(rank, source):
        return NON_MEMBER  # 10
    if emin != job.emin:
        return WINDOW_MISMATCH  # 11
    if slot >= job.pool_size:
        return BAD_SLOT  # 12
    if count > job.k:
        return BAD_COUNT  # 13
    stamp = flags & GENERATION_MASK
    if stamp and (stamp != job.generation << GENERATION_SHIFT or not job.joined >> rank & 1):  # 14
        # After the header checks: a stale packet's notice names a member and a slot of the pool.
        # A generation from a rank that said no hello to this start was learned from an
        # earlier start that drew the same one: stale too.
        return STALE_GENERATION if job.generation else BAD_FLAGS
    values = job.decode(payload, count)  # 15
    if values is None:
        return _UNDECODABLE[job.uplink_format]
    return values
