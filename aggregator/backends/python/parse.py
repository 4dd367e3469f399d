"""Parse: steps 1-5 of docs/protocol.md, "Order of checks", the checks that need no job, and
which counters a datagram that fails them goes to.

The checks themselves are ``ncina.proto.header.parse``, the one reading of the header that the
worker shares. A failure at steps 3-5 counts under the job the header names when it is installed
(step 6 then finds it), at steps 1-2 (no readable header) always globally.
"""

from __future__ import annotations

import struct

from ncina.proto.header import (
    BAD_VERSION,
    TRUNCATED,
    Header,
    ProtocolError,
    parse,
)

_JOB_FIELD = struct.Struct("!H")
_JOB_FIELD_OFFSET = 4


def uplink(datagram: bytes | bytearray | memoryview) -> tuple[Header, memoryview] | str:
    """Steps 1-5: the header and payload of a well-formed datagram, or the drop reason."""
    try:
        return parse(datagram)
    except ProtocolError as exc:
        return exc.reason


def job_named(datagram: bytes | bytearray | memoryview, reason: str) -> int | None:
    """The job id whose counters take a datagram that ``uplink`` rejected for ``reason``: the
    header's, when the header was readable; ``None`` (the global section) otherwise."""
    if reason in (TRUNCATED, BAD_VERSION):
        return None
    return _JOB_FIELD.unpack_from(datagram, _JOB_FIELD_OFFSET)[0]
