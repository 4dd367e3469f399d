"""Scapy layers for the ncina header: for tests, pcaps and dissection.

``Ether()/IP()/UDP(dport=PORT)/NcinaHeader(...)/payload`` builds a packet and dissects back, in
either direction (results come from ``sport=PORT``). The layout is the one in
``docs/protocol.md``; ``ncina.proto.header`` is the fast packer of the same bytes. ``offset`` is
the chunk's identity: in INA mode its sequence number ``u * S + slot`` (mod 2**32, ``u`` the
sender's earlier uses of the slot), which the aggregator compares in serial-number arithmetic to
recognise late packets; in server mode the chunk's element offset in the tensors' range.
"""

from __future__ import annotations

from ncina.proto.header import PORT, VERSION, Format
from scapy.fields import (
    ByteEnumField,
    ByteField,
    FlagsField,
    IntField,
    ShortField,
    SignedByteField,
)
from scapy.layers.inet import UDP
from scapy.packet import Packet, bind_layers

# Flag names from bit 0 upwards: RESULT (0x01), RETX (0x02), POOL (0x04).
FLAG_NAMES = ["RESULT", "RETX", "POOL"]


class NcinaHeader(Packet):
    """The 16-byte ncina header; the payload (codes or int64 sums) follows as ``Raw``."""

    name = "ncina"
    fields_desc = [  # noqa: RUF012 (scapy's declarative API is a class attribute)
        ByteField("version", VERSION),
        FlagsField("flags", 0, 8, FLAG_NAMES),
        ByteEnumField("format", Format.NC8, {f.value: f.name.lower() for f in Format}),
        SignedByteField("emin", -50),
        ShortField("job", 0),
        ShortField("rank", 0),
        ShortField("slot", 0),
        ShortField("count", 0),
        IntField("offset", 0),
    ]

    def mysummary(self) -> str:
        return self.sprintf(
            "ncina job=%job% rank=%rank% slot=%slot% flags=%flags% off=%offset% n=%count%"
        )


bind_layers(UDP, NcinaHeader, dport=PORT)
bind_layers(UDP, NcinaHeader, sport=PORT)
