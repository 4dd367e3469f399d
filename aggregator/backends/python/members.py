"""Members: a job's ranks and their addresses, and the authentication tag (docs/protocol.md,
"Members" and "Authentication tag"); steps 7 and 10 of "Order of checks".

A rank's address is configured (``JobConfig.members``) or learned from its first valid packet
(step 16); afterwards a packet claiming that rank from any other address is not the member's.
A datagram of a keyed job must carry the job's tag, and an unkeyed job's no tag at all.

The contributors' bitmap (bit ``r`` is rank ``r``) is per slot version: ``slots.py`` keeps it,
as the C engine's ``slots.c`` and P4's ``slots.p4`` do.
"""

from __future__ import annotations

from collections.abc import Mapping

from ncina.proto import tag
from ncina.proto.header import FLAG_TAG

from ncina.common.address import Address

# Drop reasons of the two steps.
NON_MEMBER = "non_member"
BAD_TAG = "bad_tag"


class Members(list[Address | None]):
    """The address of each of a job's ``workers`` ranks, ``None`` while unknown: a plain list
    (results go to ``members[rank]``) that remembers which addresses were configured."""

    def __init__(self, configured: Mapping[int, Address], workers: int) -> None:
        super().__init__(configured.get(rank) for rank in range(workers))
        self._configured = configured

    def accepts(self, rank: int, source: Address) -> bool:
        """Step 10 for a rank below N: an unknown rank may send from anywhere (and is learned
        once its packet is valid), a known one only from its own address."""
        known = self[rank]
        return known is None or known == source

    def learn(self, rank: int, source: Address) -> None:
        """Step 16: a valid packet's rank gets the address it came from, if it had none."""
        if self[rank] is None:
            self[rank] = source

    def forget_learned(self) -> None:
        """Back to the configured addresses only (a hello restarting an idle job: a new set of
        workers comes from new ports)."""
        self[:] = [self._configured.get(rank) for rank in range(len(self))]


def authentic(key: bytes | None, flags: int, datagram: bytes | bytearray | memoryview) -> bool:
    """Step 7: whether a datagram's authentication is what its job asks for: no ``TAG`` flag for
    a job without a key; the ``TAG`` flag and a tag that verifies with the job's key otherwise."""
    if key is None:
        return not flags & FLAG_TAG
    return bool(flags & FLAG_TAG) and tag.verify(key, datagram)
