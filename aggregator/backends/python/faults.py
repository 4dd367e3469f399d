"""Seeded fault injection between the Python aggregator's socket and its logic.

The kernel here has no netem, so the aggregator emulates a bad network itself, on the path between
its socket and :class:`ncina.aggregator.backends.python.pipeline.Aggregator` (the slot logic never
knows):

- ``drop_up``: a received datagram is discarded before the logic sees it (uplink loss);
- ``drop_down``: a datagram the logic wants to send is discarded instead (downlink loss, decided
  for each destination of a multicast separately);
- ``duplicate``: a received datagram is handed to the logic twice;
- ``reorder``: a received datagram is held back and handed over after the next one (or when the
  socket goes idle), so two packets swap places;
- ``drop_every`` N: a fixed pattern besides, the Nth, 2Nth, ... datagram received from each
  source address and sent to each destination address is dropped (counted as ``dropped_up`` and
  ``dropped_down``): per address, so a test knows that every peer that exchanges N datagrams
  loses one each way, whatever order the peers' datagrams arrive in.

Every random decision comes from one ``numpy.random.Generator`` seeded by ``seed``, in the order
the datagrams arrive, and is counted; the counts are the ``faults`` section of the stats document.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from ncina.aggregator.backends.python.reply import Datagrams

from ncina.common.address import Address

Handler = Callable[[bytes, Address], Datagrams]
Sender = Callable[[bytes, Address], object]

COUNTERS = ("dropped_up", "dropped_down", "duplicated", "reordered")


@dataclass(frozen=True)
class FaultConfig:
    """Probabilities (0 <= p < 1) of each fault, the seed of their decisions, and
    ``drop_every`` (0: off; else at least 2): the fixed per-address drop pattern."""

    drop_up: float = 0.0
    drop_down: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    seed: int = 0
    drop_every: int = 0

    def __post_init__(self) -> None:
        for name in ("drop_up", "drop_down", "duplicate", "reorder"):
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                raise ValueError(f"{name.replace('_', '-')} probability {p} outside [0, 1)")
        if self.drop_every < 0 or self.drop_every == 1:
            raise ValueError(f"drop-every {self.drop_every}: 0 (off) or at least 2")

    @property
    def active(self) -> bool:
        """Whether any fault can happen (otherwise the backend skips this path entirely)."""
        return any((self.drop_up, self.drop_down, self.duplicate, self.reorder,
                    self.drop_every))  # fmt: skip


class FaultyPath:
    """Receive-side and send-side faults around a datagram handler.

    ``deliver(datagram, source)`` replaces ``for d, dst in handle(datagram, source): send(d, dst)``;
    ``idle()`` hands over a held-back datagram when no other one arrives.
    """

    def __init__(self, config: FaultConfig, handle: Handler, send: Sender) -> None:
        self.config = config
        self.counts = dict.fromkeys(COUNTERS, 0)
        self._handle = handle
        self._send = send
        self._rng = np.random.default_rng(config.seed)
        self._held: tuple[bytes, Address] | None = None
        self._seen: dict[Address, int] = {}  # datagrams received from each source so far
        self._sent: dict[Address, int] = {}  # datagrams sent to each destination so far

    def deliver(self, datagram: bytes, source: Address) -> None:
        """One datagram received from ``source``, through the receive-side faults."""
        cfg = self.config
        draw = self._rng.random
        if cfg.drop_every and _nth(self._seen, source, cfg.drop_every):
            self.counts["dropped_up"] += 1
            return
        if cfg.drop_up and draw() < cfg.drop_up:
            self.counts["dropped_up"] += 1
            return
        if cfg.reorder and self._held is None and draw() < cfg.reorder:
            self.counts["reordered"] += 1
            self._held = (datagram, source)
            return
        self._process(datagram, source)
        if cfg.duplicate and draw() < cfg.duplicate:
            self.counts["duplicated"] += 1
            self._process(datagram, source)
        self.idle()

    def idle(self) -> None:
        """Hand over the held-back datagram, if any."""
        if self._held is not None:
            held, self._held = self._held, None
            self._process(*held)

    def _process(self, datagram: bytes, source: Address) -> None:
        cfg = self.config
        for out, destination in self._handle(datagram, source):
            if cfg.drop_every and _nth(self._sent, destination, cfg.drop_every):
                self.counts["dropped_down"] += 1
                continue
            if cfg.drop_down and self._rng.random() < cfg.drop_down:
                self.counts["dropped_down"] += 1
                continue
            self._send(out, destination)


def _nth(counts: dict[Address, int], address: Address, every: int) -> bool:
    """Count one more datagram for ``address``; whether it is an ``every``-th one."""
    counts[address] = counts.get(address, 0) + 1
    return counts[address] % every == 0
