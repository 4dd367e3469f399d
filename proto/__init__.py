"""The ncina wire protocol: header layout, payload formats, NC8 codec, scapy layers.

``docs/protocol.md`` is the specification. Public names:

- ``PORT``, ``VERSION``, ``Format``, ``Header``, ``pack``, ``parse``, ``ProtocolError``
  (``ncina.proto.header``: the fast path);
- ``ncina.proto.layers``: ``NcinaHeader``, the scapy layer (import it from there: scapy is slow
  to import and the data path does not need it);
- ``HEADER_SIZE`` (``ncina.proto.wire``: every header size and limit of the wire);
- ``ncina.proto.nc8``: the NC8 codec, and ``ncina.proto.nc_bounds``: its error bounds;
- ``ncina.proto.compressors``: the gradient compressors (codecs the worker and the aggregator's
  server mode share);
- ``ncina.proto.corpus``: the conformance corpus every backend must answer alike (scapy).
"""

from __future__ import annotations

from ncina.proto.header import (
    FLAG_POOL,
    FLAG_RESULT,
    FLAG_RETX,
    PORT,
    VERSION,
    Format,
    Header,
    ProtocolError,
    pack,
    parse,
)
from ncina.proto.wire import HEADER_SIZE

__all__ = [
    "FLAG_POOL",
    "FLAG_RESULT",
    "FLAG_RETX",
    "HEADER_SIZE",
    "PORT",
    "VERSION",
    "Format",
    "Header",
    "ProtocolError",
    "pack",
    "parse",
]
