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

# Why a hello starts a new set of workers (``Members.new_set_comes``).
QUIET = 1  # the job was quiet for --restart-idle
NEW_INCARNATION = 2  # a rank of the set said hello with another nonce: its set is gated


class Members(list[Address | None]):
    """The address of each of a job's ``workers`` ranks, ``None`` while unknown: a plain list
    (results go to ``members[rank]``) that remembers which addresses were configured.

    It also holds the current set of workers (docs/protocol.md, "A new set of workers"):
    ``nonces[rank]``, the incarnation nonce of the rank's first hello in this set (0: none yet),
    and ``gated``: a rank's new incarnation started this set, so that only ranks that said
    their hello in it are members (a late datagram of the last set is ``non_member``)."""

    def __init__(self, configured: Mapping[int, Address], workers: int) -> None:
        super().__init__(configured.get(rank) for rank in range(workers))
        self._configured = configured
        self.nonces = [0] * workers
        self.gated = False

    def accepts(self, rank: int, source: Address) -> bool:
        """Step 10 for a rank below N: an unknown rank may send from anywhere (and is learned
        once its packet is valid), a known one only from its own address; in a gated set, only
        a rank that said its hello in it."""
        if self.gated and not self.nonces[rank]:
            return False
        known = self[rank]
        return known is None or known == source

    def new_set(self, gated: bool) -> None:
        """A hello started the job afresh: back to the configured addresses, no rank in the new
        set yet; ``gated`` (a rank's new incarnation started it): only the ranks that say hello
        in it are members."""
        self.forget_learned()
        self.nonces = [0] * len(self)
        self.gated = gated

    def said_hello(self, rank: int, nonce: int, source: Address) -> None:
        """An authentic hello of ``rank`` (no probe) carrying ``nonce`` (not 0): the rank's first
        one in this set is its incarnation; in a gated set it also learns the rank's address,
        so that a late datagram of the last set's client from its old port is ``non_member``."""
        if self.nonces[rank]:
            return
        self.nonces[rank] = nonce
        if self.gated:
            self.learn(rank, source)

    def new_set_comes(
        self, rank: int, nonce: int, source: Address, *, probe: bool, quiet: bool
    ) -> int:
        """Whether an authentic hello of ``rank`` with ``nonce`` (0: none) from ``source`` says
        that a new set of workers has come (the job then starts afresh if no round is partly
        filled): ``NEW_INCARNATION`` for a rank of this set with another nonce (a probe's never
        counts) from the IPv4 address of the rank's known one, if it has one; ``QUIET`` when the
        job has been ``quiet`` for ``--restart-idle`` and the hello has no nonce, or is a first
        one while no rank has said one with a nonce; else 0. A retransmitted hello, a
        recovery's or a probe carries its rank's nonce and starts nothing."""
        held = self.nonces[rank] if rank < len(self) else 0
        if nonce and nonce == held:
            return 0  # the same client: its hello again
        if nonce and held and not probe:
            known = self[rank]
            if known is None or known[0] == source[0]:
                return NEW_INCARNATION
        return QUIET if quiet and not (nonce and any(self.nonces)) else 0

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
