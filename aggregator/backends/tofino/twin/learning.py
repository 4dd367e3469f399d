"""Members learned from the switch's digests (p4/twin/members.p4), as the TNA program's control
plane learns them (docs/tofino.md, "How the twin learns members"): a digest reports a rank's
first valid packet (job, rank, MAC and IPv4 address, UDP port); the control plane installs the
rank's address in egress ``member_addresses`` (its copies of a result), the twin's ``addressed``
(no more digests for it), ``members`` and ``ranks`` (its packets from another address are
``non_member``), in that order, one write. A configured member has ``ranks`` and ``members``
from the job: its digest gives the MAC address the job does not name, so only the first two.
A digest for a rank that has its address already (a second packet, or another address, before
the entries were in) installs nothing: a duplicate. ``Learning`` decides (plain data, no
switch); ``ncina.aggregator.backends.bmv2.control.Controller`` subscribes to the digests,
writes, acknowledges and, when the job goes, deletes (``forget``).
"""

from __future__ import annotations

import ipaddress
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from ncina.aggregator.backends.bmv2.control import Bmv2Error, Controller
from ncina.aggregator.backends.bmv2.entries import Entry, InstalledJob
from ncina.aggregator.backends.tofino.twin.admission import MEMBERS_TABLE, RANKS_TABLE

DIGEST = "member_digest_t"  # the digest's P4Info name (p4/tofino/headers.p4's struct)
ADDRESSES_TABLE = "NcinaEgress.rewrite.member_addresses"
ADDRESS_ACTION = "NcinaEgress.rewrite.address"
ADDRESSED_TABLE = "NcinaIngress.learn.addressed"


@dataclass(frozen=True)
class Member:
    """One digest's data: a rank's address, from its first valid packet."""

    job: int
    rank: int
    mac: str
    ip: str
    port: int


def decode(data: Any) -> Member:
    """The ``Member`` of one digest's P4Data (a struct of bitstrings in ``member_digest_t``'s
    order: job, rank, MAC address, IPv4 address, UDP port)."""
    job, rank, mac, ip, port = (int.from_bytes(m.bitstring, "big") for m in data.struct.members)
    return Member(job, rank, ":".join(f"{b:02x}" for b in mac.to_bytes(6, "big")),
                  str(ipaddress.IPv4Address(ip)), port)  # fmt: skip


class Learning:
    """The learned members of one installed job, and the stats document's ``learning``
    section: ``digests`` (digest data received), ``lists`` (digest lists, each acknowledged),
    ``members`` (ranks whose copies are addressed: their entries are in the switch),
    ``entries_installed``, ``duplicates`` (digests that installed nothing), ``entries_removed``
    (when the job went). A member is ``pending`` from its digest until ``installed`` says its
    entries were written: the stats never count a rank whose copies the switch cannot address
    yet (a test that waited for ``members`` once read the log before the rank's line)."""

    def __init__(self, job: InstalledJob) -> None:
        self.job = job
        self.addressed: dict[int, Member] = {}
        self.pending: dict[int, tuple[Member, int]] = {}  # rank: its member, entries to write
        self.digests = 0
        self.lists = 0
        self.entries_installed = 0
        self.duplicates = 0
        self.entries_removed = 0

    def entries(self, member: Member) -> list[Entry]:
        """What to install for one digest, in order (empty: a duplicate); the member is
        pending until ``installed``."""
        self.digests += 1
        rank = member.rank
        if member.job != self.job.config.job or rank in self.addressed or rank in self.pending:
            self.duplicates += 1
            return []
        made = _entries(self.job, member, configured=rank in self.job.config.members)
        self.pending[rank] = (member, len(made))
        return made

    def installed(self) -> None:
        """The pending members' entries are in the switch: their copies are addressed."""
        for rank, (member, made) in self.pending.items():
            self.addressed[rank] = member
            self.entries_installed += made
        self.pending.clear()

    def forget(self) -> list[Entry]:
        """Every learned entry, to delete (``ranks`` first: the reverse order), and nothing
        learned any more."""
        made = [e for m in self.addressed.values()
                for e in _entries(self.job, m, configured=m.rank in self.job.config.members)]
        self.addressed.clear()
        self.entries_removed += len(made)
        return made[::-1]

    def to_json(self) -> dict[str, int]:
        return {"digests": self.digests, "lists": self.lists, "members": len(self.addressed),
                "entries_installed": self.entries_installed, "duplicates": self.duplicates,
                "entries_removed": self.entries_removed}  # fmt: skip


def _entries(job: InstalledJob, member: Member, *, configured: bool) -> list[Entry]:
    key = {"hdr.nc.job": str(member.job), "hdr.nc.rank": str(member.rank)}
    made = [
        Entry(ADDRESSES_TABLE, {"hdr.bridge.job_index": str(job.index),
                                "eg_md.egress_rid": str(member.rank)}, ADDRESS_ACTION,
              {"mac": member.mac, "ip": member.ip, "port": str(member.port)}),
        Entry(ADDRESSED_TABLE, key, "NoAction"),
    ]  # fmt: skip
    if not configured:  # members before ranks: meanwhile its packets are accepted, not dropped
        made.append(Entry(MEMBERS_TABLE, {**key, "hdr.ipv4.src": member.ip,
                                          "hdr.udp.src_port": str(member.port)}, "NoAction"))
        made.append(Entry(RANKS_TABLE, key, "NoAction"))
    return made


class Listener(threading.Thread):
    """The control plane's thread in the aggregator's process: the digest lists that have
    come (one, and every other already waiting), their members learned (``Learning``), all
    their entries written in one P4Runtime write (a list a write made the last of four ranks
    of a job wait for three writes, 12-27 ms), then the lists acknowledged; ``error`` is what
    stopped it early (the server then exits with it)."""

    def __init__(self, controller: Controller, learning: Learning) -> None:
        super().__init__(name="twin-learning", daemon=True)
        self.controller = controller
        self.learning = learning
        self.stopping = threading.Event()
        self.error: Bmv2Error | None = None

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                digests = self.controller.digest_list(timeout=0.1)
                if digests is None:
                    continue
                lists = [digests]
                while (waiting := self.controller.digest_list(timeout=0)) is not None:
                    lists.append(waiting)
                self.learning.lists += len(lists)
                members = [(decode(data), d.timestamp) for d in lists for data in d.data]
                made = [e for member, _ in members for e in self.learning.entries(member)]
                if made:
                    self.controller.insert_all(made)
                    self._report(members)  # the lines first, then the counts that wait for them
                    self.learning.installed()
                for d in lists:
                    self.controller.acknowledge(d)
        except Bmv2Error as exc:
            self.error = exc

    def _report(self, members: list[tuple[Member, int]]) -> None:
        """One line per member learned: its address, when its entries were in (Unix time)
        and how long after the switch made its digest list (``members``: each with its
        list's time stamp; BMv2 stamps a list with the monotonic clock)."""
        now, monotonic = time.time(), time.monotonic_ns()
        for m, generated in members:
            if self.learning.pending.get(m.rank, (None, 0))[0] == m:
                print(f"ncina aggregator: learned job {m.job} rank {m.rank} at {m.ip}:{m.port} "
                      f"({m.mac}): entries in at {now:.6f}, "
                      f"{(monotonic - generated) / 1e6:.1f} ms after its digest",
                      file=sys.stderr, flush=True)  # fmt: skip

    def stop(self) -> None:
        """End the thread, then delete what it learned (the job goes)."""
        self.stopping.set()
        self.join()
        forgotten = self.learning.forget()
        if forgotten:
            self.controller.delete_all(forgotten)
