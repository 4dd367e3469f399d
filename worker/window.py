"""How many slots of the pool a worker keeps in flight: ``CongestionWindow``, a delay-based
congestion window (docs/reliability.md, "The congestion window"). Both data paths share one
window per client, like the RTO estimator (``ncina.worker.timing``): the Python loop
(``ncina.worker.transfer``) calls it directly, the C one (``worker/transfer.c``) calls its C twin
``worker/window.c``, which mirrors this class operation for operation, with the state copied in
before a call and back after (``ncina.worker.cpath``).

The window only limits how many slots have a chunk outstanding: chunk ``i`` still goes into slot
``i % S``, and a slot is reused only after its result arrived (SwitchML's slot semantics); chunks
start in order, each when the window has room and its slot is free.
"""

from __future__ import annotations

WINDOW_MODES = ("adaptive", "fixed")
WINDOW_ENV = "NCINA_CWND"  # the mode when the client is given none


class CongestionWindow:
    """A congestion window in slots, grown and shrunk from the round trips and losses measured.

    ``limit`` is the number of slots that may have a chunk outstanding: ``cwnd`` rounded down,
    at least 1 and at most the pool (``fixed``: always the pool, and none of the rules below).

    - **Delay** (LEDBAT, RFC 6817, with the minimum RTT as the base): every result of a chunk
      sent once gives an RTT; ``base`` is the smallest seen, and ``rtt - base`` the queueing
      delay this worker's window (and the others') built on the path. Each such result moves
      ``cwnd`` by ``GAIN * off / cwnd``, ``off = (TARGET - delay) / TARGET`` clamped to
      ``[-1, 1]``: at most ``GAIN`` slots per window of results, up while the queue is shorter
      than ``TARGET``, down while it is longer. The window settles where the bottleneck holds
      ``TARGET`` seconds of queue, whatever its bandwidth: enough to keep the link busy across a
      descheduled worker, and well under the 20 ms floor of the RTO, which a window that queues
      longer than the RTO learnt on the idle path turns into copies on the wire.
    - **Slow start**: from ``INITIAL`` slots, one more per such result (doubling per round trip)
      until a delay reaches ``TARGET``; the first round of a call on a slow link then queues
      ``INITIAL`` chunks, not the pool.
    - **Loss**: a timer check that re-sends chunks while results still arrive halves ``cwnd``
      when the last delay was at or above ``TARGET`` (the queue was full: congestion), at most
      once per window of results; a timeout without a queue is random loss or a wait for
      another worker, which a smaller window does not help, and is left alone (as TCP Veno
      tells random from congestive losses by the queue it measures).
    - **Stall** (``stall``): no result for a whole RTO, as when the other workers have not sent
      their chunks yet (a DDP bucket that one rank reaches late) or the path lost everything:
      ``cwnd`` drops to 1 and slow start begins again (TCP's response to a timeout; the
      queue, if any, has drained), and the transfer re-sends one chunk
      rather than the whole window; the window before is kept, and the first result of a chunk
      sent once puts it back (its first copy was answered: nothing was lost, the window waited).

    The rules are fed by the transfers, so that both data paths make the same decisions:
    ``sample`` per result (with its RTT when its chunk was sent once), ``loss`` per timer check
    that re-sent chunks while results arrive, ``stall`` per timer check with no result for an RTO.
    """

    TARGET = 0.005  # queueing delay aimed at (s): a quarter of the RTO's default floor
    GAIN = 1.0  # slots per window of results at full off-target
    INITIAL = 8  # slots in flight before the first round trip

    def __init__(self, pool: int, mode: str = "adaptive") -> None:
        if pool < 1:
            raise ValueError(f"the pool must hold at least one slot, got {pool}")
        if mode not in WINDOW_MODES:
            raise ValueError(f"the window mode must be one of {WINDOW_MODES}, got {mode!r}")
        self.pool = pool
        self.adaptive = mode == "adaptive"
        self.cwnd = float(min(pool, self.INITIAL) if self.adaptive else pool)
        self.base = 0.0  # smallest RTT seen (s), 0: none yet
        self.delay = 0.0  # the last sample's queueing delay (s)
        self.slow_start = True
        self.since_cut = 0  # samples since the last halving
        self.saved = 0.0  # cwnd before a stall, 0: no stall pending
        self.cuts = 0  # halvings on congestive loss
        self.stalls = 0  # timer checks that found no result for an RTO

    @property
    def limit(self) -> int:
        """Slots that may have a chunk outstanding (1..pool)."""
        return min(self.pool, max(1, int(self.cwnd)))

    def sample(self, rtt: float) -> None:
        """A result came back: of a chunk sent once ``rtt`` seconds before, or of a re-sent
        chunk (``rtt`` negative: no measurement, the last delay stands; Karn's rule), which
        grows the window all the same, or a window that lost everything would stay at one."""
        if not self.adaptive:
            return
        if rtt >= 0.0:
            if self.base == 0.0 or rtt < self.base:
                self.base = rtt
            self.delay = rtt - self.base
            if self.saved > 0.0:  # its first copy was answered: the stall lost nothing
                self.cwnd = max(self.cwnd, self.saved)
                self.saved = 0.0
        self.since_cut += 1
        if self.slow_start and self.delay < self.TARGET:
            self.cwnd += 1.0
        else:
            self.slow_start = False
            off = (self.TARGET - self.delay) / self.TARGET
            off = min(1.0, max(-1.0, off))
            self.cwnd += self.GAIN * off / self.cwnd
        self.cwnd = min(float(self.pool), max(1.0, self.cwnd))

    def loss(self) -> None:
        """A timer check re-sent chunks while results still arrive."""
        if not self.adaptive or self.delay < self.TARGET or self.since_cut < self.cwnd:
            return
        self.cwnd = max(1.0, self.cwnd / 2.0)
        self.slow_start = False
        self.since_cut = 0
        self.cuts += 1

    def stall(self) -> bool:
        """A timer check found no result for an RTO. Says whether the transfer holds back the
        chunks it has not re-sent yet (all but one: adaptive only)."""
        if not self.adaptive:
            return False
        if self.saved == 0.0:
            self.saved = self.cwnd
        self.cwnd = 1.0
        self.slow_start = True
        self.delay = 0.0  # no result for an RTO: whatever queue there was has drained
        self.stalls += 1
        return True
